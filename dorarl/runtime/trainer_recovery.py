"""Replacing a dead trainer mid-run: restart from the newest checkpoint, replay the steps since.

Design (checkpoint + replay log). The runtime logs every call that changes the trainer's
state, in submission order: each training step with its batch (`TrainCall`) and each
checkpoint write with its data position (`SaveCall`). The log is cut each time a checkpoint
write is known complete (`TrainerLog.durable`), so it holds exactly the calls since the
newest durable checkpoint. When the trainer's process dies, a new trainer starts from the
newest complete checkpoint under the run's `checkpoints/` (or from the run's start point:
the base model, or the checkpoint the run resumed from, when none is written yet) and the
runtime re-submits the logged calls after it, in order, before anything else reaches it.

What this gives, and what a test checks:
- The controller is told nothing, as for a dead engine (dorarl.runtime.recovery): from its
  side a training step took longer. Its ledger, its decisions and hence exactly-once
  consumption and Eq. 1 (every consumed group: 0 <= train_version - behaviour_version <= K)
  are those of a run without the fault. Groups sampled and not yet trained on never leave
  the engines or the runtime's completed-groups buffer; groups consumed by steps the dead
  trainer made after the checkpoint are trained again, on the same batches, in the same
  order, from the same optimizer and RNG state, so the lost versions are made again.
- Versions are one weight set each when training is deterministic (CPU kernels are): the
  replayed step's loss and gradient norm are compared with the original's; a difference is
  counted (`replay_mismatches` in summary.json) and logged, because engines that still host
  a version made by the dead trainer then hold weights the new one never had. The
  importance ratio still uses each sample's own behaviour log-probabilities, so the loss
  stays correct; only the version label is then approximate.
- Weights of published versions stay in the object store (they are results owned by the
  driver, not by the trainer process), so engines keep loading them while the trainer
  replays; each replayed version then replaces its entry. On a multi-node cluster whose
  trainer node dies those objects are lost with it, which this does not handle.
- History files (metrics.jsonl, trajectories.jsonl) get no rows from replayed steps: their
  rows were written when the steps first ran and the replay makes the same steps.
- Memory: the driver holds the batches since the newest durable checkpoint
  (`checkpoint_every` bounds them; with checkpoint_every=0 they are the whole run's).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from dorarl.data import Group
from dorarl.runtime.recovery import DEATHS
from dorarl.trainer.checkpoint import checkpoint_version, version_folders

if TYPE_CHECKING:
    from dorarl.runtime.ray_runtime import RayRuntime, _Pending

log = logging.getLogger(__name__)

TRAINER_KINDS = ("train", "replay", "save")
"""Pending-call kinds that run on the trainer actor."""

REPLAY_CHECKED = ("loss", "grad_norm")
"""Step metrics a replayed step must reproduce exactly (deterministic training)."""


@dataclass(frozen=True)
class TrainCall:
    """The step that trains `version` into `version + 1` on `groups`."""

    version: int
    groups: list[Group]


@dataclass(frozen=True)
class SaveCall:
    """A checkpoint of `version` written to `folder` with the data position `position`."""

    version: int
    folder: str
    position: dict[str, Any] = field(default_factory=dict)
    keep: int = 0


TrainerCall = TrainCall | SaveCall


class TrainerLog:
    """The trainer's state-changing calls since the newest durable checkpoint (`base`)."""

    def __init__(self, base: int) -> None:
        self.base = base
        self.calls: list[TrainerCall] = []

    def record(self, call: TrainerCall) -> None:
        self.calls.append(call)

    def durable(self, version: int) -> None:
        """A checkpoint of `version` is complete: calls it already contains are dropped."""
        if version <= self.base:
            return
        self.base = version
        self.calls = [c for c in self.calls if not _contained_in(c, version)]

    def since(self, version: int) -> list[TrainerCall]:
        """The calls that bring a trainer restored at `version` back to the lost one's state."""
        if version < self.base:
            raise RuntimeError(f"trainer log starts at v{self.base}, cannot replay from v{version}")
        return [c for c in self.calls if not _contained_in(c, version)]


def _contained_in(call: TrainerCall, version: int) -> bool:
    """Whether a checkpoint of `version` already reflects `call`."""
    return call.version < version if isinstance(call, TrainCall) else call.version <= version


def newest_checkpoint(folder: Path | None, lowest: int, highest: int) -> tuple[int, Path] | None:
    """The newest complete checkpoint under `folder` with a version in [lowest, highest]."""
    if folder is None:
        return None
    found = []
    for path in version_folders(folder):
        version = checkpoint_version(path)
        if lowest <= version <= highest:
            found.append((version, path))
    return found[-1] if found else None


class TrainerRecovery:
    """Starts a new trainer when the trainer's process dies and replays its lost calls."""

    def __init__(
        self,
        runtime: RayRuntime,
        respawn: Callable[[str | None], Any],
        checkpoints: Path | None,
        max_restarts: int,
    ) -> None:
        self.runtime = runtime
        self.respawn = respawn  # folder to restore (None: the run's start point) -> actor
        self.checkpoints = checkpoints
        self.max_restarts = max_restarts
        self.start = runtime.config.initial_version
        self.log = TrainerLog(self.start)
        self.restarts = 0

    def recoverable(self, job: _Pending, exc: Exception) -> bool:
        return job.kind in TRAINER_KINDS and isinstance(exc, DEATHS)

    def on_failure(self, job: _Pending) -> bool:
        """Replace the dead trainer and replay its calls; False when the budget is spent."""
        if self.restarts >= self.max_restarts:
            return False
        self.restarts += 1
        rt = self.runtime
        ray.kill(rt.trainer, no_restart=True)  # a process half-alive must not write on
        for ref in [ref for ref, p in rt.pending.items() if p.kind in TRAINER_KINDS]:
            del rt.pending[ref]  # answers of the dead actor: all replayed below
        found = newest_checkpoint(self.checkpoints, max(self.start, self.log.base), rt.published)
        version, folder = found if found else (self.log.base, None)
        if folder is None and version != self.start:
            log.error("the trainer died and its checkpoint of v%d is gone", version)
            return False
        log.warning(
            "the trainer died; restarting it from %s (v%d) and replaying %d step(s) (%d)",
            folder or "the run's start point",
            version,
            sum(isinstance(c, TrainCall) for c in self.log.since(version)),
            self.restarts,
        )
        rt.trainer = self.respawn(str(folder) if folder else None)
        self._replay(version)
        return True

    def _replay(self, version: int) -> None:
        rt = self.runtime
        replayed = 0
        for call in self.log.since(version):
            if isinstance(call, SaveCall):
                rt.submit_save(call)
            elif call.version < rt.published:  # its TrainDone was delivered already
                rt.submit_train(call.version, call.groups, "replay")
                replayed += 1
            else:  # the step in flight when the trainer died
                rt.submit_train(call.version, call.groups, "train")
        rt.recorder.trainer_restarted(version, replayed, rt.now())

    def check_replay(self, version: int, metrics: dict[str, Any]) -> None:
        """Compare a replayed step with the original (the recorder's row of `version`)."""
        rt = self.runtime
        original = next((row for row in rt.recorder.steps if row.get("version") == version), None)
        if original is None:
            return
        differs = [k for k in REPLAY_CHECKED if k in original and original[k] != metrics.get(k)]
        if differs:
            rt.recorder.replay_mismatch()
            log.warning(
                "replayed step v%d -> v%d differs from the original in %s: engines hosting "
                "v%d sampled with weights the new trainer does not have",
                version,
                version + 1,
                ", ".join(differs),
                version + 1,
            )
