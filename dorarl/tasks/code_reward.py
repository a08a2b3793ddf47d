"""The code task's reward: each response's program run on its problem's tests in the sandbox,
on a bounded pool of threads sized to the machine, off the caller's thread.

Reward: the share of tests passed, or with `all_tests` 1 only when every one passes; the
part `tests_passed` is the share, and `first_failure` (info) says which test failed first and
why. Invariant: `score` never raises; each wave of `WAVE` programs per worker returns within
about `WAVE` times the sandbox's wall time; a response without a closed ```python block
scores 0 (not an error); a sandbox that fails or a program past the pool's bound is a reward error
(reward 0, counted), the first of a process logged in one line.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from dorarl.tasks.bounded_calls import BoundedPool
from dorarl.tasks.code_blocks import final_code_block
from dorarl.tasks.code_tests import CodeTest, read_tests
from dorarl.tasks.sandbox import RunResult, Sandbox
from dorarl.tasks.sandbox.process import KILL_WAIT_S
from dorarl.tasks.user_rewards import RewardInput, Scored

log = logging.getLogger(__name__)

PART = "tests_passed"
NO_CODE = "no closed ```python code block"
WAVE = 4  # programs per worker handed to the pool at once


_Outcome = tuple[RunResult | None, BaseException | None]


@dataclass(frozen=True)
class _Job:
    """One response's program and its tests (no program: nothing to run)."""

    code: str | None
    tests: list[CodeTest]


class CodeRewards:
    """Scores code responses in `sandbox`; the task's `user_rewards` (scoring.score_all)."""

    key = "task.reward"

    def __init__(self, sandbox: Sandbox, all_tests: bool = False, workers: int | None = None):
        self.sandbox, self.all_tests = sandbox, all_tests
        self.workers = workers or os.cpu_count() or 1
        self._pool: BoundedPool | None = None
        self._warned = False

    def score(self, inputs: list[RewardInput]) -> list[Scored]:
        jobs = [_job(given) for given in inputs]
        calls = [self._call(job.code, t) for job in jobs if job.code is not None for t in job.tests]
        outcomes = iter(self._run(calls))
        return [self._scored(job, outcomes) for job in jobs]

    def _call(self, code: str, test: CodeTest) -> Callable[[], RunResult]:
        return lambda: self.sandbox.run(test.program(code), test.stdin)

    def _run(self, calls: list[Callable[[], RunResult]]) -> list[_Outcome]:
        """Every call's outcome; in waves of `WAVE` calls per worker, so a call waits for a
        thread at most `WAVE - 1` programs' bounded runs and the pool's bound covers both."""
        per_program = self.sandbox.limits.wall_s + KILL_WAIT_S
        if self._pool is None:
            self._pool = BoundedPool(self.workers, WAVE * per_program + 5.0, "code tests")
        outcomes, wave = [], WAVE * self.workers
        for start in range(0, len(calls), wave):
            outcomes += self._pool.run_all(calls[start : start + wave])
        return outcomes

    def _scored(self, job: _Job, outcomes: Iterator[_Outcome]) -> Scored:
        if job.code is None:
            return Scored(0.0, None, {PART: 0.0}, {"first_failure": NO_CODE})
        results = [next(outcomes) for _ in job.tests]
        failures = []
        for i, (result, exc) in enumerate(results):
            if exc is not None:
                return self._failed(exc)
            why = job.tests[i].failure(result)
            if why is not None:
                failures.append(f"test {i + 1} of {len(job.tests)}: {why}")
        share = 1.0 - len(failures) / len(job.tests)
        reward = float(not failures) if self.all_tests else share
        info = {"first_failure": failures[0]} if failures else {}
        return Scored(reward, None, {PART: share}, info)

    def _failed(self, exc: BaseException) -> Scored:
        error = f"{type(exc).__name__}: {exc}"
        if not self._warned:
            self._warned = True
            log.warning("code sandbox failed (reward 0, counted in reward_errors): %s", error)
        return Scored(0.0, error)

    def __reduce__(self) -> tuple:
        return (CodeRewards, (self.sandbox, self.all_tests, self.workers))


def _job(given: RewardInput) -> _Job:
    language = given.row.get("language", "python")
    return _Job(final_code_block(given.response, language), read_tests(given.row, "row"))
