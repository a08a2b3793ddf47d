"""Where a resumed run starts: a checkpoint folder, its version and its data position.

`resume=` names a checkpoint (`checkpoints/version_N`) or a run folder (its newest
checkpoint); `dorarl train` reads it once (`read_resume_point`) and hands the point on.
The trainer restores weights, optimizer and RNG from it; engines load its weights as
version N; the driver queues the complete groups a run's last checkpoint kept (`carried`)
under their own versions, and the controller dispatches the prompts the checkpoint never
trained on first (`Controller.resume_state`, saved with every checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dorarl.config import ConfigError
from dorarl.data import SavedGroup, group_from_json
from dorarl.errors import RunComplete
from dorarl.run_layout import CHECKPOINT_NAMES, STATE_FILE, RunFolder, version_folders


@dataclass(frozen=True)
class ResumePoint:
    folder: Path
    version: int
    first_group: int = 0
    first_prompt: int = 0
    resume_prompts: list[int] = field(default_factory=list)
    carried: list[SavedGroup] = field(default_factory=list)  # complete, not trained on
    books: dict[str, Any] | None = None  # the group counts of the segment that wrote it

    def controller_keys(self) -> dict[str, Any]:
        return {
            "initial_version": self.version,
            "first_group": self.first_group,
            "first_prompt": self.first_prompt,
            "resume_prompts": list(self.resume_prompts),
        }


def find_checkpoint(path: str | Path) -> Path:
    """The checkpoint `path` names: itself, or the newest of the run folder `path`."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return path
    checkpoints = RunFolder(path).checkpoints
    found = version_folders(checkpoints)
    if not found:
        raise ConfigError(
            f"resume: {path} is neither a checkpoint (no {STATE_FILE}) nor a run folder with "
            f"{checkpoints.name}/{CHECKPOINT_NAMES}"
        )
    return found[-1]


def check_work_left(point: ResumePoint, steps: int) -> None:
    """RunComplete when the checkpoint already holds the version the run ends at (what a
    stop that lands after the last step leaves: nothing is wrong, nothing to train)."""
    if point.version >= steps:
        raise RunComplete(
            f"{point.folder} is version {point.version} and steps={steps}: the run is "
            f"complete; steps=N (N > {point.version}) trains it further"
        )


def read_resume_point(path: str | Path) -> ResumePoint:
    """The checkpoint `path` names (itself, or a run folder's newest) and its data position."""
    from dorarl.trainer.checkpoint import read_state

    folder = find_checkpoint(path)
    state = read_state(folder)
    extra = state.get("extra_state", {})
    version = int(state["version"])
    if int(extra.get("version", version)) != version:
        raise ConfigError(
            f"resume: {folder} holds trainer version {version} but its data position is of "
            f"version {extra['version']}"
        )
    return ResumePoint(
        folder=folder,
        version=version,
        first_group=int(extra.get("first_group", 0)),
        first_prompt=int(extra.get("first_prompt", 0)),
        resume_prompts=[int(p) for p in extra.get("resume_prompts", [])],
        carried=[group_from_json(g) for g in extra.get("carried_groups", [])],
        books=extra.get("books"),
    )
