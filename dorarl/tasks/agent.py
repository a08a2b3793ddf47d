"""`task.agent=module:function`: a user's agent loop plays each episode through an OpenAI client.

The function is `async def agent(client: openai.AsyncOpenAI, prompt: Prompt) -> float`: it
makes any number of `client.chat.completions.create` calls (with tools, if it likes) and
returns the episode's reward. Its client's base URL names the episode
(`http://127.0.0.1:PORT/episodes/<id>/v1`, dorarl.tasks.openai_endpoint), and the episode
is one engine request, every call sampled by the policy version the request is pinned to.
A call whose messages extend those of its previous call and the reply it got prefills
only their chat-template delta (`Conversation.render_delta`) on the KV the request kept; a
call that does not (the agent rewrote its history, started a sub-conversation, changed its
tools) opens a new segment: a fresh conversation whose prompt is computed anew
(`NewSegment`), which later calls extend in turn.

Bounds, as for an `Env`: the agent has `task.env_timeout_s` from a reply (or its start) to
its next served call or its return (refused calls count within it); its episode has
`task.max_turns` calls, `task.max_segments` segments and the engine's context; a call
beyond any is answered with an error (HTTP 400; `context_length_exceeded` for the context),
and the agent's return still gives the reward. A malformed call (dorarl.tasks.agent_calls)
is answered 400, a second call while one is unanswered 409. An agent that raises, returns
a non-number, or overruns its timeout ends its episode with reward 0 and one line, as does
one cancelled because the runtime ended its episode or started it again. The sampling
settings are the run's; a call's `temperature`, `max_tokens` and the like are ignored.
Invariant: the tokens an episode trains on are those its turns sampled and were shown.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import math
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from dorarl.data import NewSegment
from dorarl.errors import UserInputError
from dorarl.tasks.agent_calls import CallBody, read_call
from dorarl.tasks.base import Prompt, Task
from dorarl.tasks.conversation import Conversation, Reply, TemplateDrift
from dorarl.tasks.env import EnvStep, import_user_module
from dorarl.tasks.episodes import EpisodeSource, EpisodeState
from dorarl.tasks.openai_endpoint import (
    CALL_TIMEOUT_S,
    CallError,
    Endpoint,
    close_endpoint,
    endpoint_for,
)
from dorarl.tasks.tool_calls import HERMES, ToolCall

AgentFunction = Callable[[Any, Prompt], Awaitable[float]]
DEFAULT_MAX_SEGMENTS = 8  # task.max_segments
_CALL_BLOCK = re.compile(r"<tool_call>.*?</tool_call>", re.S)


def load_agent(spec: str, key: str = "task.agent") -> AgentFunction:
    """`package.module:function` -> the coroutine function, checked; one line otherwise."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise UserInputError(f"{key}: expected 'module:function', got {spec!r}")
    module = import_user_module(module_name, key)  # the working directory's, as task.env's
    function = getattr(module, name, None)
    if not inspect.iscoroutinefunction(function):
        raise UserInputError(
            f"{key}: {spec!r} is not an async function (async def agent(client, prompt))"
        )
    return function


class AgentTask(Task):
    """A task's prompts played as episodes of a user's agent; its reward the agent's."""

    multi_turn = True

    def __init__(
        self,
        base: Task,
        agent: str,
        max_turns: int,
        timeout_s: float,
        host: str = "127.0.0.1",
        max_segments: int = DEFAULT_MAX_SEGMENTS,
    ) -> None:
        self.base, self.agent_spec, self.host = base, agent, host
        self.name = f"{base.name}+agent"
        self.tokenizer = base.tokenizer
        self.stop_token_ids = base.stop_token_ids
        self.stop_strings: list[str] = []
        self.max_new_tokens = base.max_new_tokens
        self.max_turns, self.env_timeout_s = max_turns, timeout_s
        self.max_segments = max_segments
        self._agent: AgentFunction | None = None

    @property
    def agent(self) -> AgentFunction:
        if self._agent is None:  # imported where episodes run (the driver, the evaluator)
            self._agent = load_agent(self.agent_spec)
        return self._agent

    def endpoint(self) -> Endpoint:
        return endpoint_for(self.host)

    def close(self) -> None:
        """The run is over: the endpoint stops serving in this process."""
        close_endpoint(self.host)

    def train_prompts(self) -> list[Prompt]:
        return self.base.train_prompts()

    def eval_prompts(self) -> list[Prompt]:
        return self.base.eval_prompts()

    def reward(self, prompt: Prompt, response_ids: list[int]) -> float:
        return self.base.reward(prompt, response_ids)  # unused: episodes take the agent's

    def make_env(self) -> AgentEpisode:
        return AgentEpisode(self)

    def episode_prompt_ids(self, prompt: Prompt) -> list[int]:
        return list(prompt.prompt_ids)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_agent": None}  # functions of test modules do not pickle

    def __getattr__(self, name: str) -> Any:
        base = self.__dict__.get("base")  # absent while unpickling (Ray's workers)
        if base is None:
            raise AttributeError(name)
        return getattr(base, name)


