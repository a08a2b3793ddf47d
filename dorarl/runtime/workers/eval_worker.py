"""Held-out evaluation as a worker: greedy decoding (and, with `sampling.samples` = k, k
seeded samples per prompt) through its own engine, any version.

Runs beside rollout so an evaluation never stalls the instances or the trainer.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from dorarl.engine import Engine, EngineConfig
from dorarl.runtime.threads import apply_threads
from dorarl.runtime.workers.startup import ActorStartup, StartupClock
from dorarl.tasks import Task
from dorarl.tasks.evaluate import EvalSampling, evaluate


class EvalWorker:
    def __init__(
        self,
        model_folder: str,
        config: EngineConfig,
        task: Task,
        max_prompts: int,
        threads: int = 1,
        nice: int = 0,
        sampling: EvalSampling | None = None,
    ) -> None:
        clock = StartupClock()
        apply_threads(threads, nice)
        self.engine = Engine.from_pretrained(model_folder, config, version=0)
        self.task, self.max_prompts = task, max_prompts
        self.sampling = sampling or EvalSampling()
        self._startup = clock.done()

    def startup(self) -> ActorStartup:
        return self._startup

    def evaluate(self, weights: dict[str, torch.Tensor] | None, version: int) -> dict[str, Any]:
        if weights is not None:
            self.engine.load_weights(weights, version)
        started = time.time()
        result: dict[str, Any] = dict(
            evaluate(self.engine, self.task, max_prompts=self.max_prompts, sampling=self.sampling)
        )
        result.update(version=version, eval_s=time.time() - started)
        return result
