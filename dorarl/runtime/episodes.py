"""Multi-turn episodes in the Ray runtime: the environments' event loop and their books.

Environments run as coroutines on one asyncio loop in a daemon thread of the driver's
process (`EnvLoop`), so an episode waiting on a slow tool holds neither a thread nor an
engine slot; answers come back through a queue the runtime drains between Ray answers.
The resets of the episodes one command starts run there together (a plain, blocking
`reset` in a thread of its own), and the driver waits for them at most the task's
`env_timeout_s` (and a grace): one that fails or hangs ends its episode at its first turn
(reward 0, one line for the run's first), never the driver.
`Episodes` keeps each live episode (its env, its turns, the last turn's engine output)
under an incarnation number: an episode started again (its engine died) gets a new env,
and an answer of the old one is dropped. Invariant: every episode that begins either ends
once (`finish`) or is started again; nothing it did is lost from the sample it becomes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from dorarl.engine import RequestOutput
from dorarl.tasks import Prompt
from dorarl.tasks.episodes import EpisodeSource, EpisodeState, reset, step

log = logging.getLogger(__name__)


class EnvLoop:
    """An asyncio loop on a daemon thread; results come back through a queue."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="envs")
        self._thread.start()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self.pending = 0

    def run(self, coro: Coroutine, timeout_s: float) -> Any:
        """Run and wait at most `timeout_s` (the resets before episodes' first turns);
        raises TimeoutError past it, the coroutine cancelled."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError from None

    def submit(self, key: Any, coro: Coroutine) -> None:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        self.pending += 1
        future.add_done_callback(lambda f: self._done.put((key, f)))

    def ready(self) -> list[tuple[Any, Any]]:
        out = []
        while not self._done.empty():
            key, future = self._done.get()
            self.pending -= 1
            out.append((key, future.result()))  # env failures are caught inside the coroutine
        return out

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


@dataclass
class _Live:
    state: EpisodeState
    incarnation: int
    last: RequestOutput | None = None


class Episodes:
    def __init__(self, task: Any, loop: EnvLoop | None = None) -> None:
        self.task = task
        self.loop = loop or EnvLoop()
        self._live: dict[str, _Live] = {}
        self._incarnations: dict[str, int] = {}
        self.env_errors = 0  # episodes an environment's failure ended
        self.first_error: str | None = None

    def begin(self, episodes: list[tuple[str, Prompt]]) -> list[list[int]]:
        """A fresh env for each (request, prompt); the ids of their first turns' prompts.
        Their resets run together; past `env_timeout_s` and a grace (an env that blocks the
        loop), those not done end at their first turn with the task's prompt."""
        states = [self._fresh(rid, prompt) for rid, prompt in episodes]
        if not states:
            return []
        timeout_s = self.task.env_timeout_s + RESET_GRACE_S
        try:
            return self.loop.run(_resets(self.task, states), timeout_s)
        except TimeoutError:
            return [_hung(self.task, state, timeout_s) for state in states]

    def _fresh(self, request_id: str, prompt: Prompt) -> EpisodeState:
        number = self._incarnations.get(request_id, 0) + 1
        self._incarnations[request_id] = number
        if request_id in self._live:  # started again: its old episode's agent is dropped
            _close(self._live[request_id].state)
        live = _Live(EpisodeState(prompt, self.task.make_env()), number)
        self._live[request_id] = live
        return live.state

    def turn_ended(self, request_id: str, output: RequestOutput) -> None:
        live = self._live[request_id]
        live.last = output
        key = (request_id, live.incarnation)
        turn = step(
            self.task, live.state, output.turn_ids, output.finish_reason, output.stop_string
        )
        self.loop.submit(key, turn)

    def ready(self) -> list[tuple[str, list[int] | None]]:
        """Answered turns of live episodes: (request, next observation ids or None: ended)."""
        out = []
        for (rid, number), ids in self.loop.ready():
            live = self._live.get(rid)
            if live is not None and live.incarnation == number:
                out.append((rid, ids))
        return out

    def last_output(self, request_id: str) -> RequestOutput:
        last = self._live[request_id].last
        assert last is not None, f"{request_id}: no turn ended yet"
        return last

    def finish(
        self, request_id: str, reason: str | None = None
    ) -> tuple[EpisodeState, RequestOutput]:
        live = self._live.pop(request_id)
        _close(live.state)
        if reason is not None:
            live.state.end(reason)
        if live.state.error is not None:
            self._count_error(request_id, live.state.error)
        assert live.last is not None, f"{request_id}: no turn ended yet"
        return live.state, live.last

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
        return self.loop.pending


RESET_GRACE_S = 5.0
"""How long past `env_timeout_s` the driver waits for resets: their own timeout fires
first unless an environment blocks the loop they share."""


async def _resets(task: Any, states: list[EpisodeState]) -> list[list[int]]:
    return list(await asyncio.gather(*(reset(task, state) for state in states)))


def _hung(task: Any, state: EpisodeState, timeout_s: float) -> list[int]:
    """A reset the loop never finished (an environment blocking it): the episode ends at
    its first turn, as a failed reset does; one finished meanwhile keeps its end."""
    if not state.done:
        state.end("env_error", f"reset timed out after {timeout_s:g} s (the loop was blocked)")
    return task.episode_prompt_ids(state.prompt)


def _close(state: EpisodeState) -> None:
    if isinstance(state.env, EpisodeSource):
        state.env.close()
