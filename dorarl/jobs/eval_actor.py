"""The evaluator beside a Ray run: one actor evaluating the versions it is asked for.

It never stalls rollout or training: versions are handed to it as they are published
(`offer`), or, with `defer`, kept until the run ends so it takes no CPU from a timed run.
Each result is appended to the run's evaluations.jsonl once it is seen finished, so a run
stopped or killed later keeps it. The evaluator checks a version's weights against the
trainer's manifest as engines do, so weights that differ fail their evaluation instead of
scoring it. An evaluation that fails, or an evaluator that dies (Ray's memory monitor may
pick it), costs that evaluation, in one line, never the run.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from dorarl.engine.config import EngineConfig
from dorarl.jobs.config import TrainConfig
from dorarl.jobs.resume import ResumePoint
from dorarl.jobs.workload import eval_sampling
from dorarl.record.evaluations import append_evaluation
from dorarl.runtime.actors import EvaluatorSpec
from dorarl.runtime.threads import ThreadPlan
from dorarl.runtime.workers.eval_worker import EvalAdapters
from dorarl.tasks import Task

log = logging.getLogger(__name__)


def evaluator_spec(
    config: TrainConfig,
    model_folder: str,
    task: Task,
    threads: ThreadPlan,
    point: ResumePoint | None = None,
    preload: str | None = None,
) -> EvaluatorSpec:
    """The evaluator of a run: an engine like the rollout engines (greedy decoding); in a
    LoRA run whose versions travel as adapters it merges each into the base
    (`model_folder`), the checkpoint's adapter (`point`) first; on malloc `preload`."""
    sampling = eval_sampling(config)
    adapters = None
    if config.adapter_versions:
        lora = config.trainer.lora
        adapters = EvalAdapters(lora.alpha, lora.rank, str(point.folder) if point else None)
    return EvaluatorSpec(
        model_folder, evaluator_engine(config.engine), task, config.eval.max_prompts, sampling,
        threads.evaluator, threads.evaluator_nice, adapters, preload,
    )  # fmt: skip


def evaluator_engine(engine: EngineConfig) -> EngineConfig:
    """The evaluator's engine: the rollout engines' backend and keys; a vLLM one eager (it
    evaluates now and then: torch.compile's minutes of start-up would not pay back) and
    with no adapter slots (it merges a LoRA version into the base)."""
    if engine.backend != "vllm":
        return engine
    vllm = dataclasses.replace(engine.vllm, enforce_eager=True)
    return dataclasses.replace(engine, vllm=vllm, max_versions=1)


Sent = tuple[ray.ObjectRef, ray.ObjectRef] | None
"""What an evaluation is of: a version's weights and the manifest they must match, or
None: what the evaluator holds from its start (the run's first version)."""
EVALUATOR_RESTARTS = 2


