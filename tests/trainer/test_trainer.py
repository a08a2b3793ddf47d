"""Trainer steps: micro-batch accumulation equals the full batch, versions, metrics, weights."""

import dataclasses
import math

import pytest
import torch

from dorarl.config import ConfigError
from dorarl.trainer import LossConfig, Trainer, TrainerConfig


def _grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_micro_batch_accumulation_equals_full_batch(tiny_model_dir, make_groups, aggregation):
    groups = make_groups(seed=1)
    loss = LossConfig(aggregation=aggregation, kl_coef=0.05)
    full = Trainer.from_pretrained(
        tiny_model_dir, TrainerConfig(micro_batch_tokens=10**6, loss=loss)
    )
    small = Trainer.from_pretrained(tiny_model_dir, TrainerConfig(micro_batch_tokens=24, loss=loss))
    m_full = full.accumulate_gradients(groups)
    m_small = small.accumulate_gradients(groups)
    assert m_full["micro_batches"] == 1 and m_small["micro_batches"] >= 6
    assert m_small["loss"] == pytest.approx(m_full["loss"], rel=1e-5, abs=1e-7)
    g_full, g_small = _grads(full), _grads(small)
    assert g_full.keys() == g_small.keys() and g_full
    for name in g_full:
        assert torch.allclose(g_full[name], g_small[name], rtol=1e-4, atol=1e-7), name


def test_equal_reward_groups_give_zero_policy_gradient(tiny_model_dir, make_groups):
    groups = make_groups(seed=2)
    for g in groups:
        for s in g.samples:
            s.reward = 1.0
    # computed, not skipped: trainer.skip_zero_advantage rests on this gradient being 0
    trainer = Trainer.from_pretrained(tiny_model_dir, TrainerConfig(skip_zero_advantage=False))
    metrics = trainer.accumulate_gradients(groups)
    assert metrics["pg_loss"] == 0.0 and metrics["tokens"] > 0
    grads = _grads(trainer)
    assert grads and all(float(g.abs().max()) == 0.0 for g in grads.values())


def test_train_step_bumps_version_changes_weights_and_reports_metrics(tiny_model_dir, make_groups):
    trainer = Trainer.from_pretrained(tiny_model_dir, TrainerConfig(lr=1e-3), version=4)
    before = trainer.named_tensors()
    groups = make_groups(seed=3, version=3)
    groups[0].version = 2
    for s in groups[0].samples:
        s.versions = [2] * len(s.response_ids)
    metrics = trainer.train_step(groups)
    after = trainer.named_tensors()
    assert trainer.version == 5 and metrics["version"] == 5
    assert metrics["staleness_hist"] == {1: 8, 2: 4}
    tokens = [len(s.response_ids) for g in groups for s in g.samples]
    expected = (sum(tokens[:4]) * 2 + sum(tokens[4:])) / sum(tokens)
    assert metrics["staleness_token_mean"] == pytest.approx(expected)
    assert metrics["update_applied"] == 1.0 and metrics["grad_norm"] > 0
    assert metrics["tokens"] == sum(len(s.response_ids) for g in groups for s in g.samples)
    for key in (
        "loss",
        "clip_frac_low",
        "clip_frac_high",
        "ratio_mean",
        "kl_behavior",
        "entropy",
        "reward_mean",
        "reward_std",
        "response_len_mean",
        "response_len_max",
    ):
        assert key in metrics
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # named_tensors are copies: a later step must not change what was handed out.
    snapshot = {k: v.clone() for k, v in after.items()}
    trainer.train_step(make_groups(seed=4, version=5))
    assert all(torch.equal(snapshot[k], after[k]) for k in after)


def test_behavior_logprobs_from_the_model_give_ratio_one(tiny_model_dir, make_groups):
    trainer = Trainer.from_pretrained(tiny_model_dir, TrainerConfig())
    groups = make_groups(seed=5)
    _fill_true_logprobs(trainer, groups)
    metrics = trainer.accumulate_gradients(groups)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["clip_frac_low"] == 0.0 and metrics["clip_frac_high"] == 0.0
    assert metrics["kl_behavior"] == pytest.approx(0.0, abs=1e-6)


def _fill_true_logprobs(trainer: Trainer, groups) -> None:
    from dorarl.trainer.loss import token_logprobs

    for g in groups:
        for s in g.samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            with torch.no_grad():
                logits = trainer.model(input_ids=ids).logits[:, :-1]
            lp = token_logprobs(logits, ids[:, 1:])[0, len(s.prompt_ids) - 1 :]
            s.logprobs = lp.tolist()


