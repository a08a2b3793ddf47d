"""The reward model beside rollout: finished samples wait for its score on its own actor
while the engines go on, then reach the driver with the score mixed into their reward.

One batch is in flight at a time: whatever finished while it ran (up to `max_batch`) goes
next, so a step's completions are scored together and nothing waits on a fixed batch size.
Every look at the actor is bounded (`ray.wait` with no wait, `ray.get` of an answer that is
in). A batch the actor does not answer within its bound, or an actor that dies, costs the
actor: it is replaced (up to `restarts` times; past that the run stops naming it) and the
batch is scored again by the new one. A batch the model raises on scores 0 as reward
errors (the same texts would raise again). Each batch's time goes to the recorder.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from dorarl.data import Sample
from dorarl.errors import WorkerFailed
from dorarl.record import Recorder
from dorarl.runtime.actors import actor_options
from dorarl.runtime.calls import DEATHS
from dorarl.runtime.death_cause import death_cause
from dorarl.runtime.workers.reward_worker import RewardWorker
from dorarl.tasks.reward_model import RewardModelSpec

log = logging.getLogger(__name__)

WORKER = "the reward model"
LOAD_TIMEOUT_S = 600.0  # a fresh actor's model load, on top of its first batch's bound
REWARD_MODEL_PART = "reward_model"
VERIFIER_PART = "verifier"


@dataclass
class _Batch:
    items: list[tuple[int, Sample]]  # (the instance it finished on, the sample)
    pairs: list[tuple[str, str]]  # (prompt, response) texts the model reads
    ref: Any = None
    deadline: float = 0.0  # monotonic seconds
    started: float = 0.0  # run seconds (the recorder's clock)


def spawn_reward_worker(spec: RewardModelSpec) -> Any:
    """The reward model's actor: `num_gpus` of them on a GPU machine, else the CPU."""
    options = actor_options("reward_model", "cpu", None)
    options["num_gpus"] = spec.num_gpus
    return ray.remote(**options)(RewardWorker).remote(spec)


def mixed(sample: Sample, score: float, mix: float) -> Sample:
    """`sample` with the model's `score` weighed in: reward (1 - mix) x verifier + mix x
    score; the score a part named `reward_model` beside the verifier's parts (its reward,
    as `verifier`, when it has none)."""
    parts = dict(sample.reward_parts)
    if not parts and sample.reward_error is None:
        parts[VERIFIER_PART] = sample.reward
    parts[REWARD_MODEL_PART] = score
    reward = (1.0 - mix) * sample.reward + mix * score
    return dataclasses.replace(sample, reward=reward, reward_parts=parts)


def failed(sample: Sample, why: str) -> Sample:
    """`sample` the model gave no score: reward 0, the error said."""
    return dataclasses.replace(sample, reward=0.0, reward_error=f"reward model: {why}")


class RewardModelScoring:
    """Samples held for the reward model's score; `ready` gives those scored since."""

    def __init__(
        self,
        spec: RewardModelSpec,
        texts: Callable[[Sample], tuple[str, str]],
        recorder: Recorder,
        now: Callable[[], float],
        spawn: Callable[[RewardModelSpec], Any] = spawn_reward_worker,
    ) -> None:
        self.spec, self.texts, self.recorder, self.now, self.spawn = (
            spec,
            texts,
            recorder,
            now,
            spawn,
        )
        self.actor: Any = None
        self.fresh = True  # the actor has answered no batch yet: its load counts in the bound
        self.waiting: list[tuple[int, Sample]] = []
        self.batch: _Batch | None = None
        self.restarts = 0
        self.errors = 0  # samples scored 0 for a failure of the model

    @property
    def pending(self) -> int:
        """Samples held: waiting for a batch or in the one in flight."""
        return len(self.waiting) + (len(self.batch.items) if self.batch else 0)

    def start(self) -> None:
        """Start the actor and wait (bounded) for its model to load: a model that cannot
        load stops the run before it starts, in one line."""
        self.actor = self.spawn(self.spec)
        try:
            ray.get(self.actor.kind.remote(), timeout=LOAD_TIMEOUT_S)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            raise WorkerFailed(WORKER, f"{type(exc).__name__}: {exc}") from exc
        self.fresh = False

    def close(self) -> None:
        if self.actor is not None:
            ray.kill(self.actor)
            self.actor = None

    def submit(self, instance_id: int, samples: list[Sample]) -> None:
        """Hold `samples` (finished on `instance_id`) for their score."""
        self.waiting += [(instance_id, s) for s in samples]
        self._send()

    def ready(self) -> list[tuple[int, Sample]]:
        """The samples scored since the last look, each with the instance it finished on;
        the next batch goes out."""
        done = self._answered() if self.batch is not None else []
        self._send()
        return done

    def _send(self) -> None:
        if self.batch is not None or not self.waiting:
            return
        items, self.waiting = (
            self.waiting[: self.spec.max_batch],
            self.waiting[self.spec.max_batch :],
        )
        self.batch = _Batch(items, [self.texts(s) for _, s in items])
        self._dispatch(self.batch)

    def _dispatch(self, batch: _Batch) -> None:
        bound = self.spec.timeout_s + (LOAD_TIMEOUT_S if self.fresh else 0.0)
        batch.ref = self.actor.score.remote(batch.pairs)
        batch.deadline, batch.started = time.monotonic() + bound, self.now()

    def _answered(self) -> list[tuple[int, Sample]]:
        batch = self.batch
        assert batch is not None
        ready, _ = ray.wait([batch.ref], timeout=0)
        if not ready:
            if time.monotonic() > batch.deadline:
                self._replace(batch, f"no answer within {self.spec.timeout_s:g} s")
            return []
        try:
            scores, seconds = ray.get(batch.ref, timeout=self.spec.timeout_s)
        except DEATHS as exc:
            self._replace(batch, death_cause(exc))
            return []
        except (ray.exceptions.RayError, TimeoutError) as exc:
            self.batch = None
            return self._all_failed(batch, _first_line(exc))
        self.batch, self.fresh = None, False
        self.recorder.reward_model_batch(len(batch.items), seconds, batch.started, self.now())
        return [self._scored(iid, s, x) for (iid, s), x in zip(batch.items, scores, strict=True)]

    def _scored(self, instance_id: int, sample: Sample, score: float) -> tuple[int, Sample]:
        if not isinstance(score, float | int) or not math.isfinite(score):
            self._count_error(f"gave no score ({score})")
            return instance_id, failed(sample, f"gave no score ({score})")
        return instance_id, mixed(sample, float(score), self.spec.mix)

    def _all_failed(self, batch: _Batch, why: str) -> list[tuple[int, Sample]]:
        self._count_error(why, len(batch.items))
        return [(iid, failed(s, why)) for iid, s in batch.items]

    def _count_error(self, why: str, n: int = 1) -> None:
        if not self.errors:
            log.warning("reward model failed (reward 0, counted in reward_errors): %s", why)
        self.errors += n

    def _replace(self, batch: _Batch, cause: str) -> None:
        """A new actor in place of the dead or stuck one; `batch` goes to it again."""
        self.recorder.died(WORKER, cause, self.now())
        if self.restarts >= self.spec.restarts:
            raise WorkerFailed(WORKER, f"{cause} (replaced {self.restarts} times already)")
        ray.kill(self.actor)
        self.restarts += 1
        self.actor, self.fresh = self.spawn(self.spec), True
        self.recorder.reward_model_restarted(len(batch.items), self.now())
        self._dispatch(batch)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}".strip()