class Evaluations:
    """The run's evaluations by version: asked for as versions appear, each appended to
    `record` (the run's evaluations.jsonl) once seen finished, gathered at the end. A dead
    evaluator (its process killed, or by the node's memory monitor) is replaced by
    `respawn` at most EVALUATOR_RESTARTS times, and every evaluation asked of it is asked
    of the new one; past that, later versions go unevaluated."""

    def __init__(
        self,
        evaluator: Any,
        wanted: set[int],
        start: int,
        defer: bool,
        record: Path,
        timeout_s: float = 1800.0,
        respawn: Callable[[], Any] | None = None,
    ) -> None:
        self.evaluator, self.wanted, self.defer, self.record = evaluator, wanted, defer, record
        self.respawn, self.restarts = respawn, 0
        self.asked: dict[int, tuple[int, Sent]] = {}  # version -> (restarts then, what was sent)
        self.timeout_s = timeout_s  # how long the run's end waits for the evaluations
        self.recorded: set[int] = set()
        self.running: dict[int, ray.ObjectRef] = {}
        self.told: set[int] = set()  # versions whose results were looked at
        self.gone = False  # the evaluator died: later versions go unevaluated
        # version -> its weights and the manifest they must match (None: what it holds)
        self.deferred: dict[int, Sent] = {start: None} if start in wanted else {}
        if not defer and start in wanted:
            self.running[start] = self._evaluate(start, None)

    def offer(self, version: int, weights: ray.ObjectRef, manifest: ray.ObjectRef) -> None:
        """`version` was published with `weights`, which must match the trainer's `manifest`
        (the evaluator refuses them otherwise): evaluate it if it is wanted."""
        if version not in self.wanted or self.gone:
            return
        if self.defer:
            self.deferred[version] = (weights, manifest)
        elif version not in self.running:
            self.running[version] = self._evaluate(version, (weights, manifest))

    def _evaluate(self, version: int, sent: Sent) -> ray.ObjectRef:
        """Ask for `version`'s evaluation: of its weights checked by their manifest, or
        with None of what the evaluator holds."""
        self.asked[version] = (self.restarts, sent)
        weights, manifest = sent if sent is not None else (None, None)
        return self.evaluator.evaluate.remote(weights, version, manifest)

    def finished(self) -> dict[int, dict[str, Any]]:
        """The evaluations finished by now (a stopped run waits for no others)."""
        if not self.running:
            return {}
        refs = list(self.running.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return self._seen(self._results(set(ready)))

    def all(self) -> dict[int, dict[str, Any]]:
        """Every wanted evaluation, waiting up to `timeout_s` for them (the deferred ones run
        now); one not finished by then is left out, in one line, and the run ends without
        it (its checkpoint and summary matter more than one evaluation)."""
        if self.defer and not self.gone:
            self.running = {v: self._evaluate(v, sent) for v, sent in self.deferred.items()}
        deadline = time.monotonic() + self.timeout_s
        results: dict[int, dict[str, Any]] = {}
        while waiting := [ref for v, ref in self.running.items() if v not in results]:
            left = deadline - time.monotonic()
            ready, _ = ray.wait(waiting, num_returns=len(waiting), timeout=max(0.0, left))
            results |= self._results(set(ready))  # a dead evaluator's are asked again
            if left <= 0 or len(ready) < len(waiting):
                self._late(sorted(v for v in self.running if v not in results))
                break
        return self._seen(results)

    def _late(self, late: list[int]) -> None:
        if late:
            log.warning(
                "evaluation of %s not finished after %.0fs (eval.timeout_s): left out",
                ", ".join(f"v{v}" for v in late),
                self.timeout_s,
            )

    def _results(self, done: set[ray.ObjectRef]) -> dict[int, dict[str, Any]]:
        """The results of the `done` evaluations; a failed one is told and dropped."""
        results = {}
        for version, ref in list(self.running.items()):
            if ref not in done:
                continue
            try:
                results[version] = ray.get(ref)
            except ray.exceptions.RayError as exc:
                del self.running[version]
                self._failed(version, exc)
        return results

    def _failed(self, version: int, exc: ray.exceptions.RayError) -> None:
        dead = isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError))
        reason = next((line for line in str(exc).splitlines() if line.strip()), "")[:200]
        asked_of, sent = self.asked[version]
        if dead and (asked_of < self.restarts or self._restart(version, exc, reason)):
            self.running[version] = self._evaluate(version, sent)  # of the new evaluator
            return
        log.warning(
            "evaluation of v%d failed, left out (%s: %s)%s",
            version,
            type(exc).__name__,
            reason,
            "; the evaluator is gone, so later versions go unevaluated" if dead else "",
        )
        self.gone = self.gone or dead

    def _restart(self, version: int, exc: ray.exceptions.RayError, reason: str) -> bool:
        """Replace the dead evaluator, within the budget; False when none is left."""
        if self.respawn is None or self.restarts >= EVALUATOR_RESTARTS:
            return False
        ray.kill(self.evaluator, no_restart=True)
        self.evaluator = self.respawn()
        self.restarts += 1
        log.warning(
            "the evaluator died evaluating v%d (%s: %s): a new one evaluates it and every "
            "evaluation in flight again (restart %d of %d)",
            version, type(exc).__name__, reason, self.restarts, EVALUATOR_RESTARTS,
        )  # fmt: skip
        return True

    def _seen(self, results: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        """`results`, each new one appended to the record and its failed episodes told."""
        return self._told(self._recorded(results))

    def _recorded(self, results: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        """`results`, each appended to the record the first time it is seen."""
        for version in sorted(results.keys() - self.recorded):
            append_evaluation(self.record, results[version])
            self.recorded.add(version)
        return results

    def _told(self, results: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        """`results`, once one line has told each new one's failed episodes (the evaluator
        is a Ray actor, whose own log lines do not reach the terminal)."""
        for version, result in sorted(results.items()):
            if result.get("env_errors") and version not in self.told:
                log.warning(
                    "evaluation of v%d: %d of %d episodes ended by their environment (reward "
                    "0), the first with: %s",
                    version,
                    result["env_errors"],
                    result["n"],
                    result.get("env_error", "?"),
                )
            self.told.add(version)
        return results