def test_mismatched_logprobs_are_rejected(tiny_model_dir, make_groups):
    trainer = Trainer.from_pretrained(tiny_model_dir, TrainerConfig())
    groups = make_groups(seed=6)
    groups[1].samples[2].logprobs.pop()
    with pytest.raises(ValueError, match="logprobs for"):
        trainer.train_step(groups)


def test_empty_batch_still_bumps_the_version_without_update(tiny_model_dir, make_groups):
    trainer = Trainer.from_pretrained(tiny_model_dir, TrainerConfig())
    groups = make_groups(seed=7)
    for g in groups:
        for s in g.samples:
            s.response_ids, s.logprobs, s.versions = [], [], []
    before = trainer.named_tensors()
    metrics = trainer.train_step(groups)
    assert trainer.version == 1 and metrics["update_applied"] == 0.0
    assert all(torch.equal(before[k], v) for k, v in trainer.named_tensors().items())


def test_mixed_version_samples_train_on_their_per_token_logprobs(tiny_model_dir, make_groups):
    # A partial-rollout sample: its first tokens from version 1, the rest from version 3.
    # (Every token computed, whatever its group's rewards: the ratio is checked over all.)
    config = TrainerConfig(skip_zero_advantage=False)
    trainer = Trainer.from_pretrained(tiny_model_dir, config, version=3)
    groups = make_groups(seed=8, version=3)
    _fill_true_logprobs(trainer, groups)
    mixed = groups[0].samples[0]
    mixed.response_ids = mixed.response_ids[:1] + [5, 6, 7]
    _fill_true_logprobs(trainer, groups)
    mixed.versions = [1] + [3] * 3
    mixed.logprobs[0] -= 0.1  # the old version gave its token a little less mass
    metrics = trainer.accumulate_gradients(groups)
    total = sum(len(s.response_ids) for g in groups for s in g.samples)
    assert metrics["ratio_mean"] == pytest.approx((total - 1 + math.exp(0.1)) / total, rel=1e-5)
    stats = trainer.train_step(groups)
    assert stats["mixed_version_samples"] == 1.0 and stats["staleness_max"] == 2.0
    assert stats["staleness_token_mean"] == pytest.approx(2 / total)


def test_a_qwen2_model_trains_and_round_trips(tmp_path, make_groups):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=101,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(str(tmp_path / "qwen"))
    trainer = Trainer.from_pretrained(tmp_path / "qwen", TrainerConfig(lr=1e-3))
    metrics = trainer.train_step(make_groups(seed=9))
    assert metrics["update_applied"] == 1.0
    folder = trainer.save_checkpoint(tmp_path / "ckpt")
    resumed, _ = Trainer.resume(folder, TrainerConfig(lr=1e-3))
    assert resumed.model.config.model_type == "qwen2"
    for name, tensor in resumed.named_tensors().items():
        assert torch.equal(tensor, trainer.named_tensors()[name]), name


def _wide_vocab_model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    model_config = LlamaConfig(
        vocab_size=3000,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(model_config)


def _wide_vocab_trainer(**config) -> Trainer:
    return Trainer(_wide_vocab_model(), TrainerConfig(**config))


def _largest_saved_tensor(trainer: Trainer, groups) -> int:
    saved: list[int] = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.accumulate_gradients(groups)
    return max(saved)


def test_no_full_vocabulary_logits_are_kept_for_backward(make_groups):
    groups = make_groups(seed=9, vocab=3000)
    trainer = _wide_vocab_trainer(micro_batch_tokens=10**6, logits_chunk_tokens=8)
    assert trainer.split is not None
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for g in groups for s in g.samples)
    assert _largest_saved_tensor(trainer, groups) <= 3000 * 32  # the output layer's weight
    trainer.split = None  # the full-logits path keeps (response tokens x vocabulary) logits
    response_tokens = sum(g.response_tokens for g in groups)
    assert _largest_saved_tensor(trainer, groups) >= response_tokens * 3000
    trainer.packing = "padded"  # and, padded, (rows x width x vocabulary)
    assert _largest_saved_tensor(trainer, groups) >= tokens * 3000


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_path_equals_full_logits_path(tmp_path, make_groups, temperature):
    _wide_vocab_model(seed=1).save_pretrained(tmp_path / "reference")
    loss = LossConfig(kl_coef=0.1, entropy_coef=0.01)
    config = TrainerConfig(
        micro_batch_tokens=64,
        logits_chunk_tokens=5,
        temperature=temperature,
        loss=loss,
        reference_path=str(tmp_path / "reference"),
    )
    groups = make_groups(seed=10, vocab=3000)
    chunked = Trainer(_wide_vocab_model(), config, reference_path=config.reference_path)
    full = Trainer(_wide_vocab_model(), config, reference_path=config.reference_path)
    assert chunked.split is not None and chunked.reference_split is not None
    full.split = full.reference_split = None
    m_chunked, m_full = chunked.accumulate_gradients(groups), full.accumulate_gradients(groups)
    for key in ("loss", "pg_loss", "entropy", "kl_ref", "kl_behavior", "ratio_mean"):
        assert m_chunked[key] == pytest.approx(m_full[key], rel=1e-5, abs=1e-7), key
    g_chunked, g_full = _grads(chunked), _grads(full)
    assert g_chunked.keys() == g_full.keys()
    for name in g_full:
        torch.testing.assert_close(g_chunked[name], g_full[name], rtol=1e-4, atol=1e-7)


