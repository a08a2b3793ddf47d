"""The trainer's fused CPU kernels: each op against float64 torch on shapes with 16-float tails,
values and gradients; the weight gradient's bits whatever the thread count; the modules of
real families fused only where they compute their own function, through mode changes, and
undone by `own_forwards`; a Trainer with `kernels=auto` and `kernels=torch` computing the same
step; nothing fused where the kernels cannot be built."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2MoeConfig, Qwen3Config

from dorarl.trainer import Trainer, TrainerConfig, kernels

OPS = kernels.load_ops()
pytestmark = pytest.mark.skipif(OPS is None, reason="the kernels did not build here")

SHAPE = dict(
    vocab_size=97, hidden_size=40, intermediate_size=72, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 2e-6) -> None:
    """Within `tol` of the largest magnitude (float32 sums against float64)."""
    assert (got.double() - want).abs().max() <= tol * want.abs().max().clamp(min=1.0)


@pytest.mark.parametrize("rows,hidden", [(1, 16), (70, 37), (33, 576), (5, 3)])
def test_rms_norm_and_its_gradients_against_float64(rows, hidden):
    gen = torch.Generator().manual_seed(rows + hidden)
    x = torch.randn(rows, hidden, generator=gen, dtype=torch.float64) * 3
    w = torch.randn(hidden, generator=gen, dtype=torch.float64)
    dy = torch.randn(rows, hidden, generator=gen, dtype=torch.float64)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = wr * (xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-5))
    want.backward(dy)
    y, rstd = OPS.rms_norm_fwd(x.float(), w.float(), 1e-5)
    dx, dw = OPS.rms_norm_bwd(dy.float(), x.float(), w.float(), rstd)
    _close(y, want.detach())
    _close(dx, xr.grad)
    _close(dw, wr.grad, 1e-5)


@pytest.mark.parametrize("shape", [(7,), (3, 333), (2, 5, 1536)])
def test_silu_mul_and_its_gradients_against_float64(shape):
    gen = torch.Generator().manual_seed(len(shape))
    gate = torch.randn(shape, generator=gen, dtype=torch.float64) * 6  # saturated both ways
    up = torch.randn(shape, generator=gen, dtype=torch.float64)
    dh = torch.randn(shape, generator=gen, dtype=torch.float64)
    gr, ur = gate.clone().requires_grad_(), up.clone().requires_grad_()
    want = F.silu(gr) * ur
    want.backward(dh)
    _close(OPS.silu_mul_fwd(gate.float(), up.float()), want.detach())
    d_gate, d_up = OPS.silu_mul_bwd(dh.float(), gate.float(), up.float())
    _close(d_gate, gr.grad)
    _close(d_up, ur.grad)


def test_head_statistics_and_gradient_against_float64():
    gen = torch.Generator().manual_seed(5)
    scaled = torch.randn(9, 1003, generator=gen, dtype=torch.float64) * 20
    scaled[0] = 0.0  # a uniform row: entropy log(vocab)
    targets = torch.randint(0, 1003, (9,), generator=gen)
    g_logp, g_entropy = torch.randn(9, dtype=torch.float64), torch.randn(9, dtype=torch.float64)
    z = scaled.clone().requires_grad_()
    logp_all = torch.log_softmax(z, -1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    ((logp * g_logp).sum() + (entropy * g_entropy).sum()).backward()
    lse, got_logp, got_entropy = OPS.head_stats(scaled.float(), targets)
    _close(lse, torch.logsumexp(scaled, -1))
    _close(got_logp, logp.detach(), 1e-6)
    _close(got_entropy, entropy.detach(), 1e-6)
    grad = scaled.float()
    OPS.head_grad_(grad, lse, targets, got_entropy, g_logp.float(), g_entropy.float(), 0.5)
    _close(grad, z.grad * 0.5, 1e-5)  # logits near 60: a float32 ulp is 4e-6


def test_head_refuses_a_target_outside_the_vocabulary():
    with pytest.raises(RuntimeError, match="outside"):
        OPS.head_stats(torch.zeros(2, 16), torch.tensor([3, 16]))


def test_weight_gradient_bits_do_not_depend_on_the_thread_count():
    gen = torch.Generator().manual_seed(9)
    x, dy = torch.randn(2, 301, 64, generator=gen)
    w = torch.randn(64, generator=gen)
    _, rstd = OPS.rms_norm_fwd(x, w, 1e-6)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(OPS.rms_norm_bwd(dy, x, w, rstd))
    finally:
        torch.set_num_threads(threads)
    for dx, dw in results[1:]:
        assert torch.equal(dx, results[0][0]) and torch.equal(dw, results[0][1])


FAMILIES = {
    "llama": (lambda: LlamaConfig(**SHAPE), {"LlamaRMSNorm": 5, "LlamaMLP": 2}),
    # q_norm and k_norm normalise each head's 16 floats
    "qwen3": (lambda: Qwen3Config(**SHAPE, head_dim=16), {"Qwen3RMSNorm": 9, "Qwen3MLP": 2}),
    # the shared expert is a SwiGLU MLP, the routed experts a fused tensor the kernels leave
    "qwen2_moe": (
        lambda: Qwen2MoeConfig(
            **SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=24, mlp_only_layers=[0],
        ),
        {"Qwen2MoeRMSNorm": 5, "Qwen2MoeMLP": 2},
    ),
}  # fmt: skip


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, use_cache=False).logits
    (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
    return logits.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


@pytest.mark.parametrize("family", list(FAMILIES))
def test_families_fuse_and_compute_their_own_function(family):
    make, expected = FAMILIES[family]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make()).train()
    ids = torch.randint(0, 97, (2, 11))
    want_logits, want_grads = _loss_and_grads(model, ids)
    assert kernels.fuse_modules(model) == expected
    model.eval()
    model.train()  # transformers' hub kernels reset instance forwards on a mode change
    assert sum(type(m).__name__.startswith("Fused") for m in model.modules()) == sum(
        expected.values()
    )
    logits, grads = _loss_and_grads(model, ids)
    _close(logits, want_logits.double(), 1e-5)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        _close(grad, want_grads[name].double(), 1e-4)
    with kernels.own_forwards(model):
        assert not any(type(m).__name__.startswith("Fused") for m in model.modules())
    assert kernels.fuse_modules(model) == {}  # already fused: nothing twice


class OnePlusRMSNorm(torch.nn.Module):
    """Gemma's variant: (1 + weight) scales; the same attributes as Llama's."""

    def __init__(self, hidden: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(hidden))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        return (1 + self.weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_a_variant_keeps_its_own_forward():
    model = torch.nn.Sequential(OnePlusRMSNorm(24))
    assert kernels.fuse_modules(model) == {}
    assert type(model[0]) is OnePlusRMSNorm


def test_tensors_the_kernels_do_not_take_go_through_the_own_forward():
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE))
    kernels.fuse_modules(model)
    norm = model.model.norm
    x = torch.randn(3, 40, dtype=torch.bfloat16)
    with kernels.own_forwards(model):
        want = norm.to(torch.bfloat16)(x)
    assert torch.equal(norm(x), want)


def test_nothing_is_fused_where_the_kernels_cannot_be_built(monkeypatch):
    monkeypatch.setattr(kernels, "load_ops", lambda: None)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE))
    assert kernels.fuse_modules(model) == {}


def test_trainer_steps_the_same_with_fused_kernels_and_torch_ops(make_groups):
    groups = make_groups(0, vocab=97)
    steps = {}
    for mode in ("auto", "torch"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE))
        trainer = Trainer(model, TrainerConfig(lr=1e-3, kernels=mode))
        assert trainer.fused == (mode == "auto") and trainer.split.fused == trainer.fused
        fused = [type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Fused")]
        assert len(fused) == (7 if mode == "auto" else 0)
        steps[mode] = (trainer.train_step(groups), [p.detach().clone() for p in model.parameters()])
    for key in ("loss", "pg_loss", "grad_norm", "entropy"):
        assert steps["auto"][0][key] == pytest.approx(steps["torch"][0][key], rel=1e-5, abs=1e-7)
    for fused, own in zip(steps["auto"][1], steps["torch"][1], strict=True):
        _close(fused, own.double(), 1e-5)
