"""Samples of simulated requests: placeholder token ids and per-token versions in O(1) memory.

The cost model has no vocabulary, so a sample carries sequences of the right length that
compute nothing: `n` copies of one id, and the versions of its (version, first token)
segments (partial rollout changes version mid-response).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain, repeat

from dorarl.data import Sample
from dorarl.sim.instance import SimRequest


class _Repeat(Sequence[int]):
    """`n` copies of `value` in O(1) memory (placeholder token ids, one-version samples)."""

    def __init__(self, value: int, n: int) -> None:
        self.value, self.n = value, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self.value] * len(range(*i.indices(self.n)))
        if not -self.n <= i < self.n:
            raise IndexError(i)
        return self.value

    def __iter__(self):
        return repeat(self.value, self.n)


class _Segments(Sequence[int]):
    """Per-token versions from (version, first token) segments, without a list per token."""

    def __init__(self, segments: list[tuple[int, int]], n: int) -> None:
        bounds = [start for _, start in segments[1:]] + [n]
        self.runs = [(v, end - start) for (v, start), end in zip(segments, bounds, strict=True)]
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):  # type: ignore[override]
        return list(self)[i]

    def __iter__(self):
        return chain.from_iterable(repeat(v, k) for v, k in self.runs)


def sample_of(req: SimRequest, prompt_index: int, reward: float = 0.0) -> Sample:
    """The finished request as a `Sample`: placeholder tokens, its per-token versions, its
    simulated reward."""
    n = req.target_len
    versions: Sequence[int] = (
        _Repeat(req.segments[0][0], n) if len(req.segments) == 1 else _Segments(req.segments, n)
    )
    return Sample(
        group_id=req.group_id,
        sample_index=req.sample_index,
        prompt_id=prompt_index,
        prompt_ids=_Repeat(0, req.prompt_len),  # type: ignore[arg-type]
        response_ids=_Repeat(0, n),  # type: ignore[arg-type]
        versions=versions,  # type: ignore[arg-type]
        reward=reward,
        migrations=req.migrations,
        offloads=req.offloads,
    )
