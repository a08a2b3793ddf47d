"""The sharded trainer (FSDP2, gloo, world size 2) against one process: same losses, grad
norms and weights; sharded checkpoints resumed at world sizes 1 and 2."""

import random
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import _make_groups  # noqa: E402
from ranks import run_ranks  # noqa: E402

from dorarl.data import SegmentStart  # noqa: E402
from dorarl.runtime.transfer.weight_layout import wire_tensors  # noqa: E402
from dorarl.trainer import LossConfig, Trainer, TrainerConfig  # noqa: E402
from dorarl.trainer.sharded import ShardedTrainer  # noqa: E402

STEPS = 3


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama with tied embeddings, as SmolLM2 has (the shared weight sits in the root)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    folder = tmp_path_factory.mktemp("tied")
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


PACKINGS = ("shared_prompt", "padded")


def _config(
    micro_batch_tokens: int, checkpointing: bool = False, packing: str = "shared_prompt"
) -> TrainerConfig:
    # adam_eps well above fp32 rounding of a gradient element: at 1e-8 an element that
    # cancels to ~4e-10 (seen in layer 2's gate_proj) takes a first AdamW step of ~lr * g / eps,
    # so the rounding of a sum taken in another order (over ranks, or by another CPU's
    # kernels) moved one weight by 2.4e-5 and the tensor by 2.7e-5 of its norm. That is
    # AdamW magnifying fp32 rounding, not the ranks computing anything else.
    return TrainerConfig(
        lr=1e-3,
        adam_eps=1e-6,
        micro_batch_tokens=micro_batch_tokens,
        max_grad_norm=0.5,
        activation_checkpointing=checkpointing,
        packing=packing,
    )


def _batches(start: int = 0) -> list:
    return [_make_groups(seed=10 + step) for step in range(start, start + STEPS)]


def _steps(trainer: Trainer, batches: list) -> list[tuple[float, float]]:
    return [(m["loss"], m["grad_norm"]) for m in (trainer.train_step(groups) for groups in batches)]


def _steps_and_mismatch(trainer: Trainer, batches: list) -> tuple[list, list[dict]]:
    """`_steps`, and each step's engine/trainer log-prob figures (`rollout_*`)."""
    metrics = [trainer.train_step(groups) for groups in batches]
    figures = [{k: v for k, v in m.items() if k.startswith("rollout_")} for m in metrics]
    return [(m["loss"], m["grad_norm"]) for m in metrics], figures


def _sharded_runs(group, folder, micro_batch_tokens, checkpointing, batches):
    """One run per packing mode on the same ranks (one spawn: most of a run's time)."""
    runs = {}
    for packing in PACKINGS:
        config = _config(micro_batch_tokens, checkpointing, packing)
        trainer = ShardedTrainer.from_pretrained_group(folder, config, group)
        assert trainer.packing == packing
        steps, figures = _steps_and_mismatch(trainer, batches)
        runs[packing] = (steps, trainer.named_tensors(), figures)
    runs["sent"] = _sent_names(trainer)
    return runs


def _sent_names(trainer: Trainer) -> list[str]:
    """The names a published version carries (tied aliases dropped, as a peer hosts it)."""
    return list(wire_tensors(trainer.named_tensors(on_device=True), torch.float32))


def _assert_close(got: dict, want: dict, rel: float = 1e-5) -> None:
    """Each tensor within `rel` of the reference, relative to its norm. (Element-wise,
    AdamW magnifies rounding where a gradient is near eps: g / (|g| + eps) is steep.)"""
    assert got.keys() == want.keys()
    for name in want:
        error = float((got[name] - want[name]).norm() / want[name].norm())
        assert error <= rel, f"{name}: relative error {error:.2e}"


# 22 tokens: several micro-batches per rank, and in both modes a step where one rank has
# fewer than the other (its filler passes must add nothing).
@pytest.mark.parametrize(
    ("micro_batch_tokens", "checkpointing"), [(10**6, False), (22, False), (22, True)]
)
def test_world_size_two_equals_one_process(tied_model_dir, micro_batch_tokens, checkpointing):
    """In both packing modes: packed, each rank takes whole groups and packs its rows."""
    batches = _batches()
    runs = run_ranks(_sharded_runs, 2, tied_model_dir, micro_batch_tokens, checkpointing, batches)
    sent = runs.pop("sent")
    assert sent == _sent_names(Trainer.from_pretrained(tied_model_dir, _config(10**6)))
    assert "lm_head.weight" not in sent  # gathered once, sent once: the engines tie it
    for packing, (got, weights, figures) in runs.items():
        single = Trainer.from_pretrained(
            tied_model_dir, _config(micro_batch_tokens, packing=packing)
        )
        want, want_figures = _steps_and_mismatch(single, batches)
        for (loss, norm), (want_loss, want_norm) in zip(got, want, strict=True):
            assert loss == pytest.approx(want_loss, rel=1e-5), packing
            assert norm == pytest.approx(want_norm, rel=1e-5), packing
        # every rank's tokens in the step's figures: percentiles as one process takes them
        assert (
            want_figures[0]["rollout_fresh_tokens"] > 0
            and "rollout_ratio_p1_fresh" not in want_figures[1]
        )
        for step, want_step in zip(figures, want_figures, strict=True):
            assert step.keys() == want_step.keys() and "rollout_ratio_p99" in step
            for key, value in want_step.items():
                assert step[key] == pytest.approx(value, rel=1e-5), (packing, key)
        assert weights.keys() == single.named_tensors().keys()
        _assert_close(weights, single.named_tensors())
        moved = single.named_tensors()["model.norm.weight"] - 1.0
        assert float(moved.abs().max()) > 1e-3  # the steps did change the weights


