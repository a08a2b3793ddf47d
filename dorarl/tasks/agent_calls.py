"""An agent's chat-completion call checked field by field before anything reads it: each bad
field is answered HTTP 400 in OpenAI's error shape, naming it (`param`), never a crash."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from dorarl.tasks.conversation import ROLES
from dorarl.tasks.openai_endpoint import CallError


@dataclass(frozen=True)
class CallBody:
    """What of a call dorarl serves: its messages, its tools, its template's arguments."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    template_kwargs: dict[str, Any]


def read_call(body: dict[str, Any]) -> CallBody:
    """The call's body, checked (`CallError` 400 for the first bad field)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "expected a non-empty list")
    for i, message in enumerate(messages):
        _check_message(message, f"messages[{i}]")
    if body.get("stream"):
        raise CallError(400, "stream: streaming is not served", "unsupported", "stream")
    if body.get("n", 1) not in (1, None):
        raise CallError(400, "n: one choice per call", "unsupported", "n")
    return CallBody(messages, _tools(body.get("tools")), _template_kwargs(body))


def _check_message(message: Any, where: str) -> None:
    if not isinstance(message, dict):
        raise _bad(where, "expected an object")
    if message.get("role") not in ROLES:
        raise _bad(f"{where}.role", f"expected one of {', '.join(ROLES)}")
    _check_content(message.get("content"), f"{where}.content")
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None and not isinstance(message[key], str):
            raise _bad(f"{where}.{key}", "expected a string")
    calls = message.get("tool_calls")
    if calls is None:
        return
    if not isinstance(calls, list):
        raise _bad(f"{where}.tool_calls", "expected a list")
    for j, call in enumerate(calls):
        _check_tool_call(call, f"{where}.tool_calls[{j}]")


def _check_content(content: Any, where: str) -> None:
    """None, a string, or OpenAI's list of text parts."""
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise _bad(where, "expected a string or a list of text parts")
    for k, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise _bad(f"{where}[{k}]", "expected a text part ({'type': 'text', 'text': ...})")
        if not isinstance(part.get("text"), str):
            raise _bad(f"{where}[{k}].text", "expected a string")


def _check_tool_call(call: Any, where: str) -> None:
    if not isinstance(call, dict):
        raise _bad(where, "expected an object")
    if call.get("id") is not None and not isinstance(call["id"], str):
        raise _bad(f"{where}.id", "expected a string")
    function = call.get("function")
    if not isinstance(function, dict):
        raise _bad(f"{where}.function", "expected an object")
    if not isinstance(function.get("name"), str):
        raise _bad(f"{where}.function.name", "expected a string")
    arguments = function.get("arguments")
    if arguments is not None and not isinstance(arguments, str | dict):
        raise _bad(f"{where}.function.arguments", "expected a JSON string")


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    if not isinstance(tools, list):
        raise _bad("tools", "expected a list", "bad_tools")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise _bad(f"tools[{i}]", "expected an object", "bad_tools")
        function = tool.get("function", tool)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _bad(f"tools[{i}].function.name", "expected a string", "bad_tools")
    return tools


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """The template's own variables; an argument of `apply_chat_template` itself (tokenize,
    return_dict, tools, ..) would change what it returns, and is refused."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise _bad("chat_template_kwargs", "expected an object", _KWARGS)
    for key in kwargs:
        if not isinstance(key, str) or key in _template_arguments():
            raise _bad(
                f"chat_template_kwargs.{key}",
                "an argument of apply_chat_template, not a template variable",
                _KWARGS,
            )
    return kwargs


@functools.cache
def _template_arguments() -> frozenset[str]:
    parameters = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    return frozenset(
        name for name, p in parameters.items() if p.kind is not inspect.Parameter.VAR_KEYWORD
    )


_KWARGS = "bad_chat_template_kwargs"


def _bad(param: str, what: str, code: str = "bad_messages") -> CallError:
    return CallError(400, f"{param}: {what}", code, param)
