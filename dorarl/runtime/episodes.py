"""Multi-turn episodes in the Ray runtime: the environments' event loop and their books.

Environments run as coroutines on one asyncio loop in a daemon thread of the driver's
process (`EnvLoop`), so an episode waiting on a slow tool or a slow reset holds neither a
thread nor an engine slot, and the driver never waits for one: resets and turns alike are
submitted, and their answers come back through a queue the runtime drains between Ray
answers (a reset's answer is the first turn's prompt). Each call is bounded twice: by the
task's `env_timeout_s` on the loop, and by `overdue` on the driver's side (past that and a
grace: an environment blocking the loop itself), so a call that fails, hangs, blocks or
is cancelled ends its episode (reward 0, one line for the run's first), never the driver;
only a chat template's drift (`TemplateDrift`) stops the run.
`Episodes` keeps each live episode (its env, its turns, the last turn's engine output)
under an incarnation number: an episode started again (its engine died) gets a new env,
and an answer of the old one is dropped. Invariant: every episode that begins either ends
once (`finish`) or is started again; nothing it did is lost from the sample it becomes.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from dorarl.engine import RequestOutput
from dorarl.tasks import Prompt
from dorarl.tasks.conversation import TemplateDrift
from dorarl.tasks.episodes import EpisodeSource, EpisodeState, reset, step

log = logging.getLogger(__name__)


class EnvLoop:
    """An asyncio loop on a daemon thread; results come back through a queue."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="envs")
        self._thread.start()
        self._done: queue.SimpleQueue = queue.SimpleQueue()

    def submit(self, key: Any, coro: Coroutine) -> None:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        future.add_done_callback(lambda f: self._done.put((key, f)))

    def ready(self) -> list[tuple[Any, Any, BaseException | None]]:
        """The calls that finished: (key, result, None), or (key, None, what it raised).
        An env's own failures are caught inside its coroutine; what escapes (a cancelled
        call, a bug) comes back here to end its episode, never raised in the driver."""
        out = []
        while not self._done.empty():
            key, future = self._done.get()
            if future.cancelled():
                out.append((key, None, asyncio.CancelledError("the call was cancelled")))
            elif future.exception() is not None:
                out.append((key, None, future.exception()))
            else:
                out.append((key, future.result(), None))
        return out

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


@dataclass
class _Live:
    state: EpisodeState
    incarnation: int
    last: RequestOutput | None = None


@dataclass
class _Asked:
    """An env call out on the loop: whose, which kind, and when it went."""

    request_id: str
    incarnation: int
    first: bool  # the reset: its answer is the first turn's prompt
    since: float


OVERDUE_GRACE_S = 5.0
"""How long past `env_timeout_s` the driver waits for an env call: the call's own timeout
fires first unless an environment blocks the loop they share."""


