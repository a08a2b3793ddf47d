"""Held-out evaluation as a worker: greedy decoding through its own engine, any version.

Runs beside rollout so an evaluation never stalls the instances or the trainer.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from dorarl.engine import Engine, EngineConfig, SamplingParams
from dorarl.tasks import Task, score


class EvalWorker:
    def __init__(
        self,
        model_folder: str,
        config: EngineConfig,
        task: Task,
        max_prompts: int,
        threads: int = 1,
    ) -> None:
        torch.set_num_threads(threads)
        self.engine = Engine.from_pretrained(model_folder, config, version=0)
        self.task, self.max_prompts = task, max_prompts

    def evaluate(self, weights: dict[str, torch.Tensor] | None, version: int) -> dict[str, Any]:
        if weights is not None:
            self.engine.load_weights(weights, version)
        started = time.time()
        result = self._greedy_accuracy()
        result.update(version=version, eval_s=time.time() - started)
        return result

    def _greedy_accuracy(self) -> dict[str, Any]:
        prompts = self.task.eval_prompts()[: self.max_prompts]
        params = SamplingParams(
            temperature=0.0,
            max_new_tokens=self.task.max_new_tokens,
            stop_token_ids=list(self.task.stop_token_ids),
        )
        for p in prompts:
            self.engine.add_request(str(p.prompt_id), list(p.prompt_ids), params)
        outputs = {}
        while self.engine.has_unfinished():
            outputs.update({o.request_id: o.output_ids for o in self.engine.step()})
        rewards = [score(self.task, p, outputs[str(p.prompt_id)])[0] for p in prompts]
        return {"accuracy": sum(r >= 1.0 for r in rewards) / len(prompts), "n": len(prompts)}
