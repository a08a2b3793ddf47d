"""Shared-prompt packing: each prompt once, followed by its group's responses, in rows that a
block-causal mask keeps apart; and the micro-batch plan for either trainer.packing mode.

A row holds segments back to back; a segment is one prompt and some of its responses. A
response token attends to its segment's prompt and to its own earlier tokens only, at the
position ids it has alone (they restart at the prompt's length for every response), so its
log-prob is the one a separate [prompt + response] row gives, up to float rounding. The first
token of a response is predicted by the prompt's last position, each later one by the token
before it. A group longer than a row is split into segments, each with the prompt again.

Row widths are chosen per step: wider rows leave less padding but attend over more pairs
(`plan_packed` prices both from the model's shape).

Invariants: every response token of the batch appears exactly once over the micro-batches,
with its own weight, advantage and behavior logprob; rows x width <= token budget (a row
longer than the budget goes alone), the same rule as the padded plan's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import PretrainedConfig

from dorarl.trainer.batch import (
    MicroBatch,
    TrainSequence,
    collate,
    plan_micro_batches,
    token_versions,
)

Packing = Literal["shared_prompt", "padded"]


# The mask of a row of width W is W^2 booleans, and the model gets it as W^2 floats (one
# tensor for all layers, kept for backward): 84 MB at 4096 in float32. Wider rows would save
# little padding, so groups longer than this are split (their prompt repeated).
MAX_ROW_TOKENS = 4096


@dataclass
class Segment:
    """One prompt followed by some of its responses (all of them unless the group was split)."""

    prompt_ids: list[int]
    responses: list[TrainSequence]

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + sum(len(s.response_ids) for s in self.responses)


@dataclass
class PackedBatch:
    """Rows of segments, and one entry per response token (flat, in row order).

    `sources[t]` is the flat index (row * width + column) of the position whose output
    predicts response token t. The token tensors share MicroBatch's names so the loss and the
    step totals take either kind; `mask` is all True here.
    """

    input_ids: torch.Tensor  # (rows, width)
    position_ids: torch.Tensor  # (rows, width)
    attention_mask: torch.Tensor  # (rows, 1, width, width) bool, True: may attend
    sources: torch.Tensor  # (tokens,)
    targets: torch.Tensor
    behavior_logp: torch.Tensor
    advantages: torch.Tensor
    weights: torch.Tensor
    mask: torch.Tensor
    sequences: list[TrainSequence] = field(default_factory=list)  # in token order
    seq_index: torch.Tensor | None = None  # each token's sequence in `sequences`
    versions: torch.Tensor | None = None  # the version that sampled each token

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]


def shared_prompt_segments(seqs: list[TrainSequence], row_tokens: float) -> list[Segment]:
    """Sequences with the same prompt (a group's) as segments of at most `row_tokens` tokens;
    a prompt with one response longer than that still gets a segment of its own."""
    by_prompt: dict[tuple[int, ...], list[TrainSequence]] = {}
    for seq in seqs:
        by_prompt.setdefault(tuple(seq.prompt_ids), []).append(seq)
    segments: list[Segment] = []
    for prompt, group in by_prompt.items():
        segments.extend(_split_group(list(prompt), group, row_tokens))
    return segments


def _split_group(prompt: list[int], group: list[TrainSequence], row_tokens: float) -> list[Segment]:
    parts: list[Segment] = []
    current: list[TrainSequence] = []
    used = len(prompt)
    for seq in group:
        if current and used + len(seq.response_ids) > row_tokens:
            parts.append(Segment(prompt, current))
            current, used = [], len(prompt)
        current.append(seq)
        used += len(seq.response_ids)
    if current:
        parts.append(Segment(prompt, current))
    return parts


def pack_rows(segments: list[Segment], row_tokens: int) -> list[list[Segment]]:
    """First-fit decreasing into rows of `row_tokens` (deterministic: ties by input order)."""
    order = sorted(range(len(segments)), key=lambda i: (-segments[i].length, i))
    rows: list[list[Segment]] = []
    room: list[int] = []
    for i in order:
        segment = segments[i]
        fit = next((r for r, free in enumerate(room) if segment.length <= free), None)
        if fit is None:
            rows.append([segment])
            room.append(row_tokens - segment.length)
        else:
            rows[fit].append(segment)
            room[fit] -= segment.length
    return rows


def row_length(row: list[Segment]) -> int:
    return sum(segment.length for segment in row)


def plan_rows(
    seqs: list[TrainSequence], token_budget: int, row_tokens: int
) -> list[list[list[Segment]]]:
    """Micro-batches of rows of at most `row_tokens` (or one longer segment): rows x longest
    row <= token_budget."""
    width = min(row_tokens, token_budget)
    rows = pack_rows(shared_prompt_segments(seqs, width), width)
    plan = plan_micro_batches([row_length(row) for row in rows], token_budget)
    return [[rows[i] for i in indices] for indices in plan]


def plan_packed(
    seqs: list[TrainSequence], token_budget: int, attention_width: float = math.inf
) -> list[list[list[Segment]]]:
    """The cheapest of `plan_rows` at row widths from the longest group's up to the budget
    (at most MAX_ROW_TOKENS).

    A masked row's attention costs width^2 however much of it the mask hides, so wider rows
    (less padding) pay for it: a micro-batch of rows x width costs
    rows x width x (1 + width / attention_width) token-equivalents.
    """
    widths = _candidate_widths(seqs, token_budget)
    plans = [plan_rows(seqs, token_budget, width) for width in widths]
    # On a tie, fewer micro-batches: each forward+backward has a fixed cost of its own.
    return min(plans, key=lambda plan: (_plan_cost(plan, attention_width), len(plan)))


def _candidate_widths(seqs: list[TrainSequence], token_budget: int) -> list[int]:
    widest = min(token_budget, MAX_ROW_TOKENS)
    groups = shared_prompt_segments(seqs, math.inf)
    width = min(widest, max((g.length for g in groups), default=1))
    widths = [width]
    while width < widest:
        width = min(widest, 2 * width)
        widths.append(width)
    return widths


def _plan_cost(plan: list[list[list[Segment]]], attention_width: float) -> float:
    cost = 0.0
    for rows in plan:
        width = max(row_length(row) for row in rows)
        cost += len(rows) * width * (1.0 + width / attention_width)
    return cost


def attention_width(config: PretrainedConfig) -> float:
    """The row width at which a layer's attention (fwd + bwd, every query-key pair of the row)
    costs as much as its linear layers, per token: linear weights / (2 x heads x head_dim).
    About 3,000 for SmolLM2-135M; measured on this CPU (masked sdpa), 2,500."""
    hidden = config.hidden_size
    heads = getattr(config, "num_attention_heads", None)
    if not heads:
        return math.inf
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    inter = getattr(config, "intermediate_size", None) or 4 * hidden
    linear = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * inter
    return linear / (2 * heads * head_dim)


@dataclass
class _Columns:
    """Per-position ids of one packed row set, built row by row."""

    ids: torch.Tensor
    positions: torch.Tensor
    segment: torch.Tensor  # segment number within the row; -1 on padding
    response: torch.Tensor  # response number within the segment; -1 on the prompt, -2 on padding


def collate_packed(
    rows: list[list[Segment]],
    pad_id: int,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
) -> PackedBatch:
    """One PackedBatch: rows right-padded to the longest, block-causal mask, token tensors."""
    width = max(row_length(row) for row in rows)
    shape = (len(rows), width)
    cols = _Columns(
        torch.full(shape, pad_id, dtype=torch.long),
        torch.zeros(shape, dtype=torch.long),
        torch.full(shape, -1, dtype=torch.long),
        torch.full(shape, -2, dtype=torch.long),
    )
    sources: list[int] = []
    tokens: list[TrainSequence] = []
    for r, row in enumerate(rows):
        at = r * width
        for k, segment in enumerate(row):
            at = _place_segment(cols, at, k, segment, sources, tokens)
    return _packed_batch(cols, sources, tokens, device, dtype)


def _place_segment(
    cols: _Columns,
    at: int,
    number: int,
    segment: Segment,
    sources: list[int],
    tokens: list[TrainSequence],
) -> int:
    """Write `segment` from flat index `at`; returns the index after it."""
    prompt_len = len(segment.prompt_ids)
    _write(cols, at, segment.prompt_ids, 0, number, -1)
    last_prompt = at + prompt_len - 1
    at += prompt_len
    for j, seq in enumerate(segment.responses):
        n = len(seq.response_ids)
        _write(cols, at, seq.response_ids, prompt_len, number, j)
        sources.extend([last_prompt, *range(at, at + n - 1)])
        tokens.append(seq)
        at += n
    return at


def _write(cols: _Columns, at: int, ids: list[int], first_pos: int, seg: int, resp: int) -> None:
    span = slice(at, at + len(ids))
    cols.ids.view(-1)[span] = torch.tensor(ids, dtype=torch.long)
    cols.positions.view(-1)[span] = torch.arange(first_pos, first_pos + len(ids))
    cols.segment.view(-1)[span] = seg
    cols.response.view(-1)[span] = resp


def block_causal_mask(segment: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
    """(rows, 1, width, width) bool: query q may see key k <= q of its own segment that is
    a prompt token or a token of its own response. Padding (segment -1, response -2) sees
    only earlier padding, so no query row is empty (an empty one is NaN in softmax)."""
    width = segment.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    same_segment = segment[:, :, None] == segment[:, None, :]
    prompt_or_own = (response[:, None, :] == -1) | (response[:, :, None] == response[:, None, :])
    return (causal & same_segment & prompt_or_own).unsqueeze(1)


def _packed_batch(
    cols: _Columns,
    sources: list[int],
    seqs: list[TrainSequence],
    device: torch.device | str,
    dtype: torch.dtype,
) -> PackedBatch:
    def per_token(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device)

    targets = torch.tensor([t for s in seqs for t in s.response_ids], dtype=torch.long)
    return PackedBatch(
        input_ids=cols.ids.to(device),
        position_ids=cols.positions.to(device),
        attention_mask=block_causal_mask(cols.segment, cols.response).to(device),
        sources=torch.tensor(sources, dtype=torch.long).to(device),
        targets=targets.to(device),
        behavior_logp=per_token([b for s in seqs for b in s.behavior_logprobs]),
        advantages=per_token([s.advantage for s in seqs for _ in s.response_ids]),
        weights=per_token([w for s in seqs for w in s.token_weights()]),
        mask=torch.tensor([m for s in seqs for m in s.loss_mask], dtype=torch.bool).to(device),
        sequences=list(seqs),
        seq_index=torch.tensor(
            [k for k, s in enumerate(seqs) for _ in s.response_ids], dtype=torch.long
        ).to(device),
        versions=torch.tensor([v for s in seqs for v in token_versions(s)], dtype=torch.long).to(
            device
        ),
    )


# One micro-batch before collation: a padded one's sequences, or a packed one's rows.
Planned = list[TrainSequence] | list[list[Segment]]


def plan_step(
    seqs: list[TrainSequence],
    token_budget: int,
    packing: Packing,
    model_config: PretrainedConfig | None = None,
) -> list[Planned]:
    """The step's micro-batches in either mode, not yet tensors (sequences with no response
    tokens dropped); `model_config` prices attention against padding for packed widths."""
    seqs = [s for s in seqs if s.response_ids]
    if packing == "padded":
        plan = plan_micro_batches([s.length for s in seqs], token_budget)
        return [[seqs[i] for i in indices] for indices in plan]
    width = attention_width(model_config) if model_config is not None else math.inf
    return plan_packed(seqs, token_budget, width)


def collate_planned(
    planned: Planned,
    packing: Packing,
    pad_id: int,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
) -> MicroBatch | PackedBatch:
    if packing == "padded":
        return collate(planned, pad_id, device, dtype)  # type: ignore[arg-type]
    return collate_packed(planned, pad_id, device, dtype)  # type: ignore[arg-type]


def micro_batches(
    seqs: list[TrainSequence],
    token_budget: int,
    packing: Packing,
    pad_id: int,
    device: torch.device | str,
    model_config: PretrainedConfig | None = None,
    dtype: torch.dtype = torch.float32,
) -> list[MicroBatch | PackedBatch]:
    """`plan_step`'s micro-batches as tensors (per-token values in `dtype`)."""
    plan = plan_step(seqs, token_budget, packing, model_config)
    return [collate_planned(planned, packing, pad_id, device, dtype) for planned in plan]