class Episodes:
    def __init__(
        self, task: Any, loop: EnvLoop | None = None, grace_s: float = OVERDUE_GRACE_S
    ) -> None:
        self.task = task
        self.loop = loop or EnvLoop()
        self.grace_s = grace_s  # past env_timeout_s: an env call the loop never ran to its end
        self._live: dict[str, _Live] = {}
        self._incarnations: dict[str, int] = {}
        self._asked: dict[int, _Asked] = {}  # by call number: answered or overdue, it goes
        self._calls = 0
        self.env_errors = 0  # episodes an environment's failure ended
        self.first_error: str | None = None
        self.counts: Counter[str] = Counter()  # episode sources' own counts, summed

    def begin(self, episodes: list[tuple[str, Prompt]]) -> None:
        """A fresh env for each (request, prompt), its reset submitted: the first turn's
        prompt ids come back through `ready` (or `overdue`), the driver never waits."""
        for request_id, prompt in episodes:
            live = self._fresh(request_id, prompt)
            self._ask(request_id, live, reset(self.task, live.state), first=True)

    def _fresh(self, request_id: str, prompt: Prompt) -> _Live:
        number = self._incarnations.get(request_id, 0) + 1
        self._incarnations[request_id] = number
        if request_id in self._live:  # started again: its old episode's agent is dropped
            self._retire(self._live[request_id].state)
        live = _Live(EpisodeState(prompt, self.task.make_env()), number)
        self._live[request_id] = live
        return live

    def _ask(self, request_id: str, live: _Live, call: Coroutine, first: bool) -> None:
        self._calls += 1
        self._asked[self._calls] = _Asked(request_id, live.incarnation, first, time.monotonic())
        self.loop.submit(self._calls, call)

    def turn_ended(self, request_id: str, output: RequestOutput) -> None:
        live = self._live[request_id]
        live.last = output
        turn = step(
            self.task, live.state, output.turn_ids, output.finish_reason, output.stop_string
        )
        self._ask(request_id, live, turn, first=False)

    def ready(self) -> list[tuple[str, list[int] | None]]:
        """Answered calls of live episodes: (request, ids or None: it ended). A reset's ids
        are the first turn's prompt, a turn's the next observation."""
        out = []
        for number, ids, raised in self.loop.ready():
            if isinstance(raised, TemplateDrift):
                raise raised  # the model's chat template: the run's failure, in one line
            asked = self._asked.pop(number, None)
            if asked is None or not self._current(asked):
                continue  # overdue already, or of an episode started again since: dropped
            if raised is not None:
                ids = self._failed(asked, _line(raised))
            out.append((asked.request_id, ids))
        return out

    def overdue(self) -> list[tuple[str, list[int] | None]]:
        """Calls out past `env_timeout_s` and a grace: their own timeout never fired, so an
        environment blocks the loop. Each ends its episode as a failed call does (a reset:
        at its first turn, with the task's prompt); a late answer is dropped."""
        bound_s = self.task.env_timeout_s + self.grace_s
        now = time.monotonic()
        out: list[tuple[str, list[int] | None]] = []
        for number, asked in list(self._asked.items()):
            if now - asked.since <= bound_s:
                break  # the calls are in the order they went out: the rest are younger
            del self._asked[number]
            if self._current(asked):
                what = "reset" if asked.first else "step"
                error = f"{what} timed out after {bound_s:g} s (the loop was blocked)"
                out.append((asked.request_id, self._failed(asked, error)))
        return out

    def _current(self, asked: _Asked) -> bool:
        live = self._live.get(asked.request_id)
        return live is not None and live.incarnation == asked.incarnation

    def _failed(self, asked: _Asked, error: str) -> list[int] | None:
        """A call that gave no answer ends its episode as a failed env call does: a reset
        at its first turn (with the task's prompt), a step now."""
        state = self._live[asked.request_id].state
        if not state.done:
            state.end("env_error", error)
        return self.task.episode_prompt_ids(state.prompt) if asked.first else None

    def last_output(self, request_id: str) -> RequestOutput:
        last = self._live[request_id].last
        assert last is not None, f"{request_id}: no turn ended yet"
        return last

    def finish(
        self, request_id: str, reason: str | None = None
    ) -> tuple[EpisodeState, RequestOutput]:
        live = self._live.pop(request_id)
        self._retire(live.state)
        if reason is not None:
            live.state.end(reason)
        if live.state.error is not None:
            self._count_error(request_id, live.state.error)
        assert live.last is not None, f"{request_id}: no turn ended yet"
        return live.state, live.last

    def _retire(self, state: EpisodeState) -> None:
        """An episode ended or started again: its source released, what it counted summed."""
        if isinstance(state.env, EpisodeSource):
            state.env.close()
            self.counts.update(state.env.counts())

    def _count_error(self, request_id: str, error: str) -> None:
        """Count an episode its environment ended; the first is told in one line, the
        others only counted (env_errors in the step rows, the progress line, summary.json):
        a broken environment fails every episode, and a line each would bury the run's."""
        self.env_errors += 1
        if self.first_error is None:
            self.first_error = error
            log.warning(
                "episode %s ended by its environment (reward 0): %s; further ones are counted "
                "in env_errors (metrics.jsonl, summary.json) and their trajectory rows",
                request_id,
                error,
            )
        else:
            log.debug("episode %s ended by its environment: %s", request_id, error)

    @property
    def pending(self) -> int:
        """Env calls out (resets and turns) the driver still expects an answer to."""
        return len(self._asked)


def _line(raised: BaseException) -> str:
    text = str(raised).splitlines()[0] if str(raised) else ""
    return f"the env call raised {type(raised).__name__}: {text}"
