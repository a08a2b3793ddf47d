"""Shared-prompt packing: layout, every token once in its own context, and the same loss,
gradient and metrics as padded rows on real model families."""

from __future__ import annotations

import logging
import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dorarl.data import Group, Sample
from dorarl.trainer import LossConfig, Trainer, TrainerConfig
from dorarl.trainer.batch import TrainSequence, build_sequences
from dorarl.trainer.packing import (
    MAX_ROW_TOKENS,
    attention_width,
    collate_packed,
    micro_batches,
    plan_packed,
    plan_rows,
    row_length,
    shared_prompt_segments,
)


def _seq(prompt, response, advantage=0.0):
    return TrainSequence(prompt, response, [-float(t) for t in response], advantage)


def test_a_row_holds_each_prompt_once_then_its_responses():
    seqs = [_seq([1, 5, 6], [7, 8], 1.0), _seq([1, 5, 6], [9], -1.0), _seq([2, 3], [4])]
    (rows,) = plan_packed(seqs, token_budget=100)
    batch = collate_packed(rows, pad_id=0, device="cpu")
    assert batch.input_ids.tolist() == [[1, 5, 6, 7, 8, 9, 2, 3, 4]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 0, 1, 2]]
    # 7 and 9 are predicted by the prompt's last token (column 2), 8 by 7, 4 by 3.
    assert batch.sources.tolist() == [2, 3, 2, 7]
    assert batch.targets.tolist() == [7, 8, 9, 4]
    assert batch.advantages.tolist() == [1.0, 1.0, -1.0, 0.0]
    visible = batch.attention_mask[0, 0]
    assert visible[5].nonzero().flatten().tolist() == [0, 1, 2, 5]  # 9: its prompt and itself
    assert visible[8].nonzero().flatten().tolist() == [6, 7, 8]  # the second group's own


def test_a_group_longer_than_a_row_is_split_with_its_prompt_repeated():
    seqs = [_seq([1, 2, 3], [4] * n) for n in (5, 6, 7)]
    segments = shared_prompt_segments(seqs, row_tokens=12)
    assert [[len(s.response_ids) for s in seg.responses] for seg in segments] == [[5], [6], [7]]
    assert all(seg.prompt_ids == [1, 2, 3] for seg in segments)
    segments = shared_prompt_segments(seqs, row_tokens=14)
    assert [seg.length for seg in segments] == [14, 10]


def test_padding_sees_only_padding():
    rows = plan_rows([_seq([1, 2], [3, 4, 5]), _seq([6], [7])], token_budget=10, row_tokens=5)
    batch = collate_packed(rows[0], pad_id=0, device="cpu")
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5], [6, 7, 0, 0, 0]]
    visible = batch.attention_mask[1, 0]
    assert visible[2:].nonzero().tolist() == [[0, 2], [1, 2], [1, 3], [2, 2], [2, 3], [2, 4]]
    assert not visible[:2, 2:].any()


# ---- property: every response token once, with its own context and its own numbers ------------
@st.composite
def groups_of_sequences(draw):
    """Sequences of a few groups with unique response tokens, so each can be traced."""
    seqs, token = [], 1000
    for g in range(draw(st.integers(1, 5))):
        prompt = [g * 10 + i for i in range(draw(st.integers(1, 8)))]
        for _ in range(draw(st.integers(1, 6))):
            n = draw(st.integers(0, 12))
            seqs.append(_seq(prompt, list(range(token, token + n)), advantage=float(token)))
            seqs[-1].weight = 1.0 / (token + 1)
            token += n
    return seqs


@settings(max_examples=200, deadline=None)
@given(groups_of_sequences(), st.integers(1, 120), st.integers(1, 60))
def test_every_response_token_once_in_its_own_context(seqs, budget, row_tokens):
    _assert_every_token_once(seqs, budget, plan_rows(_nonempty(seqs), budget, row_tokens))


@settings(max_examples=100, deadline=None)
@given(groups_of_sequences(), st.integers(1, 120), st.sampled_from([1.0, 30.0, math.inf]))
def test_the_chosen_row_width_keeps_every_token_once(seqs, budget, attention_width):
    plan = plan_packed(_nonempty(seqs), budget, attention_width)
    _assert_every_token_once(seqs, budget, plan)
    if attention_width == math.inf and budget >= sum(s.length for s in seqs):
        assert len(plan) <= 1  # padding is all that costs: one row holds everything


def _nonempty(seqs: list[TrainSequence]) -> list[TrainSequence]:
    return [s for s in seqs if s.response_ids]