def _with_segments(groups: list) -> list:
    """Each group's first sample becomes an episode of two segments: its response, then a
    second prompt (observed tokens) and what was sampled under it."""
    rng = random.Random(len(groups[0].samples[0].response_ids))
    for group in groups:
        s = group.samples[0]
        prompt = [2, *(rng.randrange(4, 100) for _ in range(rng.randint(3, 9)))]
        more = [rng.randrange(4, 100) for _ in range(rng.randint(1, 8))]
        s.segments = [SegmentStart(len(s.response_ids), len(prompt))]
        s.observed = [False] * len(s.response_ids) + [True] * len(prompt) + [False] * len(more)
        s.logprobs = s.logprobs + [0.0] * len(prompt) + [-rng.uniform(3.0, 6.0) for _ in more]
        s.response_ids = s.response_ids + prompt + more
        s.versions = [group.version] * len(s.response_ids)
    return groups


def test_world_size_two_equals_one_process_with_segmented_episodes(tied_model_dir):
    """Each segment of an episode is a sequence of its own prompt: dealt and packed as one."""
    batches = [_with_segments(groups) for groups in _batches()]
    runs = run_ranks(_sharded_runs, 2, tied_model_dir, 22, False, batches)
    runs.pop("sent")
    for packing, (got, weights, _) in runs.items():
        single = Trainer.from_pretrained(tied_model_dir, _config(22, packing=packing))
        want = _steps(single, batches)
        for (loss, norm), (want_loss, want_norm) in zip(got, want, strict=True):
            assert loss == pytest.approx(want_loss, rel=1e-5), packing
            assert norm == pytest.approx(want_norm, rel=1e-5), packing
        _assert_close(weights, single.named_tensors())


def _full_optimizer_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    from dorarl.trainer import checkpoint as ckpt

    tensors, _ = ckpt.optimizer_state_by_name(trainer.optimizer, trainer._param_names())
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in tensors.items()
    }


def _save_midway(group, folder, checkpoint, first, then):
    """3 steps, a sharded checkpoint, 3 more steps: the uninterrupted run at world size 2."""
    trainer = ShardedTrainer.from_pretrained_group(folder, _config(24), group)
    _steps(trainer, first)
    trainer.save_checkpoint(checkpoint, {"position": [7, 8]})
    saved = (trainer.named_tensors(), _full_optimizer_state(trainer))
    return _steps(trainer, then), trainer.named_tensors(), saved


def _resume_sharded(group, checkpoint, then):
    trainer, extra = ShardedTrainer.resume(checkpoint, _config(24), group=group)
    state = (trainer.named_tensors(), _full_optimizer_state(trainer))
    return _steps(trainer, then), trainer.named_tensors(), state, extra, trainer.version


def _assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_sharded_checkpoint_resumes_bit_for_bit_at_two_and_at_one(tied_model_dir, tmp_path):
    checkpoint = tmp_path / "checkpoints" / "version_00003"
    first, then = _batches(0), _batches(STEPS)
    history, weights, (saved_weights, saved_moments) = run_ranks(
        _save_midway, 2, tied_model_dir, checkpoint, first, then
    )
    assert (checkpoint / "shards").is_dir() and not checkpoint.with_name(
        "version_00003.tmp"
    ).exists()
    consolidated = LlamaForCausalLM.from_pretrained(checkpoint, use_safetensors=True)
    _assert_equal(
        {k: v for k, v in consolidated.state_dict().items() if k in saved_weights}, saved_weights
    )

    again, weights_again, state, extra, version = run_ranks(_resume_sharded, 2, checkpoint, then)
    assert version == 2 * STEPS and extra == {"position": [7, 8]}
    _assert_equal(state[0], saved_weights)
    _assert_equal(state[1], saved_moments)
    assert again == history  # bit for bit: losses and grad norms
    _assert_equal(weights_again, weights)

    single, extra_single = Trainer.resume(checkpoint, _config(24))
    assert extra_single == {"position": [7, 8]} and single.version == STEPS
    _assert_equal(single.named_tensors(), saved_weights)
    _assert_equal(_full_optimizer_state(single), saved_moments)
    for (loss, norm), (want_loss, want_norm) in zip(_steps(single, then), history, strict=True):
        assert loss == pytest.approx(want_loss, rel=1e-5)
        assert norm == pytest.approx(want_norm, rel=1e-5)
    _assert_close(single.named_tensors(), weights)


