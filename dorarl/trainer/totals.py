"""Running sums over the micro-batches of one step, turned into per-token metrics at the end.

Means are over response tokens of the whole batch (not means of micro-batch means); the
engine/trainer log-prob figures keep every token's (`Mismatch`), for exact percentiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dorarl.trainer.batch import MicroBatch
from dorarl.trainer.loss import PolicyTerms, k3_kl
from dorarl.trainer.mismatch import Mismatch
from dorarl.trainer.packing import PackedBatch


@dataclass
class StepTotals:
    tokens: int = 0
    loss: float = 0.0
    pg_loss: float = 0.0
    ratio: float = 0.0
    ratio_max: float = 0.0
    clipped_low: int = 0
    clipped_high: int = 0
    entropy: float = 0.0
    kl_behavior: float = 0.0
    kl_ref: float | None = None
    importance: float | None = None
    truncated: int = 0
    is_masked: int | None = None
    seq_ratio: float | None = None  # sum over sequences of the GSPO sequence ratio
    sequences: int = 0
    seq_ratio_min: float = math.inf
    seq_ratio_max: float = 0.0
    distill_kl: float | None = None  # sum of log pi_behavior - log teacher over trained tokens
    mismatch: Mismatch = field(default_factory=Mismatch)

    def add(
        self,
        batch: MicroBatch | PackedBatch,
        loss: torch.Tensor,
        terms: PolicyTerms,
        logp: torch.Tensor,
        entropy: torch.Tensor,
        kl_ref: torch.Tensor | None,
    ) -> None:
        m = batch.mask
        self.tokens += int(m.sum())
        self.loss += float(loss)
        self.pg_loss += float((terms.loss.detach() * batch.weights).sum())
        self.ratio += float(terms.ratio[m].sum())
        if m.any():
            self.ratio_max = max(self.ratio_max, float(terms.ratio[m].max()))
        self.clipped_low += int(terms.clipped_low[m].sum())
        self.clipped_high += int(terms.clipped_high[m].sum())
        self.entropy += float(entropy[m].sum())
        # k3 estimate of KL(behavior || current) on the behavior policy's own samples.
        self.kl_behavior += float(k3_kl(batch.behavior_logp, logp)[m].sum())
        if kl_ref is not None:
            self.kl_ref = (self.kl_ref or 0.0) + float(kl_ref[m].sum())
        if terms.importance is not None:
            self.importance = (self.importance or 0.0) + float(terms.importance[m].sum())
            self.truncated += int(terms.truncated[m].sum())
        if terms.is_masked is not None:
            self.is_masked = (self.is_masked or 0) + int(terms.is_masked[m].sum())
        if terms.seq_ratio is not None:
            self._add_sequence_ratios(terms.seq_ratio)

    def add_mismatch(
        self, batch: MicroBatch | PackedBatch, logp: torch.Tensor, version: int
    ) -> None:
        """The trainer's log-probs (before the update, the loss's) against the engines' on
        the trained tokens; fresh: sampled by `version`, the one being trained."""
        m = batch.mask
        fresh = batch.versions == version if batch.versions is not None else torch.zeros_like(m)
        self.mismatch.add((logp - batch.behavior_logp)[m], fresh[m])

    def add_distill(self, batch: MicroBatch | PackedBatch, teacher_logp: torch.Tensor) -> None:
        """The k1 estimate of the reverse KL to the teacher on the sampled tokens."""
        gap = (batch.behavior_logp - teacher_logp)[batch.mask]
        self.distill_kl = (self.distill_kl or 0.0) + float(gap.sum())

    def _add_sequence_ratios(self, ratios: torch.Tensor) -> None:
        self.seq_ratio = (self.seq_ratio or 0.0) + float(ratios.sum())
        self.sequences += ratios.numel()
        if ratios.numel():
            self.seq_ratio_min = min(self.seq_ratio_min, float(ratios.min()))
            self.seq_ratio_max = max(self.seq_ratio_max, float(ratios.max()))

    def summary(self) -> dict[str, float]:
        n = max(self.tokens, 1)
        out = {
            "loss": self.loss,
            "pg_loss": self.pg_loss,
            "tokens": float(self.tokens),
            "ratio_mean": self.ratio / n,
            "ratio_max": self.ratio_max,
            "clip_frac_low": self.clipped_low / n,
            "clip_frac_high": self.clipped_high / n,
            "entropy": self.entropy / n,
            "kl_behavior": self.kl_behavior / n,
        }
        if self.kl_ref is not None:
            out["kl_ref"] = self.kl_ref / n
        if self.importance is not None:
            out["importance_mean"] = self.importance / n
            out["importance_truncated_frac"] = self.truncated / n
        if self.is_masked is not None:
            out["is_masked_frac"] = self.is_masked / n
        if self.distill_kl is not None:
            out["distill_kl"] = self.distill_kl / n
        if self.seq_ratio is not None:
            out["seq_ratio_mean"] = self.seq_ratio / max(self.sequences, 1)
            out["seq_ratio_min"] = self.seq_ratio_min if self.sequences else 0.0
            out["seq_ratio_max"] = self.seq_ratio_max
        return out | self.mismatch.summary()
