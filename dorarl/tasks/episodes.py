"""Episodes of a multi-turn task: one environment per episode, its calls bounded in time.

`EpisodeState` is one episode's bookkeeping (its env, turns, reward, how it ended), shared
by the runtime and by evaluation. `env_call` runs an env coroutine under the task's
timeout and turns whatever it raises into one line (`EnvError`), as is an answer that cannot
be read (no `EnvStep`, a reward that is no finite number), so a broken environment ends its
episode (reward 0, counted) and never the run. `run_episodes` plays episodes to
the end on an idle engine (evaluation). A `ChatEnv`'s episode keeps a `Conversation`:
each turn's reply is parsed, its calls served in order (a malformed or unknown call, or a
`ToolError`, is answered with an error tool message and counted; the episode goes on), and
the next turn's tokens are the template's delta. Invariant: an episode ends after at most
`max_turns` turns, with the sum of its steps' rewards; a chat template that re-renders
what the model was shown stops the run in one line (`TemplateDrift`), never only the episode.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import numbers
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Protocol

from dorarl.data import NewSegment, Turn
from dorarl.errors import UserInputError
from dorarl.tasks.base import Prompt
from dorarl.tasks.conversation import Conversation, Message, TemplateDrift, tool_message
from dorarl.tasks.env import ChatEnv, ChatStep, Env, EnvStep, ToolError
from dorarl.tasks.tool_calls import ToolCall, ToolCallError


class MultiTurnTask(Protocol):
    """What a multi-turn task adds to `Task`."""

    multi_turn: bool
    max_turns: int
    env_timeout_s: float

    def make_env(self) -> Env: ...

    def episode_prompt_ids(self, prompt: Prompt) -> list[int]: ...


class EnvError(Exception):
    """An environment call failed or timed out; the message is one line."""


class EpisodeSource(ABC):
    """An episode whose prompts come from somewhere other than an `Env` (a user's agent
    through the OpenAI endpoint, dorarl.tasks.agent): it gives each turn's prompt ids and
    keeps the episode's books itself (`record`, `end`), under the same bounds."""

    @abstractmethod
    async def first_ids(self, task: Any, episode: EpisodeState) -> list[int]:
        """The first turn's prompt ids (on failure: `episode.end`, and the task's prompt)."""

    @abstractmethod
    async def next_ids(
        self,
        task: Any,
        episode: EpisodeState,
        turn_ids: list[int],
        finish_reason: str,
        stop_string: str | None,
    ) -> list[int] | None:
        """Take a sampled turn; the ids to append, or None when the episode ended."""

    @abstractmethod
    def close(self) -> None:
        """The episode is over or started again: release what it holds (no wait)."""

    def counts(self) -> dict[str, int]:
        """What the episode counted that the run sums (metrics.jsonl, summary.json)."""
        return {}


def off_loop(method: Any, *args: Any) -> Any:
    """Call an environment's method without blocking the loop its episodes share: a
    coroutine method as it is, a plain one (a user's blocking `reset`, say) in a thread,
    where a hang outlives its episode's timeout but holds only that thread."""
    if inspect.iscoroutinefunction(method):
        return method(*args)
    return asyncio.to_thread(method, *args)


async def env_call(awaitable: Any, timeout_s: float, what: str) -> Any:
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except TimeoutError:
        raise EnvError(f"{what} timed out after {timeout_s:g} s") from None
    except Exception as exc:  # a user's environment: any failure ends the episode only
        line = str(exc).splitlines()[0] if str(exc) else ""
        raise EnvError(f"{what} raised {type(exc).__name__}: {line}") from None


@dataclass
class EpisodeState:
    prompt: Prompt
    env: Env | ChatEnv | EpisodeSource
    turns: list[Turn] = field(default_factory=list)
    reward: float = 0.0
    error: str | None = None
    done: bool = False
    end_reason: str = ""  # "env" | "max_turns" | "no_room" | "env_error"
    conversation: Conversation | None = None  # a ChatEnv's, from its reset on

    def record(
        self,
        sampled: int,
        finish_reason: str,
        step: EnvStep | ChatStep | None,
        observed: int,
        calls: tuple[int, int] = (0, 0),
    ) -> None:
        """One turn's books; `calls`: (tool calls its reply attempted, those answered with an
        error)."""
        self.turns.append(Turn(sampled, observed, finish_reason, *calls))
        if step is not None:
            self.reward += float(step.reward)

    def end(self, reason: str, error: str | None = None) -> None:
        self.done, self.end_reason, self.error = True, reason, error
        if error is not None:
            self.reward = 0.0