def test_a_one_process_checkpoint_resumes_at_world_size_two(tied_model_dir, tmp_path):
    single = Trainer.from_pretrained(tied_model_dir, _config(24))
    _steps(single, _batches(0))
    checkpoint = single.save_checkpoint(tmp_path / "version_00003", {"position": []})
    saved = (single.named_tensors(), _full_optimizer_state(single))
    want = _steps(single, _batches(STEPS))
    got, weights, state, _, version = run_ranks(_resume_sharded, 2, checkpoint, _batches(STEPS))
    assert version == 2 * STEPS
    _assert_equal(state[0], saved[0])
    _assert_equal(state[1], saved[1])
    for (loss, norm), (want_loss, want_norm) in zip(got, want, strict=True):
        assert loss == pytest.approx(want_loss, rel=1e-5)
        assert norm == pytest.approx(want_norm, rel=1e-5)
    _assert_close(weights, single.named_tensors())


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory) -> Path:
    from test_moe import save_moe

    return save_moe(tmp_path_factory.mktemp("moe"), "qwen3_moe")


def _moe_config(packing: str) -> TrainerConfig:
    config = _config(22, packing=packing)
    config.moe.aux_loss_coef = 0.01
    return config


ROUTING = ("moe_tokens_per_expert", "moe_imbalance", "moe_aux_loss")


def _moe_runs(group, folder, batches):
    runs = {}
    for packing in PACKINGS:
        trainer = ShardedTrainer.from_pretrained_group(folder, _moe_config(packing), group)
        steps = [trainer.train_step(groups) for groups in batches]
        figures = [(m["loss"], m["grad_norm"], *(m[k] for k in ROUTING)) for m in steps]
        runs[packing] = (figures, trainer.named_tensors())
    return runs


def test_an_moe_model_with_its_aux_loss_at_world_size_two_equals_one_process(moe_model_dir):
    """Qwen3-MoE under FSDP2: the experts' stacked tensors sharded, the load-balancing loss
    on, several micro-batches per rank (filler passes too): losses, gradient norms, expert
    load and weights as one process has them."""
    batches = _batches()
    runs = run_ranks(_moe_runs, 2, moe_model_dir, batches)
    for packing, (got, weights) in runs.items():
        single = Trainer.from_pretrained(moe_model_dir, _moe_config(packing))
        steps = [single.train_step(groups) for groups in batches]
        for mine, want in zip(got, steps, strict=True):
            loss, norm, per_expert, imbalance, aux = mine
            assert loss == pytest.approx(want["loss"], rel=1e-5), packing
            assert norm == pytest.approx(want["grad_norm"], rel=1e-5), packing
            assert per_expert == want["moe_tokens_per_expert"] and aux > 0
            assert imbalance == pytest.approx(want["moe_imbalance"], rel=1e-9)
            assert aux == pytest.approx(want["moe_aux_loss"], rel=1e-5)
        _assert_close(weights, single.named_tensors())


OBJECTIVE_KEYS = ("loss", "grad_norm", "is_masked_frac", "seq_ratio_mean", "seq_ratio_min",
                  "seq_ratio_max", "clip_frac_low", "clip_frac_high", "distill_kl")  # fmt: skip


def _objective_config(teacher: Path) -> TrainerConfig:
    config = _config(22)
    config.teacher = str(teacher)  # a teacher identical to the start: its reward is b's gap
    config.loss = LossConfig(
        distill_coef=0.2,
        ratio="sequence", kind="cispo", cispo_eps_low=0.1, cispo_eps_high=0.1,
        is_mask="sequence", is_mask_low=0.8, is_mask_high=1.5,
        advantage="reinforce_pp", aggregation="seq_sum_norm", norm_length=16,
    )  # fmt: skip
    return config


def _objective_steps(trainer: Trainer, batches: list) -> list[dict[str, float]]:
    return [{k: m[k] for k in OBJECTIVE_KEYS} for m in map(trainer.train_step, batches)]


def _objective_run(group, folder, batches):
    trainer = ShardedTrainer.from_pretrained_group(folder, _objective_config(folder), group)
    return _objective_steps(trainer, batches)


def test_world_size_two_equals_one_process_with_the_objectives(tied_model_dir):
    """GSPO's per-segment ratio, CISPO, the sequence mask, batch-normalised advantages, the
    constant normaliser and a teacher: losses, grad norms and the metrics each names,
    reduced over ranks."""
    batches = [_with_segments(groups) for groups in _batches()[:2]]
    got = run_ranks(_objective_run, 2, tied_model_dir, batches)
    single = Trainer.from_pretrained(tied_model_dir, _objective_config(tied_model_dir))
    want = _objective_steps(single, batches)
    for step, want_step in zip(got, want, strict=True):
        assert step == pytest.approx(want_step, rel=1e-5)
        assert 0 < step["is_masked_frac"] < 1
        assert step["clip_frac_low"] > 0 and step["clip_frac_high"] > 0
        assert step["seq_ratio_min"] < step["seq_ratio_max"]
