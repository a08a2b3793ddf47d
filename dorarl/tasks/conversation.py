"""A conversation at the message level over the tokens a model samples and is shown.

`Conversation` holds the messages so far, the token ids the model has (its first prompt,
each turn's tokens as sampled, and what it was shown between turns), the model's own chat
template and the declared tools. `start(messages)` renders the first prompt; `add_reply`
takes a sampled turn as the assistant's message (its text, its tool calls parsed, the
answer after its reasoning that a reward reads); `render_delta(messages)` gives the tokens
to append: where the template's rendering of the conversation with the new messages and
the next turn's generation prompt goes on from its rendering without them. The delta is cut on text and tokenized from the last special token
before it, so it is what tokenizing the whole text would give at that boundary. An
assistant message's `tool_calls` (OpenAI's shape) reach the template with their arguments
as objects; a template that does not write calls gets them in the message's text, in the
conversation's call format.

Invariants: `token_ids` only grows, so the tokens turn n+1 conditions on are exactly those
the model sampled and was shown up to turn n. A template whose rendering of earlier turns
changes when messages are added (Qwen3's drops a reply's <think> block once a user writes
again) is refused with one line, `TemplateDrift`, at the first turn it does so; what a
template may do is trim whitespace around a reply or close it with another of the model's
end tokens (Llama 3's does both), and the model keeps its reply as it sampled it. Torch-free.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
from transformers import PreTrainedTokenizerBase

from dorarl.errors import UserInputError
from dorarl.tasks.reasoning import reasoning_of
from dorarl.tasks.tool_calls import (
    CLOSE,
    FORMATS,
    HERMES,
    LLAMA3_JSON,
    OPEN,
    ToolCall,
    ToolCallError,
    Tools,
    default_instructions,
    detect_format,
    parse_tool_calls,
)

Message = dict[str, Any]
ROLES = ("system", "user", "assistant", "tool")
MESSAGE_KEYS = ("role", "content", "name", "tool_call_id", "tool_calls")
CONTEXT_TOKENS = 4  # tokens decoded before a reply's, so its first token reads right
_QUOTE = 40  # characters of each side a drift's line quotes


class TemplateDrift(UserInputError):
    """The chat template renders again, otherwise, what the model was already shown."""


@dataclass(frozen=True)
class Reply:
    """One sampled turn as the assistant's message."""

    text: str  # decoded as sampled, special tokens kept, without the stop token it ended on
    finish_reason: str  # "stop" (a stop token) | "stop_string" | "length"
    stop_string: str | None = None  # the stop string that ended it
    end_text: str = ""  # the text of the stop token it ended on ("" for none)
    calls: tuple[ToolCall | ToolCallError, ...] = ()  # attempted calls, in order
    # What a reward reads: the text after its reasoning (dorarl.tasks.reasoning); None
    # when it ends inside a block.
    answer: str | None = None

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [c for c in self.calls if isinstance(c, ToolCall)]

    @property
    def tool_errors(self) -> list[ToolCallError]:
        return [c for c in self.calls if isinstance(c, ToolCallError)]

    def message(self) -> Message:
        """The reply as the template renders it: its text as written, calls included."""
        return {"role": "assistant", "content": self.text}


def tool_message(call: ToolCall | ToolCallError, content: str) -> Message:
    """The `tool` message that answers `call`."""
    return {"role": "tool", "content": content, "tool_call_id": call.id, "name": call.name or ""}