def observation_ids(task: Any, text: str) -> list[int]:
    return list(task.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


async def reset(task: Any, episode: EpisodeState) -> list[int]:
    """The first turn's prompt: the task's prefix, then the first observation (a chat
    environment's: its first messages, rendered)."""
    if isinstance(episode.env, EpisodeSource):
        return await episode.env.first_ids(task, episode)
    if isinstance(episode.env, ChatEnv):
        return await _chat_reset(task, episode, episode.env)
    prefix = task.episode_prompt_ids(episode.prompt)
    try:
        first = await env_call(
            off_loop(episode.env.reset, episode.prompt), task.env_timeout_s, "reset"
        )
        _check_shown("reset", first, str)
    except EnvError as exc:
        episode.end("env_error", str(exc))
        return prefix
    return prefix + observation_ids(task, first)


async def step(
    task: Any,
    episode: EpisodeState,
    turn_ids: list[int],
    finish_reason: str,
    stop_string: str | None = None,
) -> list[int] | None:
    """Judge one turn (its sampled ids, and how the engine ended it); the next observation's
    ids, or None when the episode ended."""
    sampled = len(turn_ids)
    if episode.done:  # reset failed: the first turn ends it
        episode.record(sampled, finish_reason, None, 0)
        return None
    if isinstance(episode.env, EpisodeSource):
        return await episode.env.next_ids(task, episode, turn_ids, finish_reason, stop_string)
    if isinstance(episode.env, ChatEnv):
        return await _chat_step(task, episode, episode.env, turn_ids, finish_reason, stop_string)
    # The env judges the turn's answer; only the first turn follows the task's prompt.
    text = task.answer_text(turn_ids, None if episode.turns else episode.prompt)
    try:
        answer = await env_call(off_loop(episode.env.step, text), task.env_timeout_s, "step")
        _check_step(answer, EnvStep, episode.reward)
    except EnvError as exc:
        episode.record(sampled, finish_reason, None, 0)
        episode.end("env_error", str(exc))
        return None
    if answer.done or len(episode.turns) + 1 >= task.max_turns:
        episode.record(sampled, finish_reason, answer, 0)
        episode.end("env" if answer.done else "max_turns")
        return None
    ids = observation_ids(task, answer.observation)
    episode.record(sampled, finish_reason, answer, len(ids))
    return ids


def _check_step(answer: Any, kind: type[EnvStep] | type[ChatStep], total: float) -> None:
    """Read an env's answer to a step: one that is no `kind`, whose reward is no finite number
    (or makes the episode's sum `total` overflow), or that shows nothing next while the
    episode goes on is the env's failure (EnvError). Checked here, where every env reward
    enters an episode, so no sample's reward, nor its group's advantages, is NaN."""
    if not isinstance(answer, kind):
        raise EnvError(f"step: got {type(answer).__name__}, expected {kind.__name__}")
    why = _reward_error(answer.reward, total)
    if why is not None:
        raise EnvError(f"step's reward: {why}, expected a finite number")
    if not answer.done:
        if isinstance(answer, EnvStep):
            _check_shown("step's observation", answer.observation, str)
        else:
            _check_shown("step's messages", answer.messages, list | tuple)


def _reward_error(reward: Any, total: float) -> str | None:
    if not isinstance(reward, numbers.Real):
        return f"got {type(reward).__name__}"
    try:
        value = float(reward)
    except (OverflowError, TypeError, ValueError):
        return f"got {type(reward).__name__}, too large for a float"
    if not math.isfinite(value):
        return f"got {value}"
    if not math.isfinite(total + value):
        return f"got {value}, which makes the episode's sum {total + value}"
    return None


def _check_shown(what: str, value: Any, kind: Any) -> None:
    """What an env gives the model next must be text (`str`) or messages (a list)."""
    if not isinstance(value, kind):
        expected = "a str" if kind is str else "a list of messages"
        raise EnvError(f"{what}: got {type(value).__name__}, expected {expected}")


async def _chat_reset(task: Any, episode: EpisodeState, env: ChatEnv) -> list[int]:
    # A tokenizer without a chat template, or a bad tool schema, stops the run (one line).
    episode.conversation = Conversation(
        task.tokenizer, env.tools, stop_token_ids=task.stop_token_ids,
        template_kwargs=env.template_kwargs,
    )  # fmt: skip
    try:
        messages = await env_call(off_loop(env.reset, episode.prompt), task.env_timeout_s, "reset")
        _check_shown("reset", messages, list | tuple)
        return episode.conversation.start(messages)
    except (EnvError, UserInputError) as exc:  # a failed reset, or messages it got wrong
        episode.end("env_error", str(exc))
        return task.episode_prompt_ids(episode.prompt)


async def _chat_step(
    task: Any,
    episode: EpisodeState,
    env: ChatEnv,
    turn_ids: list[int],
    finish_reason: str,
    stop_string: str | None,
) -> list[int] | None:
    assert episode.conversation is not None, "a chat episode's reset made its conversation"
    sampled, conversation = len(turn_ids), episode.conversation
    reply = conversation.add_reply(turn_ids, finish_reason, stop_string)
    calls = (len(reply.calls), len(reply.tool_errors))
    try:
        served = [await _result(task, env, call) for call in reply.calls]
        results = [message for message, _ in served]
        calls = (calls[0], calls[1] + sum(failed for _, failed in served))
        answer = await env_call(off_loop(env.step, reply, results), task.env_timeout_s, "step")
        _check_step(answer, ChatStep, episode.reward)
    except EnvError as exc:
        episode.record(sampled, finish_reason, None, 0, calls)
        episode.end("env_error", str(exc))
        return None
    if answer.done or len(episode.turns) + 1 >= task.max_turns:
        episode.record(sampled, finish_reason, answer, 0, calls)
        episode.end("env" if answer.done else "max_turns")
        return None
    try:
        ids = conversation.render_delta([*results, *answer.messages])
    except TemplateDrift:
        raise
    except UserInputError as exc:  # the env's messages: its failure, not the run's
        episode.record(sampled, finish_reason, answer, 0, calls)
        episode.end("env_error", f"step answered {exc}")
        return None
    episode.record(sampled, finish_reason, answer, len(ids), calls)
    return ids


async def _result(task: Any, env: ChatEnv, call: ToolCall | ToolCallError) -> tuple[Message, bool]:
    """The tool message answering one attempted call, and whether it reports an error the
    environment raised (`ToolError`: told to the model, counted with the reply's)."""
    if isinstance(call, ToolCallError):
        return tool_message(call, call.message), False  # counted with the reply's already
    content, failed = await env_call(
        _served(env, call), task.env_timeout_s, f"call_tool {call.name}"
    )
    return tool_message(call, content), failed


async def _served(env: ChatEnv, call: ToolCall) -> tuple[str, bool]:
    try:
        result = await env.call_tool(call)
    except ToolError as exc:
        return f"error: {exc}", True
    text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)
    return text, False


