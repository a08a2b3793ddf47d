"""Tool calls in a model's own format: declared tools, the calls read from a reply's text.

Two formats: `hermes`, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` anywhere
in a reply (Qwen2.5's and Qwen3's templates teach it; dorarl's default for a template that
has no tools of its own), and `llama3_json`, a reply that is one JSON object `{"name": ...,
"parameters": {...}}` (Llama 3.1 and later). `parse_tool_calls` returns a reply's attempts
in order, each a `ToolCall` (well-formed, of a declared tool) or a `ToolCallError` saying
what is wrong in one line (one nested deeper than `MAX_DEPTH` is refused unread); it never
raises, on any text, so a model's malformed call costs its episode nothing but the error
it is shown. Tools are JSON schemas in the OpenAI form `{"type": "function", "function":
{"name", "description", "parameters"}}` (a bare `{"name", ...}` is wrapped), what chat
templates take as `tools`. Torch-free.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dorarl.errors import UserInputError

HERMES, LLAMA3_JSON = "hermes", "llama3_json"
FORMATS = (HERMES, LLAMA3_JSON)
OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # what Llama 3.1 may write before a call
# The stop strings that end a turn right after a call, so the tool runs before more is sampled.
CALL_STOP_STRINGS = {HERMES: (CLOSE,), LLAMA3_JSON: ()}
# A call nested deeper is refused unread: JSON's decoder recurses per level, and a degenerate
# policy can sample thousands of `[`; no tool's arguments need more.
MAX_DEPTH = 64
# A bracket, or a JSON string (skipped whole; an unfinished one runs to the end of the text).
_NESTING = re.compile(r'[\[{]|[\]}]|"(?:[^"\\]|\\.)*"?', re.S)


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call of a declared tool; `id` is unique within its conversation."""

    id: str
    name: str
    arguments: dict[str, Any]
    text: str  # the call as the model wrote it

    def openai(self) -> dict[str, Any]:
        """The call as an OpenAI chat message's `tool_calls` entry."""
        arguments = json.dumps(self.arguments, ensure_ascii=False)
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": arguments},
        }


@dataclass(frozen=True)
class ToolCallError:
    """An attempted call that cannot run: it does not parse, names no declared tool, or was
    cut by the length cap. `message` is what the model is told in the call's tool message."""

    id: str
    message: str
    text: str
    name: str | None = None  # the tool it named, when it named one


@dataclass(frozen=True)
class Tools:
    """Declared tools: their schemas as a chat template takes them, and their names."""

    schemas: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def of(cls, declared: Sequence[dict[str, Any]] | None, key: str = "tools") -> Tools:
        """Checked schemas; a bad one is one line naming `key[i]`."""
        return cls([_schema(tool, f"{key}[{i}]") for i, tool in enumerate(declared or [])])

    @property
    def names(self) -> list[str]:
        return [tool["function"]["name"] for tool in self.schemas]

    def __bool__(self) -> bool:
        return bool(self.schemas)