class AgentError(Exception):
    """The agent failed its episode; the message is one line."""


class AgentEpisode(EpisodeSource):
    """One episode of the agent: its conversation, its calls, its agent's task. Everything
    but `first_ids`, `next_ids` and `close` runs on the endpoint's loop."""

    def __init__(self, task: AgentTask) -> None:
        self.task, self.id = task, uuid.uuid4().hex[:16]
        self.endpoint = task.endpoint()
        self.model = Path(getattr(task.tokenizer, "name_or_path", "") or "dorarl").name
        self.conversation: Conversation | None = None
        self.refused = 0  # calls answered with an error (bad messages, past a bound, ..)
        self.segments = 0  # conversations opened: the first call's, then each non-extension
        self._calls: asyncio.Queue | None = None
        self._agent: asyncio.Task | None = None
        self._pending: _Call | None = None  # the call whose turn the engine samples
        self._seen: list[tuple] = []  # the conversation's messages as compared
        self._latest: _Call | None = None  # the last call received, for a retry of it
        self.overflows = 0  # calls refused: their prompt leaves no room in the context
        self._tools: Any = None
        self._over = False  # max_turns reached: calls are refused, the return awaited
        self._reward = 0.0  # what the agent returned
        self._call_names: dict[str, str] = {}  # tool call id -> its tool, for tool messages
        self._closed = ""  # why the episode ended, once it has

    # --- the runtime's side (any loop) ---------------------------------------------------
    async def first_ids(self, task: Any, episode: EpisodeState) -> list[int]:
        return await self._on_endpoint(self._start(episode))

    async def next_ids(
        self,
        task: Any,
        episode: EpisodeState,
        turn_ids: list[int],
        finish_reason: str,
        stop_string: str | None,
    ) -> list[int] | None:
        return await self._on_endpoint(self._turn(episode, turn_ids, finish_reason, stop_string))

    def close(self) -> None:
        """The runtime ended the episode (or starts it again): its agent is cancelled, and
        a call of it still out ends it as a failed one (reward 0)."""
        self.endpoint.loop.call_soon_threadsafe(self._close, "the episode ended")

    def counts(self) -> dict[str, int]:
        return {"agent_refused_calls": self.refused, "context_overflows": self.overflows}

    async def _on_endpoint(self, coro: Awaitable[Any]) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self.endpoint.loop)  # type: ignore[arg-type]
        return await asyncio.wrap_future(future)

    # --- the endpoint's loop ---------------------------------------------------------------
    async def receive(self, body: dict[str, Any]) -> dict[str, Any]:
        """The call's answer. A malformed call is answered at once, not after the turn; a
        retry of a call whose reply its client never got (it is unanswered, or its client
        left) gets that reply; another call while one is unanswered is refused (409)."""
        if self._calls is None:
            raise CallError(409, f"episode {self.id} has not started", "not_started")
        try:
            read = read_call(body)
            seen = [_compared(m) for m in read.messages]
        except CallError as exc:
            raise self._refuse(exc.status, exc.message, exc.code, exc.param) from None
        except Exception as exc:  # a shape the checks missed: the call's error, not the run's
            raise self._unserved(exc) from None
        twin = self._latest
        if twin is not None and twin.same(seen, read.tools) and twin.undelivered:
            return await twin.wait()
        if twin is not None and twin.waiting and not twin.answer.done():
            raise self._refuse(409, f"episode {self.id}: a call of it is unanswered; make one call at a time", "concurrent_call")  # fmt: skip
        call = _Call(body, read, seen, asyncio.get_running_loop().create_future())
        self._latest = call
        self._calls.put_nowait(call)
        return await call.wait()

    async def _start(self, episode: EpisodeState) -> list[int]:
        self._calls = asyncio.Queue()
        self.endpoint.register(self.id, self)
        client = _client(self.endpoint, self.endpoint.base_url(self.id))
        self._agent = asyncio.ensure_future(self.task.agent(client, episode.prompt))
        try:
            ids = await self._next_prompt()
        except AgentError as exc:
            ids = None
            episode.end("env_error", str(exc))
        if ids is None:
            if not episode.done:
                episode.end("env_error", "the agent returned before its first call")
            self._close("the episode ended")
            return self.task.episode_prompt_ids(episode.prompt)
        return ids

    async def _turn(
        self, episode: EpisodeState, turn_ids: list[int], finish_reason: str, stop: str | None
    ) -> list[int] | None:
        assert self.conversation is not None and self._pending is not None
        reply = self.conversation.add_reply(turn_ids, finish_reason, stop)
        calls = (len(reply.calls), len(reply.tool_errors))
        self._answer(reply, len(turn_ids))
        self._over = len(episode.turns) + 1 >= self.task.max_turns
        try:
            ids = await self._next_prompt()
        except AgentError as exc:
            episode.record(len(turn_ids), finish_reason, None, 0, calls)
            episode.end("env_error", str(exc))
            self._close("the episode ended")
            return None
        if ids is None:
            episode.record(len(turn_ids), finish_reason, EnvStep("", self._reward, True), 0, calls)
            episode.end("max_turns" if self._over else "env")
            self._close("the episode ended")
            return None
        episode.record(len(turn_ids), finish_reason, None, len(ids), calls)
        return ids

    async def _next_prompt(self) -> list[int] | None:
        """The next accepted call's prompt ids (it is pending then), or None: the agent
        returned its reward (`_reward`). Refused calls are answered and waited past, all
        within the one `env_timeout_s`: an agent that only re-asks still times out."""
        deadline = asyncio.get_running_loop().time() + self.task.env_timeout_s
        while True:
            call = await self._next_event(deadline)
            if call is None:
                self._reward = self._result()
                return None
            try:
                ids = self._accept(call)
            except CallError as exc:
                call.fail(exc)
                continue
            except TemplateDrift as exc:  # the model's template: the run's failure
                call.fail(CallError(500, str(exc), "template_drift"))
                raise
            except Exception as exc:  # nothing committed yet: the call's error alone
                call.fail(self._unserved(exc))
                continue
            self._pending = call
            return ids

    async def _next_event(self, deadline: float) -> _Call | None:
        """The agent's next call, or None when it returned; AgentError when it overran."""
        assert self._calls is not None and self._agent is not None
        getter = asyncio.ensure_future(self._calls.get())
        left = max(0.0, deadline - asyncio.get_running_loop().time())
        done, _ = await asyncio.wait(
            {getter, self._agent}, timeout=left, return_when=asyncio.FIRST_COMPLETED
        )
        if getter in done:
            return getter.result()
        getter.cancel()
        if self._agent in done:
            return None
        timeout = self.task.env_timeout_s
        raise AgentError(f"the agent timed out after {timeout:g} s (no call, no return)")

    def _result(self) -> float:
        assert self._agent is not None
        if self._agent.cancelled():  # its episode ended or started again meanwhile
            raise AgentError(f"the agent was cancelled: {self._closed or 'it cancelled itself'}")
        exc = self._agent.exception()
        if exc is not None:
            line = str(exc).splitlines()[0] if str(exc) else ""
            raise AgentError(f"the agent raised {type(exc).__name__}: {line}")
        value = self._agent.result()
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise AgentError(f"the agent returned {value!r}, not a finite number")
        return float(value)

    # --- calls -----------------------------------------------------------------------------
    def _accept(self, call: _Call) -> list[int]:
        """The prompt ids a call adds; the episode's state changes only once they fit."""
        messages, tools, seen = call.read.messages, call.read.tools, call.seen
        if self._over:
            raise self._refuse(400, f"the episode has had task.max_turns={self.task.max_turns} calls", "max_turns")  # fmt: skip
        if self.conversation is None:
            return self._first(call, messages, tools, seen)
        if tools != self._tools or seen[: len(self._seen)] != self._seen:
            return self._new_segment(call, messages, tools, seen)
        new = [self._for_template(m) for m in messages[len(self._seen) :]]
        if not new:
            raise self._refuse(400, "no new messages after the last reply", "no_new_messages")
        extended = copy.copy(self.conversation)  # kept only if its prompt fits
        extended.token_ids = list(extended.token_ids)
        try:
            ids = extended.render_delta(new)
        except TemplateDrift:
            raise
        except UserInputError as exc:
            raise self._refuse(400, str(exc), "bad_messages") from None
        self._check_room(len(extended.token_ids))
        self.conversation, self._seen = extended, seen
        return ids

    def _new_segment(
        self, call: _Call, messages: list, tools: Any, seen: list[tuple]
    ) -> NewSegment:
        """A call that does not extend the conversation: its messages start a new one, a
        segment of the same episode (counted, never logged: agents do this every episode)."""
        bound = self.task.max_segments
        if self.segments >= bound:
            raise self._refuse(400, f"the episode has opened task.max_segments={bound} conversations; a call whose messages do not extend its last one (its messages, then the reply it got) would open another: extend it, or return the reward", "max_segments")  # fmt: skip
        return NewSegment(self._first(call, messages, tools, seen))

    def _first(self, call: _Call, messages: list, tools: Any, seen: list[tuple]) -> list[int]:
        first_id = self.conversation.next_call_id if self.conversation is not None else 0
        try:
            conversation = Conversation(
                self.task.tokenizer, tools, stop_token_ids=self.task.stop_token_ids,
                template_kwargs=call.read.template_kwargs,
                first_call_id=first_id,  # ids unique in the episode, across its segments
            )  # fmt: skip
            ids = conversation.start([self._for_template(m) for m in messages])
        except UserInputError as exc:
            raise self._refuse(400, str(exc), "bad_messages") from None
        self._check_room(len(ids))
        self.conversation, self._tools, self._seen = conversation, tools, seen
        self.segments += 1
        return ids

    def _check_room(self, context: int) -> None:
        """Refuse a prompt that leaves no room for a sampled token in the engine's context
        (`engine.max_model_len`): the agent may shorten its history or return its reward."""
        limit = getattr(self.task, "max_model_len", None)
        if limit is None or context + 1 <= limit:
            return
        self.overflows += 1
        raise self._refuse(400, f"messages: the conversation would take {context} tokens, leaving no room for a reply in the model's context of {limit} (engine.max_model_len): shorten it, or return the reward", "context_length_exceeded", "messages")  # fmt: skip

    def _refuse(self, status: int, message: str, code: str, param: str | None = None) -> CallError:
        self.refused += 1
        return CallError(status, message, code, param)

    def _unserved(self, exc: Exception) -> CallError:
        line = str(exc).splitlines()[0] if str(exc) else ""
        return self._refuse(400, f"the call could not be served: {type(exc).__name__}: {line}", "bad_request")  # fmt: skip

    def _for_template(self, message: dict[str, Any]) -> dict[str, Any]:
        """A message as the chat template takes it: text content, its calls (the
        conversation reads OpenAI's shape), a tool result named."""
        keys = ("role", "name", "tool_call_id", "tool_calls")
        out = {k: message[k] for k in keys if k in message}
        out["content"] = _text(message.get("content"))
        if out.get("role") == "tool" and "name" not in out:
            out["name"] = self._call_names.get(out.get("tool_call_id"), "")
        return out

    def _answer(self, reply: Reply, sampled: int) -> None:
        """Answer the pending call with the sampled reply as a chat completion."""
        assert self._pending is not None and self.conversation is not None
        message = _assistant(reply, self.conversation.format)
        body = _completion(self.id, self.conversation, reply, message, sampled, self.model)
        self._call_names.update({c.id: c.name for c in reply.tool_calls})
        self._seen = [*self._seen, _compared(message)]
        self._pending.resolve(body)
        self._pending = None

    def _close(self, why: str) -> None:
        self._closed = self._closed or why
        self.endpoint.unregister(self.id)
        error = CallError(404, f"episode {self.id}: {why}", "episode_ended")
        if self._pending is not None:
            self._pending.fail(error)
            self._pending = None
        while self._calls is not None and not self._calls.empty():
            self._calls.get_nowait().fail(error)
        if self._agent is not None and not self._agent.done():
            self._agent.cancel()


