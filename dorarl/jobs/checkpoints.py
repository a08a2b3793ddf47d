"""A run's checkpoint writes: every `checkpoint_every` versions and at the end (or none:
`off`), each reported in one line once written, and none waited for longer than
`checkpoint_timeout_s`.

A periodic write goes to the trainer before the controller hears of the new version, with
the data position to resume at; the runtime replays it on a new trainer if this one dies
first (trainer recovery).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from dorarl.config import ConfigError
from dorarl.errors import RunFailed
from dorarl.jobs.config import TrainConfig
from dorarl.jobs.resume import find_checkpoint
from dorarl.run_layout import RunFolder
from dorarl.runtime.ray_runtime import RayRuntime

log = logging.getLogger(__name__)


@dataclass
class Checkpoints:
    """The run's checkpoint writes: every `checkpoint_every` versions and at the end (or
    none: `off`), each reported in one line once written (path, size on disk, seconds)."""

    every: int | str  # checkpoint_every
    keep: int
    steps: int
    out_dir: Path
    timeout_s: float = 1800.0  # checkpoint_timeout_s: the longest the run's end waits
    pending: list[Any] = field(default_factory=list)  # writes not yet reported

    @classmethod
    def of(cls, config: TrainConfig, out_dir: Path) -> Checkpoints:
        return cls(
            config.checkpoint_every, config.checkpoint_keep, config.steps, out_dir,
            config.checkpoint_timeout_s,
        )  # fmt: skip

    @property
    def off(self) -> bool:
        return self.every == "off"

    def periodic_due(self, version: int, stopping: bool) -> bool:
        """Whether `version` gets a periodic checkpoint. The last version is saved at the
        end, and so is the one a stop ends at: once, not rewritten (a rewrite gains nothing,
        and a trainer restored from a checkpoint pruned since copies its tokenizer files
        from there: none)."""
        every = self.every
        if self.off or stopping or not every or version >= self.steps:
            return False
        return version % every == 0

    def periodic(self, runtime: RayRuntime, version: int) -> None:
        """Before the controller hears of `version` (its data position is the checkpoint's)."""
        self.report(wait=False)
        if self.periodic_due(version, runtime.driver.should_stop()):
            self.pending.append(self._write(runtime, runtime.driver.controller.resume_state()))

    def final(self, runtime: RayRuntime, position: dict[str, Any]) -> None:
        """The end's checkpoint (none when off), waited for, and every write reported; the
        run has ended, so a failure of this one is the run's."""
        self.report(wait=True)
        if not self.off:
            write = self._write(runtime, position)
            ready, _ = ray.wait([write], timeout=self.timeout_s)
            if not ready:
                raise RunFailed(self._late(f"v{position['version']}"))
            print(ray.get(write).line())

    def _late(self, what: str) -> str:
        try:
            newest = f"the newest written is {find_checkpoint(self.out_dir).name}"
        except ConfigError:
            newest = "none was written"
        return (
            f"checkpoint of {what} not written after {self.timeout_s:.0f}s "
            f"(checkpoint_timeout_s); {newest}"
        )

    def _write(self, runtime: RayRuntime, position: dict[str, Any]) -> ray.ObjectRef:
        """Queue a checkpoint of the published version, with the data position to resume
        at (through the runtime, which replays it on a new trainer if this one dies first)."""
        version = runtime.trainer_client.published
        assert position["version"] == version, f"data position of v{position['version']}"
        folder = RunFolder(self.out_dir).checkpoint(version)
        return runtime.trainer_client.save_checkpoint(folder, position, self.keep)

    def report(self, wait: bool) -> None:
        """One line for each periodic write finished (with `wait`: for each, once finished).
        One the trainer died in was made again by trainer recovery as the run went on."""
        if not self.pending:
            return
        timeout = self.timeout_s if wait else 0
        done, self.pending = ray.wait(self.pending, num_returns=len(self.pending), timeout=timeout)
        if wait and self.pending:
            raise RunFailed(self._late(f"{len(self.pending)} periodic write(s)"))
        for ref in done:
            try:
                print(ray.get(ref).line())
            except ray.exceptions.RayError:
                log.warning("a checkpoint write died with its trainer; trainer recovery redid it")

    def resumable(self) -> bool:
        """Whether the run folder holds a checkpoint to resume from."""
        try:
            find_checkpoint(self.out_dir)
        except ConfigError:
            return False
        return True
