"""The trainer as a runtime worker: one optimizer step per call, weights out for transfer.

A plain class; the Ray runtime wraps it in an actor. Each version is published as the
transport asks (`WeightServing`, dorarl.runtime.transfer.weight_endpoints; a LoRA trainer's
as its adapter alone when the engines hold adapters): a manifest with the
fingerprint of every tensor, computed on the trainer's device, and either CPU copies put
once in the object store for every loader to share, or flat buckets kept here that the
`weights` concurrency group sends to the engines that ask, beside the next training step.
With a `DeviceModel`, a training step lasts its device time (dorarl.record.pacing).

The trainer itself (dorarl.trainer.trainer: transformers' loading, FSDP) is imported inside
the actor: every engine that is handed this actor's handle imports this module (Ray loads
the handle's class), and would pay some 2 s and 200 MB for code it never runs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from dorarl.data import Group
from dorarl.record.pacing import DeviceModel, Pacer
from dorarl.runtime.threads import apply_threads
from dorarl.runtime.transfer import weight_endpoints as endpoints
from dorarl.runtime.transfer.weight_endpoints import ServedVersions, WeightServing
from dorarl.runtime.transfer.weight_group import (
    GroupAddress,
    Member,
    WeightGroup,
    device_key,
    open_store,
    own_host,
)
from dorarl.runtime.transfer.weight_layout import AdapterSpec, Manifest
from dorarl.runtime.workers.startup import ActorStartup, Reusable, StartupClock
from dorarl.trainer import checkpoint as ckpt
from dorarl.trainer.config import TrainerConfig


class TrainerWorker(Reusable):
    def __init__(
        self,
        model_folder: str,
        config: TrainerConfig,
        threads: int = 1,
        resume_from: str | None = None,
        pace: DeviceModel | None = None,
    ) -> None:
        clock = StartupClock()
        apply_threads(threads)
        self.model_folder = model_folder
        self.config = config
        self.pace = pace
        self.pacer = Pacer() if pace is not None else None
        self.threads = threads
        self.extra_state: dict[str, Any] = {}
        self.served = ServedVersions()  # versions the collective transport serves from here
        self.serving: WeightServing | None = None  # the transport's settings, once told
        self.group: WeightGroup | None = None
        self._store: Any = None
        self._start(resume_from)
        self._startup = clock.done()

    def _start(self, resume_from: str | None) -> None:
        """The trainer from `resume_from`, or from the base model (then extra_state is {})."""
        from dorarl.trainer.trainer import Trainer

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

    def release(self) -> None:
        """The model, its optimizer, the served versions and the weight group let go: the
        actor waits idle for a new run."""
        self.trainer = None
        self.served = ServedVersions()
        self.group = None
        self._store = None

    def startup(self) -> ActorStartup:
        """How long this actor took to come up (with several ranks: theirs included)."""
        return self._startup

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
        self, groups: list[Group], serving: WeightServing | None = None
    ) -> tuple[dict[str, Any], Any, Manifest | None]:
        """`train_step`, then the new version published: three results of one call, so a
        step that finished always comes with its weights (the runtime asks for three
        returns): the metrics, the object store's CPU copies (None when served from here)
        and the version's manifest (None without `serving`: plain CPU copies)."""
        metrics = self.train_step(groups)
        return (metrics, *self.publish(serving))

    def publish(self, serving: WeightServing | None = None) -> tuple[Any, Manifest | None]:
        """The current version for the engines (see `train_step_and_weights`)."""
        if serving is None:
            return self.weights(), None
        self.serving = serving
        version = self.trainer.version
        if serving.adapters:  # a LoRA run whose engines hold adapters: the adapter alone
            adapter = AdapterSpec(self.config.lora.alpha, self.config.lora.rank)
            named = self._device_adapters()
            return endpoints.publish(named, version, serving, self.served, adapter)
        return endpoints.publish(self._device_tensors(), version, serving, self.served)

    def weights(self) -> dict[str, torch.Tensor]:
        return self.trainer.named_tensors()

    def _device_tensors(self) -> dict[str, torch.Tensor]:
        """The current weights by HF name on the trainer's device (the ones that are views
        of live parameters are copied before the next step changes them)."""
        return self.trainer.named_tensors(on_device=True)

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """A LoRA trainer's adapters by peft's names, as CPU copies."""
        return self.trainer.adapter_tensors()

    def _device_adapters(self) -> dict[str, torch.Tensor]:
        return self.trainer.adapter_tensors(on_device=True)

    # ---- the weight-transfer group (dorarl.runtime.transfer.collective) ---------------------------
    def open_weight_store(self, loopback: bool, timeout_s: float) -> tuple[str, int]:
        """Host the group's store (rank 0) on a free port; returns its address."""
        host = own_host(loopback)
        self._store, port = open_store(host, timeout_s)
        return host, port

    def join_weights(self, address: GroupAddress, rank: int) -> Member:
        device = torch.device(self.config.device)
        self.group = WeightGroup(address, rank, device, store=self._store)
        return Member(rank, device_key(device))

    def send_weights(self, version: int, manifest: Manifest | None, dst: int) -> None:
        """Send a served version to rank `dst` (runs on the `weights` group)."""
        assert self.group is not None, "send_weights before join_weights"
        endpoints.send_served(self.group, self.served, version, manifest, dst, self._wait_s)

    def share_weights(self, version: int, manifest: Manifest | None, dst: int) -> list | None:
        """CUDA IPC handles of a served version (a receiver on this GPU)."""
        return endpoints.share_served(self.served, version, self._wait_s)

    def release_shared(self, version: int) -> None:
        """Nothing to free: served versions stay until the window moves past them."""

    def export_weights(self, version: int) -> dict[str, torch.Tensor]:
        """CPU copies of a served version (a receiver outside the group, the evaluator)."""
        return endpoints.export_served(self.served, version, self._wait_s)

    @property
    def _wait_s(self) -> float:
        # Not yet told: a replacement asked for a version it replays before its first publish.
        return self.serving.wait_s if self.serving is not None else endpoints.MADE_WAIT_S

    def save_checkpoint(
        self, folder: str, extra_state: dict[str, Any], keep: int = 0
    ) -> ckpt.SavedCheckpoint:
        """Write a checkpoint, then delete all but the newest `keep` beside it (0: keep all)
        and the optimizer state of all but the newest (a resume reads the newest)."""
        started = time.perf_counter()
        written = self._save(Path(folder), extra_state)
        ckpt.prune(written.parent, keep)
        ckpt.drop_older_optimizer_state(written.parent)
        seconds = time.perf_counter() - started
        return ckpt.SavedCheckpoint(str(written), ckpt.folder_bytes(written), seconds)

    def _train(self, groups: list[Group]) -> dict[str, Any]:
        return self.trainer.train_step(groups)

    def _save(self, folder: Path, extra_state: dict[str, Any]) -> Path:
        return self.trainer.save_checkpoint(folder, extra_state)


def _trained_tokens(groups: list[Group]) -> int:
    return sum(len(s.prompt_ids) + len(s.response_ids) for g in groups for s in g.samples)