def _assert_every_token_once(seqs: list[TrainSequence], budget: int, plan) -> None:
    by_token = {t: (s, i) for s in seqs for i, t in enumerate(s.response_ids)}
    seen: list[int] = []
    for rows in plan:
        batch = collate_packed(rows, pad_id=0, device="cpu")
        width = batch.input_ids.shape[1]
        assert batch.rows == 1 or batch.rows * width <= budget
        assert width == max(row_length(row) for row in rows)
        assert batch.attention_mask.any(-1).all()  # no query sees nothing (NaN in softmax)
        for k, token in enumerate(batch.targets.tolist()):
            seq, i = by_token[token]
            assert batch.behavior_logp[k] == seq.behavior_logprobs[i]
            assert batch.advantages[k] == seq.advantage
            assert batch.weights[k] == pytest.approx(seq.weight, rel=1e-6)
            _assert_sees_its_own_context(batch, int(batch.sources[k]), seq, i)
            seen.append(token)
    assert sorted(seen) == sorted(by_token)


def _assert_sees_its_own_context(batch, source: int, seq: TrainSequence, i: int) -> None:
    """The position predicting token i sees exactly prompt + response[:i], at 0, 1, ..."""
    width = batch.input_ids.shape[1]
    row, col = divmod(source, width)
    keys = batch.attention_mask[row, 0, col].nonzero().flatten()
    context = seq.prompt_ids + seq.response_ids[:i]
    assert batch.input_ids[row, keys].tolist() == context
    assert batch.position_ids[row, keys].tolist() == list(range(len(context)))
    assert keys[-1] == col


# ---- the packed and padded trainers agree ----------------------------------------------------
def _tiny_model(family: str, seed: int = 0, **extra):
    import transformers

    kw = dict(
        vocab_size=101,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        **extra,
    )
    config_cls, model_cls = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    }[family]
    if not hasattr(transformers, model_cls):
        pytest.skip(f"transformers {transformers.__version__} has no {model_cls}")
    torch.manual_seed(seed)
    return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kw))


def _trainer(family: str, tmp_path, config: TrainerConfig, **extra) -> Trainer:
    config.skip_zero_advantage = False  # packing is checked on every sequence of a batch
    if config.loss.kl_coef > 0:
        _tiny_model(family, seed=1, **extra).save_pretrained(tmp_path / "reference")
        config.reference_path = str(tmp_path / "reference")
    return Trainer(_tiny_model(family, **extra), config, reference_path=config.reference_path)


def _groups(seed: int, n_groups: int, sizes: tuple[int, int], lengths: tuple[int, int]):
    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        prompt = [1] + [rng.randrange(4, 101) for _ in range(rng.randint(2, 12))]
        samples = []
        for i in range(rng.randint(*sizes)):
            n = rng.randint(*lengths)
            samples.append(
                Sample(
                    group_id=g,
                    sample_index=i,
                    prompt_id=g,
                    prompt_ids=prompt,
                    response_ids=[rng.randrange(4, 101) for _ in range(n)],
                    logprobs=[-rng.uniform(3.0, 6.0) for _ in range(n)],
                    versions=[0] * n,
                    finish_reason=rng.choice(["stop", "length"]),
                    reward=float(rng.random() < 0.5),
                )
            )
        groups.append(Group(group_id=g, prompt_id=g, version=0, samples=samples))
    return groups


def _step(trainer: Trainer, groups, packing: str) -> tuple[dict, dict[str, torch.Tensor]]:
    trainer.packing = packing
    metrics = trainer.accumulate_gradients(groups)
    params = [p for p in trainer.model.parameters() if p.grad is not None]
    metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, float("inf")))
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.model.zero_grad(set_to_none=True)
    return metrics, grads


def _assert_same_step(trainer: Trainer, groups, rel: float = 1e-5) -> dict:
    padded, g_padded = _step(trainer, groups, "padded")
    packed, g_packed = _step(trainer, groups, "shared_prompt")
    assert packed.keys() == padded.keys() and padded["tokens"] > 0
    # abs: the loss is a signed sum of terms of order 1 (weights sum to 1) and can cancel.
    for key, value in padded.items():
        if key != "micro_batches":
            assert packed[key] == pytest.approx(value, rel=rel, abs=1e-6), key
    assert g_packed.keys() == g_padded.keys() and g_padded
    for name, grad in g_padded.items():
        err = float((g_packed[name] - grad).norm() / grad.norm().clamp_min(1e-12))
        assert err < 10 * rel, name
    return {"padded": padded, "packed": packed}


