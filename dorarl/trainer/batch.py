"""From groups to padded micro-batches: advantages, per-token weights and token-budget packing.

Invariants: each response token appears in exactly one micro-batch, with its own behavior
logprob, its group's advantage and a weight normalised over the WHOLE batch, so the sum
of micro-batch losses is the full-batch loss. Overlong handling (`LossConfig.overlong`)
acts here, per turn as the engines' cap counts: `soft` shapes the rewards before the group
advantages, `mask` empties the truncated responses after them (they still count in their
group's statistics). A multi-turn sample's observation tokens (`Sample.observed`) stay in
the sequence, as context, but out of the loss: no weight, no metric, not counted in the
token mean. An episode of several segments (`Sample.segments`) becomes one sequence per
segment, each with its own prompt as context, all with the episode's advantage and the
weights the episode would have as one sequence. Samples must carry one behavior logprob
per response token (mixed-version samples included); anything else is a bug upstream.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dorarl.data import Group, Sample, SegmentStart
from dorarl.trainer.advantages import overlong_penalty, step_advantages
from dorarl.trainer.config import LossConfig
from dorarl.trainer.loss import token_weights


@dataclass
class TrainSequence:
    prompt_ids: list[int]
    response_ids: list[int]
    behavior_logprobs: list[float]
    advantage: float
    weight: float = 0.0
    trained: list[bool] | None = None  # per response token; None: all (no observations)
    routes: bytes = b""  # the engine's recorded experts per response token (MoE), if any
    version: int | None = None  # the one version that sampled every token (None: several)
    versions: list[int] = field(default_factory=list)  # per response token; empty: unknown

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def loss_mask(self) -> list[bool]:
        """Which response tokens the loss sees: all but an environment's observations."""
        return [True] * len(self.response_ids) if self.trained is None else self.trained

    @property
    def trained_tokens(self) -> int:
        return sum(self.loss_mask)

    def token_weights(self) -> list[float]:
        return [self.weight if m else 0.0 for m in self.loss_mask]


@dataclass
class MicroBatch:
    """Tensors of shape (rows, width - 1), aligned with the logits that predict each token."""

    input_ids: torch.Tensor
    targets: torch.Tensor
    behavior_logp: torch.Tensor
    advantages: torch.Tensor
    weights: torch.Tensor
    mask: torch.Tensor
    sequences: list[TrainSequence] = field(default_factory=list)  # one per row
    seq_index: torch.Tensor | None = None  # the row's sequence on response tokens, -1 off them
    versions: torch.Tensor | None = None  # the version that sampled each token, -1 off them


def build_sequences(groups: list[Group], cfg: LossConfig) -> list[TrainSequence]:
    """One TrainSequence per sample (per segment of an episode of several), with its group
    advantage and its global token weight."""
    per_sample: list[list[TrainSequence]] = []
    rewards = [[_shaped_reward(s, cfg) for s in group.samples] for group in groups]
    advantages = step_advantages(rewards, cfg.advantage, cfg.normalize_std, cfg.adv_eps)
    for group, advs in zip(groups, advantages, strict=True):
        for sample, adv in zip(group.samples, advs, strict=True):
            _check(group, sample)
            # An episode with any turn cut by the cap is a truncated trajectory, whichever turn.
            masked = cfg.overlong == "mask" and sample.truncated
            if sample.segments and not masked:
                per_sample.append(_segment_sequences(sample, adv, _token_versions(group, sample)))
                continue
            ids = [] if masked else sample.response_ids
            trained = [not o for o in sample.observed[: len(ids)]] if sample.observed else None
            per_sample.append(
                [
                    TrainSequence(
                        list(sample.prompt_ids),
                        list(ids),
                        list(sample.logprobs[: len(ids)]),
                        adv,
                        trained=trained,
                        routes=sample.routes if ids else b"",
                        version=_one_version(sample),
                        versions=_token_versions(group, sample)[: len(ids)],
                    )
                ]
            )
    _assign_weights(per_sample, cfg)
    return [seq for seqs in per_sample for seq in seqs]


def _check(group: Group, sample: Sample) -> None:
    where = f"group {group.group_id} sample {sample.sample_index}"
    if not sample.prompt_ids:
        raise ValueError(f"group {group.group_id}: a sample has an empty prompt")
    if len(sample.logprobs) != len(sample.response_ids):
        raise ValueError(
            f"{where}: {len(sample.logprobs)} logprobs for {len(sample.response_ids)} tokens"
        )
    end = 0
    for start in sample.segments:
        if start.prompt < 1 or start.at < end or start.at + start.prompt > len(sample.response_ids):
            raise ValueError(f"{where}: segment {start} does not fit its response")
        if not all(sample.observed[start.at : start.at + start.prompt]):
            raise ValueError(f"{where}: segment {start}'s prompt is not observed tokens")
        end = start.at + start.prompt