class _Call:
    """One HTTP call of an episode and the future its handlers wait on (a retry's too)."""

    def __init__(
        self, body: dict[str, Any], read: CallBody, seen: list[tuple], answer: asyncio.Future
    ) -> None:
        self.body, self.read, self.seen, self.answer = body, read, seen, answer
        self.waiting = 0  # handlers waiting for the answer; a client that leaves cancels its
        self.delivered = False  # a handler got the answer to send

    def same(self, seen: list[tuple], tools: Any) -> bool:
        return seen == self.seen and tools == self.read.tools

    @property
    def undelivered(self) -> bool:
        """Unanswered, or answered after every client of it left: a retry is this call."""
        return not self.answer.done() or (self.waiting == 0 and not self.delivered)

    async def wait(self) -> dict[str, Any]:
        self.waiting += 1
        try:
            await asyncio.wait({self.answer})  # cancelled with its handler, not the answer
        finally:
            self.waiting -= 1
        self.delivered = True
        return self.answer.result()

    def resolve(self, body: dict[str, Any]) -> None:
        if not self.answer.done():  # done: failed already (its episode ended)
            self.answer.set_result(body)

    def fail(self, error: CallError) -> None:
        if not self.answer.done():
            self.answer.set_exception(error)


def _client(endpoint: Endpoint, base_url: str) -> Any:
    """An episode's client. Its HTTP connections are the endpoint's, shared by every
    episode: a client of its own costs ~100 ms (an SSL context), so hundreds at once would
    eat the agents' time."""
    import openai  # the agent's side: imported where episodes run

    if endpoint.http_client is None:
        endpoint.http_client = openai.DefaultAsyncHttpxClient(timeout=CALL_TIMEOUT_S)
    # No retries: a retried call is answered with its reply, but a retry hides the error.
    return openai.AsyncOpenAI(
        base_url=base_url, api_key=endpoint.api_key, max_retries=0, timeout=CALL_TIMEOUT_S,
        http_client=endpoint.http_client,
    )  # fmt: skip


