"""Group assembly: the samples of each dispatched group until a Train takes the group.

A group opens at its first Dispatch (prompt, version and, for forced lengths, each
sample's target length), or complete when a stopped run saved it (`restore`), and closes
when a Train takes it, or a FilterGroup (dynamic sampling) or a DropGroup does. Invariant: a taken group has exactly one sample per index 0..G-1 and is
taken once; a second sample for an index, or taking a group that lacks one (or is gone),
raises `ProtocolError` (a runtime bug, never silently trained on).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dorarl.controller import ProtocolError
from dorarl.data import Group, Sample, SavedGroup


@dataclass(slots=True)
class OpenGroup:
    prompt_index: int
    version: int
    target_lengths: list[int | None]
    samples: dict[int, Sample] = field(default_factory=dict)  # sample index -> sample


class GroupAssembly:
    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self._open: dict[int, OpenGroup] = {}

    def open(
        self, group_id: int, prompt_index: int, version: int, targets: list[int | None]
    ) -> OpenGroup:
        """The group's record, made at its first Dispatch (later Dispatches of the same
        group, on other instances, find it)."""
        group = self._open.get(group_id)
        if group is None:
            group = self._open[group_id] = OpenGroup(prompt_index, version, targets)
        return group

    def is_open(self, group_id: int) -> bool:
        return group_id in self._open

    def add(self, sample: Sample) -> None:
        group = self._open.get(sample.group_id)
        if group is None:
            raise ProtocolError(f"sample {sample.group_id}:{sample.sample_index}: no such group")
        if sample.sample_index in group.samples:
            raise ProtocolError(f"sample {sample.group_id}:{sample.sample_index} reported twice")
        group.samples[sample.sample_index] = sample

    def take(self, group_id: int) -> Group:
        """The complete group, samples in index order; it leaves the assembly."""
        group = self.complete(group_id)
        del self._open[group_id]
        return group

    def complete(self, group_id: int) -> Group:
        """The complete group, samples in index order (it stays in the assembly)."""
        group = self._open.get(group_id)
        have = len(group.samples) if group is not None else 0
        if group is None or have != self.group_size:
            raise ProtocolError(f"group {group_id} has {have}/{self.group_size} samples to take")
        samples = [group.samples[i] for i in sorted(group.samples)]
        return Group(group_id, samples[0].prompt_id, group.version, samples)

    def saved(self, group_id: int) -> SavedGroup:
        """The complete group as a checkpoint keeps it (with its prompt index)."""
        return SavedGroup(self.complete(group_id), self._open[group_id].prompt_index)

    def restore(self, saved: SavedGroup) -> None:
        """A complete group a stopped run saved opens again, to be taken by a Train."""
        group = saved.group
        if group.group_id in self._open or len(group.samples) != self.group_size:
            raise ProtocolError(f"carried group {group.group_id} is open or incomplete")
        opened = self.open(group.group_id, saved.prompt_index, group.version, [])
        opened.samples = {s.sample_index: s for s in group.samples}

    def discard(self, group_id: int) -> None:
        """The group closes untrained (dropped)."""
        self._open.pop(group_id, None)
