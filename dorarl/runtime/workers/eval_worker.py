"""Held-out evaluation as a worker: greedy decoding (and, with `sampling.samples` = k, k
seeded samples per prompt) through its own engine, any version.

Runs beside rollout so an evaluation never stalls the instances or the trainer. In a LoRA
run whose versions travel as adapters (`EvalAdapters`) it is given adapters and merges
each into the base its folder holds, read again from the folder each time (its engine
then holds that merge, not the base). A version's weights are checked against the trainer's
manifest as engines check theirs (`Manifest.verify` as they arrive, `verify_hosted` once
copied; an adapter as it arrives): a mismatch refuses the evaluation, never scores it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from dorarl.engine import EngineConfig
from dorarl.engine.instance import close_engine, open_engine
from dorarl.engine.lora import merge_adapter
from dorarl.engine.weights import from_checkpoint, load_folder
from dorarl.runtime.threads import apply_threads, lower_priority
from dorarl.runtime.transfer.weight_layout import Manifest, WeightsRefused
from dorarl.runtime.workers.engine_worker import in_worker, verify_hosted
from dorarl.runtime.workers.startup import ActorStartup, Reusable, StartupClock
from dorarl.tasks import Task
from dorarl.tasks.evaluate import EvalSampling, evaluate
from dorarl.trainer.lora import read_adapter


@dataclass(frozen=True)
class EvalAdapters:
    """Versions arrive as adapters of this alpha and rank over the folder's base; `first`:
    the checkpoint folder whose adapter is the run's first version (None: the base)."""

    alpha: float
    rank: int
    first: str | None = None


class EvalWorker(Reusable):
    def __init__(
        self,
        model_folder: str,
        config: EngineConfig,
        task: Task,
        max_prompts: int,
        threads: int = 1,
        nice: int = 0,
        sampling: EvalSampling | None = None,
        adapters: EvalAdapters | None = None,
    ) -> None:
        clock = StartupClock()
        apply_threads(threads)  # at full priority while it starts: the run waits for it
        self.model_folder = model_folder
        self.engine = open_engine(model_folder, config)  # the run's backend
        self.task, self.max_prompts = task, max_prompts
        self.sampling = sampling or EvalSampling()
        self.adapters = adapters
        if adapters is not None and adapters.first is not None:
            self.engine.load_weights(self._merged(read_adapter(adapters.first)), 0)
        lower_priority(nice)
        self._startup = clock.done()

    def startup(self) -> ActorStartup:
        return self._startup

    def release(self) -> None:
        """The engine let go: the actor waits idle for a new run."""
        close_engine(self.engine)
        self.engine = None

    def _merged(self, adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The folder's base with `adapter` merged in."""
        assert self.adapters is not None
        base = load_folder(self.model_folder)
        spec = getattr(self.engine, "spec", None)  # vLLM takes the checkpoint's own names
        if spec is not None:
            base = from_checkpoint(spec, base)
        return merge_adapter(base, adapter, self.adapters.alpha, self.adapters.rank)

    def evaluate(
        self,
        weights: dict[str, torch.Tensor] | None,
        version: int,
        manifest: Manifest | None = None,
    ) -> dict[str, Any]:
        """Evaluate `version`: `weights` (full, or an adapter with EvalAdapters), or with
        None what the engine holds. `weights` must match the sender's `manifest`
        (WeightsRefused names the tensor that does not)."""
        if weights is not None and manifest is None:
            raise WeightsRefused(
                f"weights of version {version} refused on the evaluator: no manifest to check"
            )
        if weights is not None:
            self._load(weights, version, manifest)
        started = time.time()
        result: dict[str, Any] = dict(
            evaluate(self.engine, self.task, max_prompts=self.max_prompts, sampling=self.sampling)
        )
        result.update(version=version, eval_s=time.time() - started)
        return result

    def _load(self, weights: dict[str, torch.Tensor], version: int, manifest: Manifest) -> None:
        """Load `version`, checked as it arrives and, full weights, once copied."""
        where = "the evaluator"
        if self.adapters is not None:  # the adapter checked as it arrives, then merged
            manifest.verify(weights, version, where)
            self.engine.load_weights(self._merged(weights), version)
        elif not self.engine.capabilities.serves_weights:  # no readable copy: in its worker
            self.engine.load_weights(weights, version, in_worker(manifest, version, where))
        else:
            manifest.verify(weights, version, where)
            self.engine.load_weights(weights, version)
            verify_hosted(self.engine, manifest, version, where)