class Conversation:
    """One conversation of one model; see the module docstring."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        tools: Sequence[dict[str, Any]] | None = None,
        *,
        stop_token_ids: Sequence[int] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        tool_format: str = "auto",
        first_call_id: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.tools = Tools.of(tools)
        self.template_kwargs = dict(template_kwargs or {})
        self.template = _template_of(tokenizer)
        self.name = template_name(tokenizer, self.template)
        self.reasoning = reasoning_of(tokenizer)
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.stop_token_ids = list(stop_token_ids) if stop_token_ids is not None else eos
        self.messages: list[Message] = []
        self.token_ids: list[int] = []
        self.turns = 0
        self.rewritten_replies = 0  # replies the template trimmed or closed otherwise
        self.boundary_merges = 0  # deltas whose first token would merge with the text before
        self._rendered = ""  # the template's text of `messages`, with the generation prompt
        self._shown = ""  # the text of `token_ids`: rendered, sampled, rendered
        self._reply: Reply | None = None
        self._calls = first_call_id  # the next call's id number: `call_{n}`
        self._writes_calls: bool | None = None  # the template writes `tool_calls`; probed once
        self.format, self._template_tools, self._instructions = self._tool_setup(tool_format)

    @property
    def next_call_id(self) -> int:
        """The number of the next call's id; a conversation that goes on from this one (a
        new segment of an episode) starts there, so ids stay unique across them."""
        return self._calls

    # --- the three steps ---------------------------------------------------------------
    def start(self, messages: Sequence[Message]) -> list[int]:
        """The first prompt's token ids: `messages` rendered with the generation prompt."""
        if self.messages:
            raise ValueError("a conversation starts once")
        checked = [_checked(m, f"messages[{i}]") for i, m in enumerate(messages)]
        if not checked:
            raise UserInputError("messages: a conversation starts with at least one message")
        if self._instructions:
            checked = _with_system(checked, self._instructions)
        text = self._render(checked)
        self.messages, self._rendered, self._shown = checked, text, text
        self.token_ids = self._encode(text)
        return list(self.token_ids)

    def add_reply(
        self, turn_ids: Sequence[int], finish_reason: str, stop_string: str | None = None
    ) -> Reply:
        """Take the model's sampled turn (its tokens as the engine gave them and how the turn
        ended) as the assistant's reply; its tokens join `token_ids` unchanged."""
        if not self.messages or self._reply is not None:
            raise ValueError("add_reply follows start or render_delta")
        ids = list(turn_ids)
        ended = finish_reason == "stop" and bool(ids) and ids[-1] in self.stop_token_ids
        body = ids[:-1] if ended else ids
        text = self._decode_after(self.token_ids, body)
        end_text = self._decode_after(self.token_ids + body, ids[-1:]) if ended else ""
        calls: tuple[ToolCall | ToolCallError, ...] = ()
        if self.tools:
            calls = tuple(
                parse_tool_calls(text, self.format, self.tools, finish_reason, self._calls)
            )
        self._calls += len(calls)
        answer = self.reasoning.answer(text, self.reasoning.leaves_open(self._shown))
        self._reply = Reply(text, finish_reason, stop_string, end_text, calls, answer)
        self.token_ids += ids
        self._shown += text + end_text
        self.turns += 1
        return self._reply

    def render_delta(self, new_messages: Sequence[Message]) -> list[int]:
        """The token ids to append after the reply: the template's closing of it, then
        `new_messages` and the generation prompt of the next turn."""
        reply = self._reply
        if reply is None:
            raise ValueError("render_delta follows add_reply")
        new = [_checked(m, f"messages[{i}]") for i, m in enumerate(new_messages)]
        messages = [*self.messages, reply.message(), *new]
        full = self._render(messages)
        if not full.startswith(self._rendered):
            raise self._history_drift(full, new)
        after = self._after_reply(full[len(self._rendered) :], reply)
        ids = self._encode_after(self._shown, after)
        self.messages, self._rendered, self._reply = messages, full, None
        self._shown += after
        self.token_ids += ids
        return ids

    # --- rendering ---------------------------------------------------------------------
    def _render(self, messages: list[Message]) -> str:
        if any("tool_calls" in m for m in messages) and not self._renders_calls():
            messages = [_calls_in_content(m, self.format) for m in messages]
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=self._template_tools,
                add_generation_prompt=True,
                tokenize=False,
                **self.template_kwargs,
            )
        except jinja2.TemplateError as exc:
            raise UserInputError(f"chat template {self.name}: {exc}") from None

    def _tool_setup(self, asked: str) -> tuple[str, list[dict] | None, str | None]:
        """(call format, tools for the template, dorarl's instructions): a template that
        renders tools gets them and is read in its own format; one that ignores them gets
        hermes instructions in a system message."""
        if asked != "auto" and asked not in FORMATS:
            raise UserInputError(f"tool_format: expected auto or one of {FORMATS}, got {asked!r}")
        if not self.tools:
            return (
                (detect_format(self.template) or HERMES) if asked == "auto" else asked,
                None,
                None,
            )
        if not self._renders_tools():
            return HERMES if asked == "auto" else asked, None, default_instructions(self.tools)
        found = detect_format(self.template) if asked == "auto" else asked
        if found is None:
            raise UserInputError(
                f"chat template {self.name}: it writes tool calls in a format dorarl does not "
                f"read (it reads {', '.join(FORMATS)}): pass tool_format"
            )
        return found, self.tools.schemas, None

    def _renders_calls(self) -> bool:
        """Whether the template writes an assistant message's `tool_calls` (ChatML's
        ignores them, and a call in the history would vanish)."""
        if self._writes_calls is None:
            call = {"type": "function", "function": {"name": "dorarl_probe", "arguments": {}}}
            probe = [
                {"role": "user", "content": "-"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
            ]
            try:
                text = self.tokenizer.apply_chat_template(
                    probe, tools=self._template_tools, tokenize=False, **self.template_kwargs
                )
            except jinja2.TemplateError:  # the rendering itself then says what is wrong
                return True
            self._writes_calls = "dorarl_probe" in text
        return self._writes_calls

    def _renders_tools(self) -> bool:
        probe = [{"role": "user", "content": "-"}]
        plain = self.tokenizer.apply_chat_template(probe, tokenize=False, **self.template_kwargs)
        offered = self.tokenizer.apply_chat_template(
            probe, tools=self.tools.schemas, tokenize=False, **self.template_kwargs
        )
        return plain != offered

    # --- text and tokens ---------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def _decode_after(self, before: list[int], ids: list[int]) -> str:
        """The text `ids` add after `before` (a few of its tokens read as context)."""
        context = before[-CONTEXT_TOKENS:]
        return self._decode(context + ids)[len(self._decode(context)) :]

    def _encode_after(self, shown: str, text: str) -> list[int]:
        """`text`'s tokens as tokenizing `shown + text` whole gives them: tokenized from the
        last special token before it, which no merge crosses. Where a merge would cross the
        boundary (a reply cut mid-word before plain text) the sampled tokens stay and
        `text` is tokenized alone, counted in `boundary_merges`."""
        anchor = shown[self._last_added(shown) :]
        head = self._encode(anchor)
        whole = self._encode(anchor + text)
        if whole[: len(head)] == head:
            return whole[len(head) :]
        self.boundary_merges += 1
        return self._encode(text)

    def _last_added(self, text: str) -> int:
        """Where the last added (special) token in `text` starts; 0 when none."""
        added = [t.content for t in self.tokenizer.added_tokens_decoder.values() if t.content]
        return max([text.rfind(a) for a in added] + [0])

    # --- the reply in the template's rendering -----------------------------------------
    def _after_reply(self, region: str, reply: Reply) -> str:
        """What the template writes after the reply in `region` (its rendering from the
        reply on): the reply as sampled, else trimmed, then its end token or another of
        the model's; anything else is a drift."""
        ends = [reply.end_text] if reply.end_text else [""]
        if reply.end_text:
            ends += [t for t in self._stop_texts() if t and t != reply.end_text]
        for i, content in enumerate(dict.fromkeys(_spellings(reply.text))):
            for j, end in enumerate(ends):
                if region.startswith(content + end):
                    self.rewritten_replies += (i, j) != (0, 0)
                    return region[len(content) + len(end) :]
        raise self._reply_drift(region, reply)

    def _stop_texts(self) -> list[str]:
        return [self._decode([t]) for t in self.stop_token_ids]

    # --- refusals ------------------------------------------------------------------------
    def _history_drift(self, full: str, new: list[Message]) -> TemplateDrift:
        at = _common_prefix(self._rendered, full)
        roles = ", ".join(m["role"] for m in new) or "no"
        return TemplateDrift(
            f"chat template {self.name}: the reply of turn {self.turns} and the {roles} "
            f"message(s) after it change text it rendered before, at character {at}: it "
            f"wrote {_quote(self._rendered, at)}, now {_quote(full, at)}; dorarl only appends "
            f"to what the model was shown{self._hint()}"
        )

    def _reply_drift(self, region: str, reply: Reply) -> TemplateDrift:
        sampled = reply.text + reply.end_text
        at = _common_prefix(sampled, region)
        return TemplateDrift(
            f"chat template {self.name}: it writes the reply of turn {self.turns} otherwise than "
            f"the model sampled it, at character {at} of the reply: the model wrote "
            f"{_quote(sampled, at)}, the template {_quote(region, at)}{self._hint()}"
        )

    def _hint(self) -> str:
        if "</think>" not in self.template:
            return ""
        return (
            " (this template drops a reply's <think> block once a user message follows it, "
            "as Qwen3's does: keep the messages after the first user message to tool "
            "results, or give the model folder a chat_template.jinja that renders every "
            "reply as written)"
        )


def template_name(tokenizer: PreTrainedTokenizerBase, template: str) -> str:
    """The template as a line names it: its tokenizer's folder and a hash of its text."""
    digest = hashlib.sha1(template.encode()).hexdigest()[:8]
    return f"{getattr(tokenizer, 'name_or_path', '') or 'in memory'} ({digest})"


def _template_of(tokenizer: PreTrainedTokenizerBase) -> str:
    try:
        return tokenizer.get_chat_template()
    except ValueError:
        name = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
        raise UserInputError(f"{name}: has no chat template (chat_template.jinja)") from None


def _checked(message: Any, where: str) -> Message:
    if not isinstance(message, dict):
        raise UserInputError(f"{where}: expected {{'role': ..., 'content': ...}}")
    role, content = message.get("role"), message.get("content")
    if content is None and message.get("tool_calls"):  # OpenAI's call without text
        message, content = {**message, "content": ""}, ""
    if role not in ROLES:
        raise UserInputError(f"{where}.role: expected one of {ROLES}, got {role!r}")
    if not isinstance(content, str):
        raise UserInputError(f"{where}.content: expected a string, got {type(content).__name__}")
    out = {k: message[k] for k in MESSAGE_KEYS if k in message}
    calls = out.pop("tool_calls", None)
    if calls:
        if role != "assistant":
            raise UserInputError(f"{where}.tool_calls: only an assistant message makes calls")
        if not isinstance(calls, list):
            raise UserInputError(f"{where}.tool_calls: expected a list of calls")
        out["tool_calls"] = [_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(calls)]
    return out


def _call(call: Any, where: str) -> dict[str, Any]:
    """An OpenAI `tool_calls` entry as chat templates take it: its arguments an object, not
    the JSON string OpenAI's API carries."""
    function = call.get("function") if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise UserInputError(
            f"{where}: expected {{'type': 'function', 'function': {{'name': ..., 'arguments': ...}}}}"
        )
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    if not isinstance(arguments, dict):
        raise UserInputError(f"{where}.function.arguments: expected a JSON object")
    out = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return {"id": call["id"], **out} if "id" in call else out


def _calls_in_content(message: Message, fmt: str) -> Message:
    """`message` with its calls written into its text as the model writes them in `fmt`,
    for a template that ignores `tool_calls`."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    key = "parameters" if fmt == LLAMA3_JSON else "arguments"
    written = [
        json.dumps(
            {"name": c["function"]["name"], key: c["function"]["arguments"]}, ensure_ascii=False
        )
        for c in calls
    ]
    if fmt != LLAMA3_JSON:
        written = [f"{OPEN}\n{w}\n{CLOSE}" for w in written]
    text = "\n".join([message["content"], *written] if message["content"] else written)
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": text}


def _with_system(messages: list[Message], instructions: str) -> list[Message]:
    """dorarl's tool instructions after the system message, or as one."""
    if messages[0]["role"] == "system":
        first = {**messages[0], "content": messages[0]["content"] + "\n\n" + instructions}
        return [first, *messages[1:]]
    return [{"role": "system", "content": instructions}, *messages]


def _spellings(text: str) -> list[str]:
    """A reply as sampled, then as a template may trim it."""
    return [text, text.strip(), text.lstrip(), text.rstrip()]


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _quote(text: str, at: int) -> str:
    return repr(text[at : at + _QUOTE]) if at < len(text) else "(nothing more)"