CASES = {
    "token_mean+kl+entropy": (
        LossConfig(kl_coef=0.05, entropy_coef=0.01),
        {"micro_batch_tokens": 10**6},
    ),
    "seq_mean+mask_truncated, many micro-batches": (
        LossConfig(aggregation="seq_mean", overlong="mask"),
        {"micro_batch_tokens": 24},
    ),
    "proximal+dual_clip, temperature": (
        LossConfig(ratio_base="proximal", tis_cap=2.0, dual_clip=3.0, kl_coef=0.1),
        {"micro_batch_tokens": 64, "temperature": 0.7, "logits_chunk_tokens": 5},
    ),
}


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("head", ["chunked", "full_logits"])
def test_packed_step_equals_padded_step(tmp_path, single_thread, family, case, head):
    loss, settings_ = CASES[case]
    extra = {"head_dim": 8} if family == "qwen3" else {}
    trainer = _trainer(family, tmp_path, TrainerConfig(loss=loss, **settings_), **extra)
    assert trainer.packing == "shared_prompt" and trainer.split is not None
    if head == "full_logits":
        trainer.split = trainer.reference_split = None
    groups = _groups(seed=len(case), n_groups=4, sizes=(1, 8), lengths=(0, 14))
    result = _assert_same_step(trainer, groups)
    if "kl" in case:
        assert result["packed"]["kl_ref"] > 0
    if "many" in case:  # groups longer than the budget are split, the prompt repeated
        assert result["packed"]["micro_batches"] >= 4
        longest = max(len(g.samples[0].prompt_ids) + g.response_tokens for g in groups)
        assert longest > trainer.micro_batch_tokens


def _shared_trainer(tiny_model_dir, **config) -> Trainer:
    config.setdefault("skip_zero_advantage", False)
    return Trainer.from_pretrained(tiny_model_dir, TrainerConfig(**config))


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 10**6),
    n_groups=st.integers(1, 5),
    max_size=st.integers(1, 10),
    max_len=st.integers(0, 30),
    budget=st.sampled_from([16, 40, 100, 10**6]),
    aggregation=st.sampled_from(["token_mean", "seq_mean"]),
)
def test_packed_equals_padded_on_random_group_shapes(
    tiny_model_dir, single_thread, seed, n_groups, max_size, max_len, budget, aggregation
):
    loss = LossConfig(aggregation=aggregation, overlong="mask" if seed % 2 == 0 else "none")
    trainer = _shared_trainer(tiny_model_dir, micro_batch_tokens=budget, loss=loss)
    groups = _groups(seed, n_groups, (1, max_size), (0, max_len))
    seqs = build_sequences(groups, loss)
    if not any(s.response_ids for s in seqs):
        assert micro_batches(seqs, budget, "shared_prompt", 0, "cpu") == []
        return
    _assert_same_step(trainer, groups)


def _mpt():
    from transformers import MptConfig, MptForCausalLM

    torch.manual_seed(0)
    return MptForCausalLM(MptConfig(vocab_size=101, d_model=32, n_layers=2, n_heads=4))


def test_a_model_without_position_ids_falls_back_to_padded(caplog, make_groups):
    # MPT places tokens by ALiBi over the row, not by position ids: packed rows would differ.
    with caplog.at_level(logging.WARNING, logger="dorarl.trainer.forward"):
        trainer = Trainer(_mpt(), TrainerConfig())
    assert trainer.packing == "padded"
    assert [r.getMessage() for r in caplog.records] == [
        "trainer.packing=padded: MptForCausalLM gives other log-probs with a 4D mask and "
        "position ids"
    ]
    assert trainer.accumulate_gradients(make_groups(seed=1))["tokens"] > 0


def test_the_check_passes_the_families_we_pack():
    assert Trainer(_tiny_model("llama"), TrainerConfig()).packing == "shared_prompt"
    assert Trainer(_tiny_model("llama"), TrainerConfig(packing="padded")).packing == "padded"
    eager = _tiny_model("llama", attn_implementation="eager")  # adds the float mask as it is
    assert Trainer(eager, TrainerConfig()).packing == "shared_prompt"


def test_sliding_window_attention_is_not_packed():
    model = _tiny_model("qwen2", use_sliding_window=True, sliding_window=8)
    assert Trainer(model, TrainerConfig()).packing == "padded"


def test_row_width_trades_padding_against_attention():
    from transformers import LlamaConfig

    from dorarl.bench.shapes import SHAPES

    smollm2 = attention_width(LlamaConfig(**SHAPES["smollm2-135m"]))
    assert smollm2 == pytest.approx(3072)
    # Arith-shaped: four groups of 8 answers to a 45-token prompt, 222-274 tokens each.
    seqs = [
        _seq(list(range(g * 100, g * 100 + 45)), [7] * n)
        for g, total in enumerate((177, 229, 201, 222))
        for n in [total // 8] * 7 + [total - 7 * (total // 8)]
    ]
    (rows,) = plan_packed(seqs, 1280, smollm2)
    assert [len(row) for row in rows] == [1, 1, 1, 1]  # a group per row: attention is dear
    (rows,) = plan_packed(seqs, 1280, math.inf)
    assert [len(row) for row in rows] == [4]  # free attention: one row, no padding


def test_rows_stay_within_the_widest_mask():
    seqs = [_seq([1] * 40, [2] * 1000) for _ in range(9)]  # one group of 9,040 tokens
    plan = plan_packed(seqs, 16384, math.inf)
    assert max(row_length(row) for rows in plan for row in rows) <= MAX_ROW_TOKENS
    segments = [segment for rows in plan for row in rows for segment in row]
    assert sum(len(s.responses) for s in segments) == 9 and len(segments) == 3