def test_train_step_reports_peak_memory(tiny_model_dir, make_groups):
    trainer = Trainer.from_pretrained(tiny_model_dir, TrainerConfig())
    metrics = trainer.train_step(make_groups(seed=11))
    assert 0.01 < metrics["peak_memory_gb"] < 64


def test_micro_batch_size_defaults_to_the_model_shape(make_groups):
    auto = _wide_vocab_trainer()
    assert auto.micro_batch_tokens == 16384  # a tiny model: the cap
    assert _wide_vocab_trainer(micro_batch_tokens=64).micro_batch_tokens == 64


@pytest.mark.parametrize("packing", ["shared_prompt", "padded"])
def test_activation_checkpointing_gives_the_same_gradients(tiny_model_dir, make_groups, packing):
    """Packed, the recomputed layers get the block mask and position ids again: a layer
    recomputed without them would give other activations, hence other gradients."""
    groups = make_groups(seed=5)
    config = TrainerConfig(micro_batch_tokens=64, packing=packing)
    plain = Trainer.from_pretrained(tiny_model_dir, config)
    recomputed = Trainer.from_pretrained(
        tiny_model_dir, dataclasses.replace(config, activation_checkpointing=True)
    )
    assert plain.packing == recomputed.packing == packing
    assert any(getattr(m, "gradient_checkpointing", False) for m in recomputed.model.modules())
    assert not any(getattr(m, "gradient_checkpointing", False) for m in plain.model.modules())
    m_plain = plain.accumulate_gradients(groups)
    m_recomputed = recomputed.accumulate_gradients(groups)
    assert m_recomputed["micro_batches"] == m_plain["micro_batches"] > 1
    assert m_recomputed["loss"] == pytest.approx(m_plain["loss"], rel=1e-6)
    g_plain, g_recomputed = _grads(plain), _grads(recomputed)
    assert g_plain.keys() == g_recomputed.keys() and g_plain
    for name in g_plain:
        assert torch.allclose(g_plain[name], g_recomputed[name], rtol=1e-5, atol=1e-8), name


def test_distillation_reads_a_frozen_teacher_in_every_micro_batch(tmp_path, make_groups):
    """trainer.teacher: the step's distill_kl is the mean over sampled tokens of
    log pi_behavior - log teacher, the teacher computed here row by row; micro-batches change
    nothing; the teacher does not train."""
    _wide_vocab_model(seed=1).save_pretrained(tmp_path / "teacher")
    loss = LossConfig(distill_coef=0.5, rl_coef=0.0)
    config = TrainerConfig(micro_batch_tokens=10**6, loss=loss, teacher=str(tmp_path / "teacher"))
    groups = make_groups(seed=12, vocab=3000)
    full = Trainer(_wide_vocab_model(), config)
    small = Trainer(_wide_vocab_model(), dataclasses.replace(config, micro_batch_tokens=24))
    m_full, m_small = full.accumulate_gradients(groups), small.accumulate_gradients(groups)
    teacher = _wide_vocab_model(seed=1).eval()
    gaps = []
    for s in (s for g in groups for s in g.samples):
        with torch.no_grad():
            logits = teacher(torch.tensor([s.prompt_ids + s.response_ids])).logits[0]
        p = len(s.prompt_ids)
        q = torch.log_softmax(logits[p - 1 : -1], -1)[range(len(s.response_ids)), s.response_ids]
        gaps += [b - float(t) for b, t in zip(s.logprobs, q, strict=True)]
    assert m_full["distill_kl"] == pytest.approx(sum(gaps) / len(gaps), rel=1e-5)
    assert m_small["loss"] == pytest.approx(m_full["loss"], rel=1e-5, abs=1e-7)
    assert m_small["micro_batches"] > 1 and _grads(full)
    assert not any(p.requires_grad for p in full.teacher.parameters())
    with pytest.raises(ConfigError, match="^teacher: "):
        TrainerConfig(loss=loss).validate()
