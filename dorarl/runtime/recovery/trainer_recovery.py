"""Replacing a dead trainer mid-run: restart from the newest checkpoint, replay the steps since.

Design (checkpoint + replay log). The runtime logs every call that changes the trainer's
state, in submission order: each training step with its batch (`TrainCall`) and each
checkpoint write with its data position (`SaveCall`). The log is cut each time a checkpoint
write is known complete (`TrainerLog.durable`, dorarl.runtime.recovery.trainer_log), so it holds exactly the calls since the
newest durable checkpoint. When the trainer's process dies (with trainer.world_size > 1:
any rank's; the whole group is replaced), a new trainer starts from the
newest complete checkpoint under the run's `checkpoints/` (or from the run's start point:
the base model, or the checkpoint the run resumed from, when none is written yet) and the
logged calls are re-submitted after it, in order, before anything else reaches it. This
module talks to the trainer side of the runtime only (`TrainerClient`, the call table).

What this gives, and what a test checks:
- The controller is told nothing, as for a dead engine (dorarl.runtime.recovery.engine_recovery): from its
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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from dorarl.record import Recorder
from dorarl.run_layout import checkpoint_version, version_folders
from dorarl.runtime.calls import DEATHS, Call, CallTable, ReplayCall, TrainerCall
from dorarl.runtime.recovery.trainer_log import SaveCall, TrainCall, TrainerLog
from dorarl.runtime.trainer_client import TrainerClient
from dorarl.runtime.workers.trainer_group import RankDied

log = logging.getLogger(__name__)

REPLAY_CHECKED = ("loss", "grad_norm")
"""Step metrics a replayed step must reproduce exactly (deterministic training)."""


def trainer_died(exc: Exception) -> bool:
    """Whether a trainer call failed because a trainer process died: the actor's own
    (rank 0's), or another rank of its group (rank 0 then fails the call with `RankDied`)."""
    cause = getattr(exc, "cause", None)
    return isinstance(exc, (*DEATHS, RankDied)) or isinstance(cause, RankDied)


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


def _kill(actor: Any, timeout_s: float = 60.0) -> None:
    """Kill `actor` and wait until it answers no more: `ray.kill` returns at once, and the
    checkpoints folder is read only once no checkpoint write of it can still finish."""
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.version.remote(), timeout=timeout_s)
        except (*DEATHS, ray.exceptions.RayActorError):
            return
        except ray.exceptions.GetTimeoutError:
            break
        time.sleep(0.05)
    log.warning("the dead trainer still answered after %.0fs; going on", timeout_s)


class TrainerRecovery:
    """Starts a new trainer when the trainer's process dies and replays its lost calls."""

    def __init__(
        self,
        trainer: TrainerClient,
        log: TrainerLog,
        calls: CallTable,
        recorder: Recorder,
        respawn: Callable[[str | None], Any],
        checkpoints: Path | None,
        max_restarts: int,
    ) -> None:
        self.trainer, self.log, self.calls, self.recorder = trainer, log, calls, recorder
        self.respawn = respawn  # folder to restore (None: the run's start point) -> actor
        self.checkpoints = checkpoints
        self.max_restarts = max_restarts
        self.start = trainer.published
        self.restarts = 0

    def recoverable(self, call: Call, exc: Exception) -> bool:
        return isinstance(call, TrainerCall) and trainer_died(exc)

    def on_failure(self, call: Call, cause: str = "") -> bool:
        """Replace the dead trainer and replay its calls; False when the budget is spent.
        `cause`: why it died, one line (dorarl.runtime.death_cause)."""
        if self.restarts >= self.max_restarts:
            return False
        self.restarts += 1
        self.recorder.died("the trainer", cause or "cause unknown", self.trainer.now())
        _kill(self.trainer.actor)  # a process half-alive must not write on
        self.calls.drop(TrainerCall)  # answers of the dead actor: all replayed below
        lowest = max(self.start, self.log.base)
        found = newest_checkpoint(self.checkpoints, lowest, self.trainer.published)
        version, folder = found if found else (self.log.base, None)
        if folder is None and version != self.start:
            log.error("the trainer died and its checkpoint of v%d is gone", version)
            return False
        log.warning(
            "the trainer died: %s; restarting it from %s (v%d), replaying %d step(s) (restart %d)",
            cause or "cause unknown",
            folder or "the run's start point",
            version,
            sum(isinstance(c, TrainCall) for c in self.log.since(version)),
            self.restarts,
        )
        self.trainer.replaced(self.respawn(str(folder) if folder else None), version)
        self._replay(version)
        return True

    def _replay(self, version: int) -> None:
        replayed = 0
        for call in self.log.since(version):
            if isinstance(call, SaveCall):
                self.trainer.submit_save(call)
            elif call.version < self.trainer.published:  # its TrainDone was delivered already
                self.trainer.submit_step(call, replay=True)
                replayed += 1
            else:  # the step in flight when the trainer died
                self.trainer.submit_step(call)
        self.recorder.trainer_restarted(version, replayed, self.trainer.now())

    # ---- answers of the replacement ------------------------------------------------------
    def on_replayed(self, metrics: dict[str, Any], call: ReplayCall) -> None:
        """A step of a dead trainer made again: its version's weights are the new trainer's."""
        self.trainer.weights.replace(call.step.version + 1, call.weights)
        self.check_replay(call.step.version, metrics)

    def check_replay(self, version: int, metrics: dict[str, Any]) -> None:
        """Compare a replayed step with the original (the recorder's row of `version`)."""
        original = next((row for row in self.recorder.steps if row.get("version") == version), None)
        if original is None:
            return
        differs = [k for k in REPLAY_CHECKED if k in original and original[k] != metrics.get(k)]
        if differs:
            self.recorder.replay_mismatch()
            log.warning(
                "replayed step v%d -> v%d differs from the original in %s: engines hosting "
                "v%d sampled with weights the new trainer does not have",
                version,
                version + 1,
                ", ".join(differs),
                version + 1,
            )
