"""The sharded trainer (FSDP2, gloo, world size 2) against one process: same losses, grad
norms and weights; sharded checkpoints resumed at world sizes 1 and 2."""

import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import _make_groups  # noqa: E402
from ranks import run_ranks  # noqa: E402

from dorarl.trainer import Trainer, TrainerConfig  # noqa: E402
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


def _config(micro_batch_tokens: int) -> TrainerConfig:
    return TrainerConfig(lr=1e-3, micro_batch_tokens=micro_batch_tokens, max_grad_norm=0.5)


def _batches(start: int = 0) -> list:
    return [_make_groups(seed=10 + step) for step in range(start, start + STEPS)]


def _steps(trainer: Trainer, batches: list) -> list[tuple[float, float]]:
    return [(m["loss"], m["grad_norm"]) for m in (trainer.train_step(groups) for groups in batches)]


def _sharded_run(group, folder, micro_batch_tokens, batches):
    trainer = ShardedTrainer.from_pretrained_group(folder, _config(micro_batch_tokens), group)
    history = _steps(trainer, batches)
    return history, trainer.named_tensors()


def _assert_close(got: dict, want: dict, rel: float = 1e-5) -> None:
    """Each tensor within `rel` of the reference, relative to its norm. (Element-wise,
    AdamW magnifies rounding where a gradient is near eps: g / (|g| + eps) is steep.)"""
    assert got.keys() == want.keys()
    for name in want:
        error = float((got[name] - want[name]).norm() / want[name].norm())
        assert error <= rel, f"{name}: relative error {error:.2e}"


@pytest.mark.parametrize("micro_batch_tokens", [10**6, 24])
def test_world_size_two_equals_one_process(tied_model_dir, micro_batch_tokens):
    batches = _batches()
    single = Trainer.from_pretrained(tied_model_dir, _config(micro_batch_tokens))
    want = _steps(single, batches)
    got, weights = run_ranks(_sharded_run, 2, tied_model_dir, micro_batch_tokens, batches)
    for (loss, norm), (want_loss, want_norm) in zip(got, want, strict=True):
        assert loss == pytest.approx(want_loss, rel=1e-5)
        assert norm == pytest.approx(want_norm, rel=1e-5)
    assert weights.keys() == single.named_tensors().keys()
    _assert_close(weights, single.named_tensors())
    moved = single.named_tensors()["model.norm.weight"] - 1.0
    assert float(moved.abs().max()) > 1e-3  # the steps did change the weights
