"""trainer.autocast=bf16: bfloat16 decoder products, float32 weights, gradients, log-probs
and loss; refused in one line where bf16 products would not be native."""

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dorarl.config import ConfigError, load_config
from dorarl.jobs.config import TrainConfig
from dorarl.trainer import Trainer, TrainerConfig
from dorarl.trainer import autocast as autocast_mod
from dorarl.trainer import trainer as trainer_mod
from dorarl.trainer.autocast import cpu_flags, has_bf16
from dorarl.trainer.batch import build_sequences
from dorarl.trainer.chunked_head import ChunkedHeadLogprobs
from dorarl.trainer.packing import micro_batches

needs_bf16 = pytest.mark.skipif(
    not has_bf16(cpu_flags()), reason="this CPU has neither avx512_bf16 nor amx_bf16"
)
# |logp_bf16 - logp_fp32| on the tiny model below, about five times what it measures (a
# mean of 3-4e-4, a largest of 1-2e-3 over four seeds): bf16 products round to 8 bits.
MEAN_TOL, MAX_TOL = 2e-3, 1e-2


def _model(seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def _no_bf16(monkeypatch) -> None:
    monkeypatch.setattr(autocast_mod, "cpu_flags", lambda: {"avx2", "avx512f"})


def test_cpu_flags_read_the_flags_line(tmp_path: Path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f amx_bf16 amx_tile\nbugs\t: x\n")
    flags = cpu_flags(info)
    assert flags == {"fpu", "avx512f", "amx_bf16", "amx_tile"} and has_bf16(flags)
    assert not has_bf16({"avx512f", "avx2"})
    assert cpu_flags(tmp_path / "missing") == set()


def test_bf16_is_refused_on_a_cpu_without_native_bf16(monkeypatch):
    _no_bf16(monkeypatch)
    TrainerConfig(autocast="none").validate()
    with pytest.raises(ConfigError, match=r"^autocast: bf16 needs a CPU with avx512_bf16"):
        TrainerConfig(autocast="bf16").validate()
    with pytest.raises(ConfigError, match=r"^trainer\.autocast: bf16 needs a CPU") as err:
        load_config(TrainConfig, overrides=["trainer.autocast=bf16"]).validate()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"device": "cuda"}, "is for trainer.device=cpu"),
        ({"dtype": "bfloat16"}, "keeps float32 master weights"),
    ],
)
def test_bf16_is_refused_where_it_does_not_apply(settings, words):
    with pytest.raises(ConfigError, match=rf"^autocast: bf16 .*{words}"):
        TrainerConfig(autocast="bf16", **settings).validate()


def _trainer(autocast: str) -> Trainer:
    return Trainer(_model(), TrainerConfig(autocast=autocast, lr=1e-3))


def _batch(trainer: Trainer, groups):
    seqs = build_sequences(groups, trainer.config.loss)
    (batch,) = micro_batches(
        seqs, 10**6, trainer.packing, trainer.pad_id, "cpu", trainer.model.config
    )
    return batch


@needs_bf16
def test_bf16_step_keeps_float32_params_grads_logprobs_and_loss(monkeypatch, make_groups):
    trainer = _trainer("bf16")
    seen: dict[str, object] = {}
    objective = trainer_mod.objective

    def spy(logp, *args, **kwargs):
        loss, terms = objective(logp, *args, **kwargs)
        seen.update(logp=logp.dtype, loss=loss.dtype, autocast=torch.is_autocast_enabled("cpu"))
        return loss, terms

    monkeypatch.setattr(trainer_mod, "objective", spy)
    q_proj = trainer.model.model.layers[0].self_attn.q_proj
    hook = q_proj.register_forward_hook(lambda m, i, out: seen.update(q_proj=out.dtype))
    trainer.accumulate_gradients(make_groups(seed=1, vocab=300))
    hook.remove()
    assert seen["q_proj"] == torch.bfloat16  # the decoder's products did run in bf16
    assert seen["logp"] == seen["loss"] == torch.float32 and seen["autocast"] is False
    params = list(trainer.model.parameters())
    assert all(p.dtype == torch.float32 for p in params)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in params)
    metrics = trainer.train_step(make_groups(seed=1, vocab=300))
    assert metrics["update_applied"] == 1.0
    assert all(s["exp_avg"].dtype == torch.float32 for s in trainer.optimizer.state.values())


@needs_bf16
def test_bf16_output_layer_computes_float32_logits(monkeypatch, make_groups):
    """The chunked head opts out of autocast: its logits are float32 products."""
    trainer = _trainer("bf16")
    dtypes: list[torch.dtype] = []
    forward = ChunkedHeadLogprobs.forward

    def spy(ctx, hidden, weight, *rest):
        dtypes.append(torch.nn.functional.linear(hidden[:1], weight).dtype)
        return forward(ctx, hidden, weight, *rest)

    monkeypatch.setattr(ChunkedHeadLogprobs, "forward", staticmethod(spy))
    trainer.accumulate_gradients(make_groups(seed=2, vocab=300))
    assert dtypes and set(dtypes) == {torch.float32}


@needs_bf16
def test_bf16_logprobs_and_gradients_stay_near_float32(make_groups):
    groups = make_groups(seed=3, vocab=300)
    exact, mixed = _trainer("none"), _trainer("bf16")
    with torch.no_grad():
        logp = {}
        for name, trainer in (("fp32", exact), ("bf16", mixed)):
            batch = _batch(trainer, groups)
            with autocast_mod.autocast_context(trainer.config.autocast, trainer.device):
                logp[name] = trainer._policy_logprobs(batch)[0]
    gap = (logp["bf16"] - logp["fp32"]).abs()
    assert 0 < float(gap.mean()) < MEAN_TOL and float(gap.max()) < MAX_TOL
    exact.accumulate_gradients(groups)
    mixed.accumulate_gradients(groups)
    for (name, p), q in zip(exact.model.named_parameters(), mixed.model.parameters(), strict=True):
        cos = torch.nn.functional.cosine_similarity(p.grad.flatten(), q.grad.flatten(), dim=0)
        assert float(cos) > 0.99, name
