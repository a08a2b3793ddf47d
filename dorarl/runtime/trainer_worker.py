"""The trainer as a runtime worker: one optimizer step per call, weights out for transfer.

A plain class; the Ray runtime wraps it in an actor. Weights leave as a dict of HF names
to CPU tensors, put once in the object store per version so every loader shares them.
With a `DeviceModel`, a training step lasts its device time (dorarl.record.pacing).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from dorarl.data import Group
from dorarl.record.pacing import DeviceModel, Pacer
from dorarl.runtime.threads import apply_threads
from dorarl.trainer import Trainer, TrainerConfig
from dorarl.trainer import checkpoint as ckpt


class TrainerWorker:
    def __init__(
        self,
        model_folder: str,
        config: TrainerConfig,
        threads: int = 1,
        resume_from: str | None = None,
        pace: DeviceModel | None = None,
    ) -> None:
        apply_threads(threads)
        self.model_folder = model_folder
        self.config = config
        self.pace = pace
        self.pacer = Pacer() if pace is not None else None
        self.threads = threads
        self.extra_state: dict[str, Any] = {}
        self._start(resume_from)

    def _start(self, resume_from: str | None) -> None:
        """The trainer from `resume_from`, or from the base model (then extra_state is {})."""
        if resume_from:
            self.trainer, self.extra_state = Trainer.resume(
                resume_from, self.config, self.config.device
            )
        else:
            self.trainer = Trainer.from_pretrained(
                self.model_folder, self.config, self.config.device
            )
            self.extra_state = {}

    def reset(self) -> int:
        """A fresh trainer from the base model (version 0, new optimizer), as if just started."""
        del self.trainer
        self._start(None)
        self.pacer = Pacer() if self.pace is not None else None
        return self.trainer.version

    def version(self) -> int:
        return self.trainer.version

    def train_step(self, groups: list[Group]) -> dict[str, Any]:
        started = time.perf_counter()
        metrics = self._train(groups)
        metrics["train_compute_s"] = time.perf_counter() - started
        if self.pacer is not None:
            paced = self.pace.train_step_s(_trained_tokens(groups))
            self.pacer.finish(started, paced)
            metrics["train_paced_s"] = paced
            metrics["train_over_pace"] = int(metrics["train_compute_s"] > paced)
        return metrics

    def train_step_and_weights(
        self, groups: list[Group]
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """`train_step`, then the new version's weights: two results of one call, so a step
        that finished always comes with its weights (the runtime asks for two returns)."""
        return self.train_step(groups), self.weights()

    def weights(self) -> dict[str, torch.Tensor]:
        return self.trainer.named_tensors()

    def save_checkpoint(self, folder: str, extra_state: dict[str, Any], keep: int = 0) -> str:
        """Write a checkpoint, then delete all but the newest `keep` beside it (0: keep all)."""
        written = self._save(Path(folder), extra_state)
        ckpt.prune(written.parent, keep)
        return str(written)

    def _train(self, groups: list[Group]) -> dict[str, Any]:
        return self.trainer.train_step(groups)

    def _save(self, folder: Path, extra_state: dict[str, Any]) -> Path:
        return self.trainer.save_checkpoint(folder, extra_state)


def _trained_tokens(groups: list[Group]) -> int:
    return sum(len(s.prompt_ids) + len(s.response_ids) for g in groups for s in g.samples)