def _segment_sequences(
    sample: Sample, advantage: float, versions: list[int]
) -> list[TrainSequence]:
    """An episode's segments as sequences: the first under the sample's prompt, each later
    one under its own prompt (cut from the response), so no segment sees another."""
    version = _one_version(sample)
    per_token = len(sample.routes) // len(sample.response_ids) if sample.routes else 0
    bounds = [
        (sample.prompt_ids, 0, sample.segments[0].at),
        *(
            (sample.response_ids[s.at : s.at + s.prompt], s.at + s.prompt, end)
            for s, end in zip(sample.segments, _ends(sample), strict=True)
        ),
    ]
    return [
        TrainSequence(
            list(prompt),
            sample.response_ids[begin:end],
            sample.logprobs[begin:end],
            advantage,
            trained=[not o for o in sample.observed[begin:end]],
            routes=sample.routes[begin * per_token : end * per_token],
            version=version,
            versions=versions[begin:end],
        )
        for prompt, begin, end in bounds
    ]


def _ends(sample: Sample) -> list[int]:
    """Where each later segment's tokens end: at the next segment's start, or the response's."""
    starts: list[SegmentStart] = sample.segments
    return [s.at for s in starts[1:]] + [len(sample.response_ids)]


def _one_version(sample: Sample) -> int | None:
    return sample.versions[0] if sample.versions and sample.single_version else None


def _token_versions(group: Group, sample: Sample) -> list[int]:
    """The version that sampled each response token; a sample without one per token counts
    as its behavior version's (its group's when it has none)."""
    n = len(sample.response_ids)
    if len(sample.versions) == n:
        return list(sample.versions)
    return [sample.behavior_version if sample.versions else group.version] * n


def _shaped_reward(sample: Sample, cfg: LossConfig) -> float:
    if cfg.overlong != "soft":
        return sample.reward
    if cfg.response_cap is None:
        raise ValueError("overlong=soft needs the response cap (LossConfig.response_cap)")
    # The cap bounds each turn, so each turn is judged against it; an episode pays its worst
    # turn's penalty: in [-1, 0] like one turn's whatever the number of turns, one truncated
    # turn costs the full -1 (a mean over turns would dilute it), and short turns add nothing.
    return sample.reward + min(
        overlong_penalty(length, cfg.response_cap, cfg.overlong_buffer)
        for length in sample.turn_lengths
    )


def _assign_weights(per_sample: list[list[TrainSequence]], cfg: LossConfig) -> None:
    """Weights per sample (seq_mean averages over samples, an episode's segments together),
    given to each of its sequences."""
    lengths = [sum(s.trained_tokens for s in seqs) for seqs in per_sample]
    total_tokens = sum(lengths)
    total_sequences = sum(1 for n in lengths if n)
    if total_tokens == 0:
        return
    norm = cfg.sum_norm_length() if cfg.aggregation == "seq_sum_norm" else None
    weights = token_weights(lengths, cfg.aggregation, total_tokens, total_sequences, norm)
    for seqs, w in zip(per_sample, weights, strict=True):
        for seq in seqs:
            seq.weight = w


def plan_micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Indices grouped so that rows * longest row <= token_budget (a longer row goes alone).

    Rows are taken longest first, which keeps padding low and the plan deterministic.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        width = lengths[current[0]] if current else lengths[i]
        if current and (len(current) + 1) * width > token_budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def collate(
    seqs: list[TrainSequence],
    pad_id: int,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
) -> MicroBatch:
    """Right-padded rows. Pads only follow real tokens, so causal attention needs no mask.
    `dtype`: of the per-token values (float64 for an exact check of the loss)."""
    width = max(s.length for s in seqs)
    rows = len(seqs)
    ids = torch.full((rows, width), pad_id, dtype=torch.long)
    behavior, advantages, weights = (torch.zeros((rows, width - 1), dtype=dtype) for _ in "baw")
    mask = torch.zeros((rows, width - 1), dtype=torch.bool)
    seq_index = torch.full((rows, width - 1), -1, dtype=torch.long)
    versions = torch.full((rows, width - 1), -1, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : s.length] = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
        # Response token j sits at position P + j and is predicted by logits at P + j - 1.
        span = slice(len(s.prompt_ids) - 1, s.length - 1)
        behavior[r, span] = torch.tensor(s.behavior_logprobs, dtype=dtype)
        advantages[r, span] = s.advantage
        weights[r, span] = torch.tensor(s.token_weights(), dtype=dtype)
        mask[r, span] = torch.tensor(s.loss_mask, dtype=torch.bool)
        seq_index[r, span] = r
        versions[r, span] = torch.tensor(token_versions(s), dtype=torch.long)
    return MicroBatch(
        ids.to(device),
        ids[:, 1:].to(device),
        behavior.to(device),
        advantages.to(device),
        weights.to(device),
        mask.to(device),
        list(seqs),
        seq_index.to(device),
        versions.to(device),
    )


def token_versions(seq: TrainSequence) -> list[int]:
    """`seq.versions`, or -1 for each token when they are unknown (never the trained one)."""
    return seq.versions or [-1] * len(seq.response_ids)
