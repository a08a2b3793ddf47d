"""The reward model as a worker: a batch of (prompt, response) texts in, their scores and
the seconds the batch took out. On the GPU Ray gives it (`num_gpus`), else the CPU."""

from __future__ import annotations

import time

from dorarl.tasks.reward_model import RewardModel, RewardModelSpec


class RewardWorker:
    def __init__(self, spec: RewardModelSpec) -> None:
        self.model = RewardModel(spec, "cuda" if spec.num_gpus > 0 else "cpu")

    def kind(self) -> str:
        """What it loaded ("classifier" or "judge"): answered once the model is in."""
        return self.model.kind

    def score(self, pairs: list[tuple[str, str]]) -> tuple[list[float], float]:
        start = time.perf_counter()
        scores = self.model.score(pairs)
        return scores, time.perf_counter() - start