def run_episodes(engine: Any, task: Any, prompts: list[Prompt], params: Any) -> dict[str, Any]:
    """Play one episode per prompt on an idle engine; {request id: (EpisodeState, output)}."""
    return asyncio.run(_play(engine, task, prompts, params))


async def _play(engine: Any, task: Any, prompts: list[Prompt], params: Any) -> dict[str, Any]:
    episodes = {f"ep{p.prompt_id}": EpisodeState(p, task.make_env()) for p in prompts}
    firsts = await asyncio.gather(*(reset(task, e) for e in episodes.values()))
    for (rid, _), ids in zip(episodes.items(), firsts, strict=True):
        engine.add_request(rid, ids, params)
    results: dict[str, Any] = {}
    while engine.has_runnable():
        ended = [out for out in engine.step() if out.waits_env]
        nexts = await asyncio.gather(
            *(
                step(task, episodes[o.request_id], o.turn_ids, o.finish_reason, o.stop_string)
                for o in ended
            )
        )
        for out, ids in zip(ended, nexts, strict=True):
            episode = episodes[out.request_id]
            if ids is not None and not _continue(engine, out.request_id, ids):
                episode.end("no_room")
                ids = None
            if ids is None:
                results[out.request_id] = (episode, engine.end_request(out.request_id))
                if isinstance(episode.env, EpisodeSource):
                    episode.env.close()
    return results


def _continue(engine: Any, request_id: str, ids: list[int]) -> bool:
    if isinstance(ids, NewSegment):
        return engine.start_segment(request_id, ids)
    return engine.continue_request(request_id, ids)