def _schema(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise UserInputError(f"{where}: expected a JSON schema object, got {type(tool).__name__}")
    function = tool.get("function", tool) if tool.get("type", "function") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise UserInputError(
            f"{where}: expected {{'type': 'function', 'function': {{'name': ...}}}}"
        )
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise UserInputError(f"{where}.parameters: expected a JSON schema object")
    return {"type": "function", "function": {**function, "parameters": parameters}}


def detect_format(template: str) -> str | None:
    """The call format a chat template teaches, from its text; None when it is neither."""
    if OPEN in template:
        return HERMES
    if "<|start_header_id|>" in template and '"parameters"' in template:
        return LLAMA3_JSON
    return None


def default_instructions(tools: Tools) -> str:
    """What dorarl tells a model whose template has no tools: the schemas and the hermes
    format, as a system message."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools.schemas)
    return (
        "You can call tools. Their JSON schemas:\n<tools>\n" + listed + "\n</tools>\n"
        'To call one, write <tool_call>{"name": <tool name>, "arguments": <the arguments '
        "as a JSON object>}</tool_call>; its result comes back in the next message."
    )


def parse_tool_calls(
    text: str, fmt: str, tools: Tools, finish_reason: str = "stop", first_id: int = 0
) -> list[ToolCall | ToolCallError]:
    """The calls a reply attempts, in order (ids `call_{first_id}`, ...); a reply cut by the
    length cap (`finish_reason` "length") has its unfinished call refused, never run."""
    cut = finish_reason == "length"
    pieces = _hermes_pieces(text) if fmt == HERMES else _llama3_pieces(text, cut)
    out: list[ToolCall | ToolCallError] = []
    for i, (body, closed) in enumerate(pieces):
        call_id = f"call_{first_id + i}"
        if not closed:
            why = "the reply reached its length cap inside it" if cut else f"no {CLOSE}"
            out.append(
                ToolCallError(call_id, f"error: the call is unfinished ({why}); not run", body)
            )
            continue
        out.append(_read_call(call_id, body, fmt, tools))
    return out


def _hermes_pieces(text: str) -> list[tuple[str, bool]]:
    """Each `<tool_call>` body and whether its `</tool_call>` follows."""
    pieces, at = [], text.find(OPEN)
    while at >= 0:
        start = at + len(OPEN)
        end = text.find(CLOSE, start)
        if end < 0:
            return [*pieces, (text[start:], False)]
        pieces.append((text[start:end], True))
        at = text.find(OPEN, end + len(CLOSE))
    return pieces


def _llama3_pieces(text: str, cut: bool) -> list[tuple[str, bool]]:
    """The reply as one call when it reads as one (a JSON object, maybe after the python
    tag; one that does not parse in a reply the length cap cut is unfinished); a reply of
    prose is no call."""
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return []
    if _too_deep(body):
        return [(body, True)]  # read as a call, refused there
    try:
        json.JSONDecoder().raw_decode(body)
    except json.JSONDecodeError:
        return [(body, not cut)]
    return [(body, True)]


def _too_deep(text: str) -> bool:
    """Whether `text`'s brackets outside JSON strings nest deeper than MAX_DEPTH."""
    depth = 0
    for match in _NESTING.finditer(text):
        token = match.group()
        if token in ("[", "{"):
            depth += 1
            if depth > MAX_DEPTH:
                return True
        elif token in ("]", "}"):
            depth = max(depth - 1, 0)
    return False


def _read_call(call_id: str, body: str, fmt: str, tools: Tools) -> ToolCall | ToolCallError:
    args_key = "arguments" if fmt == HERMES else "parameters"
    if _too_deep(body):
        return ToolCallError(call_id, f"error: the call nests deeper than {MAX_DEPTH} levels", body)
    try:
        data, end = json.JSONDecoder().raw_decode(body.strip())
    except json.JSONDecodeError as exc:
        return ToolCallError(call_id, f"error: the call is not JSON ({exc.msg} at {exc.pos})", body)
    if body.strip()[end:].strip():
        return ToolCallError(call_id, "error: text follows the call's JSON object", body)
    name = data.get("name") if isinstance(data, dict) else None
    if not isinstance(name, str):
        return ToolCallError(
            call_id, 'error: the call is not {"name": ..., "' + args_key + '": {...}}', body
        )
    if name not in tools.names:
        known = ", ".join(tools.names) or "none"
        return ToolCallError(
            call_id, f"error: unknown tool {name!r} (the tools: {known})", body, name
        )
    arguments = data.get(args_key, data.get("arguments", {}))
    if isinstance(arguments, str) and not _too_deep(arguments):  # OpenAI's API's string form
        with contextlib.suppress(json.JSONDecodeError):  # refused below, as a string
            arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        return ToolCallError(
            call_id, f"error: {name}'s {args_key} must be a JSON object", body, name
        )
    return ToolCall(call_id, name, arguments, body)