def _text(content: Any) -> str:
    """A message's content as text (OpenAI's list of text parts joined; None: empty)."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else json.dumps(content)


def _compared(message: dict[str, Any]) -> tuple:
    """What of a message an extension must repeat: role, text, its call id and calls."""
    calls = tuple(
        (c.get("id"), (c.get("function") or {}).get("name"), _arguments(c))
        for c in message.get("tool_calls") or []
        if isinstance(c, dict)
    )
    role, call_id = message.get("role"), message.get("tool_call_id")
    return (role, _text(message.get("content")), call_id, calls)


def _arguments(call: dict[str, Any]) -> str:
    raw = (call.get("function") or {}).get("arguments", "")
    try:
        return json.dumps(json.loads(raw), sort_keys=True)
    except (TypeError, json.JSONDecodeError):
        return str(raw)


def _assistant(reply: Reply, fmt: str) -> dict[str, Any]:
    """The reply as OpenAI's assistant message: its well-formed calls in `tool_calls`, the
    text around them in `content` (a malformed call stays in the text)."""
    calls: list[ToolCall] = reply.tool_calls
    if not calls:
        return {"role": "assistant", "content": reply.text}
    content = _without_calls(reply) if fmt == HERMES else ""
    return {
        "role": "assistant",
        "content": content.strip() or None,
        "tool_calls": [c.openai() for c in calls],
    }


def _without_calls(reply: Reply) -> str:
    """A hermes reply's text without its well-formed call blocks: the i-th closed block is
    the reply's i-th attempted call (both read `<tool_call>` to the next `</tool_call>`)."""
    well_formed = iter([isinstance(c, ToolCall) for c in reply.calls])
    return _CALL_BLOCK.sub(lambda block: "" if next(well_formed, False) else block[0], reply.text)


def _completion(
    episode_id: str,
    conversation: Conversation,
    reply: Reply,
    message: dict[str, Any],
    sampled: int,
    model: str,
) -> dict[str, Any]:
    reason = "tool_calls" if reply.tool_calls else "length" if reply.finish_reason == "length" else "stop"  # fmt: skip
    prompt_tokens = len(conversation.token_ids) - sampled
    return {
        "id": f"chatcmpl-{episode_id}-{conversation.turns}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": reason, "logprobs": None}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": sampled,
            "total_tokens": prompt_tokens + sampled,
        },
    }
