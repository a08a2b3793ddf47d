"""A run folder's layout, the one module that names its files and folders and maps a
checkpoint folder's name to its version and back; every writer and reader goes through it.

    RUN/config.json, metrics.jsonl, trajectories.jsonl, evaluations.jsonl, summary.json,
        trace.json, reward_curve.png, dashboard.png, failure.txt, tensorboard/
    RUN/checkpoints/version_NNNNN/ (trainer_state.json marks a complete one; a rewrite
        leaves version_N.tmp while it writes and version_N.old between its two renames)
    RUN/segments/NNN/segment.json, summary.json, trace.json (one per process that ran it)
    RUN/rolled_back/ (what a resume from an older version moved aside, in the same layout)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
TRAJECTORIES_FILE = "trajectories.jsonl"
EVALUATIONS_FILE = "evaluations.jsonl"
SUMMARY_FILE = "summary.json"
TRACE_FILE = "trace.json"
SEGMENT_START_FILE = "segment.json"
STATE_FILE = "trainer_state.json"
CHECKPOINTS = "checkpoints"
SEGMENTS = "segments"
ROLLED_BACK = "rolled_back"
TENSORBOARD = "tensorboard"

_CHECKPOINT_PREFIX = "version_"
# a glob of the checkpoint folders, and how a message names them
CHECKPOINT_NAMES = f"{_CHECKPOINT_PREFIX}*"
_CHECKPOINT = re.compile(r"version_(\d+)")
_DISPLACED = re.compile(r"version_(\d+)\.old")  # dorarl.trainer.checkpoint.swap_in's


def checkpoint_name(version: int) -> str:
    """The folder name of the checkpoint of `version`: version_00012."""
    return f"{_CHECKPOINT_PREFIX}{version:05d}"


def checkpoint_version(path: Path) -> int | None:
    """N for a checkpoint folder `version_N` (or its displaced copy `version_N.old`)."""
    match = _CHECKPOINT.fullmatch(path.name) or _DISPLACED.fullmatch(path.name)
    return int(match.group(1)) if match else None


def checkpoint_version_strict(path: Path) -> int | None:
    """N for `version_N` itself: neither a displaced copy nor an unfinished write."""
    match = _CHECKPOINT.fullmatch(path.name)
    return int(match.group(1)) if match else None


def checkpoint_entries(parent: Path) -> list[Path]:
    """Every entry under `parent` named like a checkpoint (`.tmp` and `.old` included), in
    name order: version_N sorts before its .old."""
    return sorted(Path(parent).glob(CHECKPOINT_NAMES))


def unfinished_writes(parent: Path) -> list[Path]:
    """The `.tmp` folders of checkpoint writes that never finished."""
    return sorted(Path(parent).glob(f"{CHECKPOINT_NAMES}.tmp"))


def version_folders(parent: Path) -> list[Path]:
    """Complete checkpoints under `parent` (version_N with a state file), oldest first. A
    .tmp is never one; a .old is, when a rewrite died before its version_N was back."""
    found: dict[int, Path] = {}
    for path in checkpoint_entries(parent):
        version = checkpoint_version(path)
        if version is not None and version not in found and (path / STATE_FILE).is_file():
            found[version] = path
    return [found[v] for v in sorted(found)]


def run_of_checkpoint(path: Path) -> Path | None:
    """The run folder a checkpoint folder was written in (RUN/checkpoints/version_N), by
    its place alone; None for a checkpoint elsewhere."""
    return path.parent.parent if path.parent.name == CHECKPOINTS else None


@dataclass(frozen=True)
class RunFolder:
    """The paths of one run folder (`root`)."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def config(self) -> Path:
        return self.root / CONFIG_FILE

    @property
    def metrics(self) -> Path:
        return self.root / METRICS_FILE

    @property
    def trajectories(self) -> Path:
        return self.root / TRAJECTORIES_FILE

    @property
    def evaluations(self) -> Path:
        return self.root / EVALUATIONS_FILE

    @property
    def summary(self) -> Path:
        return self.root / SUMMARY_FILE

    @property
    def trace(self) -> Path:
        return self.root / TRACE_FILE

    @property
    def reward_curve(self) -> Path:
        return self.root / "reward_curve.png"

    @property
    def dashboard(self) -> Path:
        return self.root / "dashboard.png"

    @property
    def failure(self) -> Path:
        return self.root / "failure.txt"

    @property
    def tensorboard(self) -> Path:
        return self.root / TENSORBOARD

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    @property
    def segments(self) -> Path:
        return self.root / SEGMENTS

    @property
    def rolled_back(self) -> RunFolder:
        """Where a resume from an older version moves later records, in the same layout."""
        return RunFolder(self.root / ROLLED_BACK)

    def checkpoint(self, version: int) -> Path:
        return self.checkpoints / checkpoint_name(version)

    def segment(self, index: int) -> Path:
        return self.segments / f"{index:03d}"
