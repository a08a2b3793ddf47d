"""The warning for a step whose responses were cut by a length limit: its share, the limit
that cut them (the context, `engine.max_model_len`, or the response cap,
`sampling.max_new_tokens`) and the key to raise.

A response cut by the length limit ends without its answer, so a step made mostly of such
responses trains on rewards the limit decided. The warning is given the first step the
share passes `sampling.warn_truncated`, then again each step it is worse by
`WORSE_BY` than the worst share warned of, so a run is told once and again only when it
degrades. A turn that sampled the full cap was cut by the cap; one cut shorter, by the
context (its prompt and earlier turns filled `engine.max_model_len`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from dorarl.data import Group, Sample

log = logging.getLogger(__name__)

WORSE_BY = 0.1  # share of responses by which a later step must be worse to be warned again
CONTEXT_KEY = "engine.max_model_len"
CAP_KEY = "sampling.max_new_tokens"


@dataclass(frozen=True)
class Cuts:
    """A step's responses, those the context cut and those the response cap cut."""

    responses: int = 0
    by_context: int = 0
    by_cap: int = 0

    @property
    def share(self) -> float:
        return (self.by_context + self.by_cap) / self.responses if self.responses else 0.0

    @property
    def key(self) -> str:
        """The key that sets the limit that cut most of them."""
        return CONTEXT_KEY if self.by_context >= self.by_cap else CAP_KEY


def cut_by(sample: Sample, max_new_tokens: int) -> str | None:
    """The key of the limit that cut `sample` (None: it ended on its own): a turn cut having
    sampled the cap hit the cap; one cut short of it, the context."""
    if not sample.truncated:
        return None
    if sample.turns:
        cut = [t.sampled for t in sample.turns if t.finish_reason == "length"]
    else:
        cut = [len(sample.response_ids)]
    return CAP_KEY if any(n >= max_new_tokens for n in cut) else CONTEXT_KEY


def count_cuts(groups: list[Group], max_new_tokens: int) -> Cuts:
    keys = [cut_by(s, max_new_tokens) for g in groups for s in g.samples]
    return Cuts(len(keys), keys.count(CONTEXT_KEY), keys.count(CAP_KEY))


@dataclass
class TruncationWatch:
    """Decides, step by step, when the share of cut responses calls for a warning."""

    max_model_len: int
    max_new_tokens: int
    threshold: float = 0.2  # sampling.warn_truncated; above 1: never
    worst_warned: float | None = None

    def observe(self, step: int, groups: list[Group]) -> tuple[str | None, str]:
        """The warning for step `step` (None: none due; logged when given) and the short
        flag for its progress line ("" when under the threshold)."""
        cuts = count_cuts(groups, self.max_new_tokens)
        if cuts.responses == 0 or cuts.share <= self.threshold:
            return None, ""
        flag = f"cut {cuts.share:.0%} (raise {cuts.key})"
        # a share is a ratio of small counts: 0.4 - 0.3 must count as worse by 0.1
        if self.worst_warned is not None and cuts.share - self.worst_warned < WORSE_BY - 1e-9:
            return None, flag
        self.worst_warned = cuts.share
        warning = self.message(step, cuts)
        log.warning("%s", warning)
        return warning, flag

    def message(self, step: int, cuts: Cuts) -> str:
        context = (
            cuts.by_context,
            f"{cuts.by_context} by the context limit of {self.max_model_len} tokens "
            f"(prompt and reply; raise {CONTEXT_KEY})",
        )
        cap = (
            cuts.by_cap,
            f"{cuts.by_cap} by the response cap of {self.max_new_tokens} tokens (raise {CAP_KEY})",
        )
        # the limit that cut most of them first: the key to raise first
        parts = [text for n, text in sorted((context, cap), key=lambda c: -c[0]) if n]
        return (
            f"step {step}: {cuts.share:.0%} of the responses were cut before their end, "
            f"{' and '.join(parts)}; their rewards are those of unfinished answers "
            f"(sampling.warn_truncated={self.threshold:g} sets when this warns)"
        )
