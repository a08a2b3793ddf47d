"""Episodes' resets in the Ray runtime's books (dorarl.runtime.episodes), no Ray needed:
they run together on the environments' loop and the driver never waits for them (`begin`
returns at once; the first prompts come through `ready`); one that raises, hangs or blocks
the loop ends its episode at its first turn (reward 0, one logged line for the first)
while the others go on, and a blocked step is bounded the same way."""

import asyncio
import logging
import time

import pytest
from episodes_testlib import answers

from dorarl.engine import RequestOutput
from dorarl.runtime.episodes import Episodes
from dorarl.tasks import make_task
from dorarl.tasks.env import Env, EnvStep
from dorarl.tasks.env_task import EnvTask

TIMEOUT_S = 0.3
GRACE_S = 1.0  # the driver's bound past TIMEOUT_S (5 s in a run)


class Quick(Env):
    async def reset(self, prompt):
        await asyncio.sleep(0.2)  # the resets of one start overlap: 0.2 s for all of them
        return " go"

    async def step(self, response):
        return EnvStep("", 1.0, True)


class Raises(Quick):
    async def reset(self, prompt):
        raise ConnectionError("sandbox refused\nmore lines")


class Hangs(Quick):
    async def reset(self, prompt):
        await asyncio.sleep(3600)


class Blocking(Quick):
    """A plain reset that blocks (a user's synchronous client): it runs in a thread."""

    def reset(self, prompt):
        time.sleep(2)
        return " go"


class BlocksTheLoop(Quick):
    """An async reset that blocks its loop: only the driver's own bound saves the run."""

    async def reset(self, prompt):
        time.sleep(TIMEOUT_S + GRACE_S + 1)
        return " go"


class StepBlocksTheLoop(Quick):
    async def reset(self, prompt):
        return " go"

    async def step(self, response):
        time.sleep(TIMEOUT_S + GRACE_S + 1)
        return EnvStep("", 1.0, True)


@pytest.fixture(scope="module")
def base():
    return make_task("multiturn_sum", seed=0)


def _begin(base, env_class, n=4):
    """Begin `n` episodes; (episodes, prompts, first prompt ids in request order, how long
    `begin` held the caller, how long until every first prompt was in)."""
    task = EnvTask(base, env_class, max_turns=4, timeout_s=TIMEOUT_S)
    episodes = Episodes(task, grace_s=GRACE_S)
    prompts = base.train_prompts()[:n]
    start = time.monotonic()
    episodes.begin([(f"r{i}", p) for i, p in enumerate(prompts)])
    held = time.monotonic() - start
    first = answers(episodes, n, TIMEOUT_S + GRACE_S + 2)
    return episodes, prompts, [first[f"r{i}"] for i in range(n)], held, time.monotonic() - start


def _first_turn_ends(episodes, rid):
    """The first turn's end: a failed reset's episode ends there, reward 0."""
    out = RequestOutput(rid, [1], [2, 3], [0.0, 0.0], [0, 0], "stop", waits_env=True)
    episodes.turn_ended(rid, out)
    assert answers(episodes, 1, TIMEOUT_S + GRACE_S + 2) == {rid: None}
    return episodes.finish(rid)[0]


def test_resets_run_together_and_the_driver_never_waits_for_them(base):
    episodes, prompts, ids, held, took = _begin(base, Quick, n=8)
    assert held < 0.1  # submitted, not waited for
    assert took < 1.0  # eight 0.2 s resets, not 1.6 s one after the other
    assert episodes.pending == 0
    go = base.tokenizer(" go", add_special_tokens=False)["input_ids"]
    assert ids == [list(p.prompt_ids) + go for p in prompts]
    state = _first_turn_ends(episodes, "r0")
    assert state.reward == 1.0 and state.error is None


@pytest.mark.parametrize(
    ("env_class", "error"),
    [
        (Raises, "reset raised ConnectionError: sandbox refused"),
        (Hangs, f"reset timed out after {TIMEOUT_S:g} s"),
        (Blocking, f"reset timed out after {TIMEOUT_S:g} s"),
    ],
)
def test_a_failing_or_hanging_reset_ends_its_episode_with_0_in_one_line(
    base, env_class, error, caplog
):
    episodes, prompts, ids, held, took = _begin(base, env_class)
    assert held < 0.1
    assert took < TIMEOUT_S + 1.0  # the env's own timeout ended them, not the env
    assert ids == [list(p.prompt_ids) for p in prompts]  # the task's prompt alone
    with caplog.at_level(logging.WARNING):
        states = [_first_turn_ends(episodes, f"r{i}") for i in range(len(prompts))]
    assert all(s.reward == 0.0 and s.end_reason == "env_error" for s in states)
    assert all(s.error == error for s in states)
    assert episodes.env_errors == len(prompts)
    told = [r.getMessage() for r in caplog.records if "ended by its environment" in r.message]
    assert len(told) == 1 and error in told[0]


def test_a_reset_that_blocks_the_loop_is_overdue_after_its_bound(base):
    episodes, prompts, ids, held, took = _begin(base, BlocksTheLoop, n=1)
    assert held < 0.1
    assert TIMEOUT_S + GRACE_S - 0.1 < took < TIMEOUT_S + GRACE_S + 0.9
    assert ids == [list(p.prompt_ids) for p in prompts]
    assert episodes.pending == 0  # its late answer is not waited for
    time.sleep(1.2)  # the blocked reset returns meanwhile: its answer is dropped
    assert episodes.ready() == []
    state = _first_turn_ends(episodes, "r0")
    assert state.reward == 0.0 and state.error.startswith("reset timed out after")


def test_a_step_that_blocks_the_loop_ends_its_episode_after_its_bound(base):
    episodes, prompts, ids, held, took = _begin(base, StepBlocksTheLoop, n=1)
    start = time.monotonic()
    state = _first_turn_ends(episodes, "r0")
    assert time.monotonic() - start > TIMEOUT_S + GRACE_S - 0.1
    assert state.reward == 0.0 and state.end_reason == "env_error"
    assert state.error == f"step timed out after {TIMEOUT_S + GRACE_S:g} s (the loop was blocked)"
