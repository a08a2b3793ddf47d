"""Tool calls read from replies in the hermes and Llama 3 formats: well-formed calls of
declared tools, and one error line for every other attempt, in the reply's order."""

import pytest
from chat_fixtures import TEMPLATES, TOOLS
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_model import CHATML_TEMPLATE

from dorarl.errors import UserInputError
from dorarl.tasks.tool_calls import (
    HERMES,
    LLAMA3_JSON,
    MAX_DEPTH,
    ToolCall,
    ToolCallError,
    Tools,
    detect_format,
    parse_tool_calls,
)

DECLARED = Tools.of(TOOLS)


def test_hermes_calls_in_order_with_their_errors():
    text = (
        'Let me see. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
        '<tool_call>{"name": "mul", "arguments": {}}</tool_call>'
        "<tool_call>{name: add}</tool_call>"
        '<tool_call>{"name": "lookup", "arguments": "{\\"word\\": \\"hi\\"}"}</tool_call>'
        '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 1}} and more</tool_call>'
    )
    got = parse_tool_calls(text, HERMES, DECLARED, first_id=5)
    assert [c.id for c in got] == [f"call_{i}" for i in range(5, 11)]
    assert got[0] == ToolCall("call_5", "add", {"a": 1, "b": 2}, '\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n')  # fmt: skip
    assert isinstance(got[1], ToolCallError) and "unknown tool 'mul' (the tools: add, lookup)" in got[1].message  # fmt: skip
    assert "not JSON" in got[2].message
    assert got[3] == ToolCall(
        "call_8", "lookup", {"word": "hi"}, got[3].text
    )  # OpenAI's string form
    assert "add's arguments must be a JSON object" in got[4].message
    assert "text follows" in got[5].message


def test_an_unclosed_hermes_call_is_unfinished_and_never_run():
    text = '<tool_call>{"name": "add", "arguments": {"a": 1, "b"'
    (cut,) = parse_tool_calls(text, HERMES, DECLARED, finish_reason="length")
    assert (
        isinstance(cut, ToolCallError) and "length cap" in cut.message and "not run" in cut.message
    )
    (ended,) = parse_tool_calls(text, HERMES, DECLARED, finish_reason="stop")
    assert isinstance(ended, ToolCallError) and "no </tool_call>" in ended.message
    assert parse_tool_calls("no call here </tool_call>", HERMES, DECLARED) == []


def test_llama3_replies_are_one_json_call_or_prose():
    call, = parse_tool_calls('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}', LLAMA3_JSON, DECLARED)  # fmt: skip
    assert call == ToolCall("call_0", "add", {"a": 1, "b": 2}, call.text)
    assert parse_tool_calls("The answer is 3.", LLAMA3_JSON, DECLARED) == []
    (bad,) = parse_tool_calls('{"name": "add", "parameters": {"a": 1,}}', LLAMA3_JSON, DECLARED)
    assert isinstance(bad, ToolCallError) and "not JSON" in bad.message
    (cut,) = parse_tool_calls(
        '{"name": "add", "param', LLAMA3_JSON, DECLARED, finish_reason="length"
    )
    assert isinstance(cut, ToolCallError) and "length cap" in cut.message


def test_the_format_is_read_from_the_template():
    assert detect_format((TEMPLATES / "qwen2_5.jinja").read_text()) == HERMES
    assert detect_format((TEMPLATES / "qwen3.jinja").read_text()) == HERMES
    assert detect_format((TEMPLATES / "llama3_1.jinja").read_text()) == LLAMA3_JSON
    assert detect_format(CHATML_TEMPLATE) is None


def test_tools_are_checked_schemas_in_the_openai_form():
    assert DECLARED.names == ["add", "lookup"]
    assert DECLARED.schemas[1]["type"] == "function"  # a bare schema is wrapped
    with pytest.raises(UserInputError, match=r"task\.tools\[0\]: expected a JSON schema"):
        Tools.of(["add"], key="task.tools")
    with pytest.raises(UserInputError, match=r"tools\[0\]\.parameters: expected"):
        Tools.of([{"name": "x", "parameters": "none"}])
    assert ToolCall("call_0", "add", {"a": 1}, "").openai()["function"]["arguments"] == '{"a": 1}'


# Pieces a degenerate policy strings together: call markers, JSON's syntax, deep nesting.
_PIECES = st.one_of(
    st.text(max_size=8),
    st.sampled_from(
        [
            "<tool_call>",
            "</tool_call>",
            "<|python_tag|>",
            '{"name": "add", "arguments": ',
            '"',
            "\\",
            ":",
            ",",
            "}",
            "]",
            "{",
            "[",
        ]
    ),  # fmt: skip
    st.integers(1, 3000).flatmap(
        lambda n: st.sampled_from(["[" * n, "{" * n, '{"a":' * n, '"[' * n])
    ),  # fmt: skip
)


@settings(max_examples=200, deadline=None)
@given(text=st.lists(_PIECES, max_size=12).map("".join), fmt=st.sampled_from([HERMES, LLAMA3_JSON]), cut=st.booleans())  # fmt: skip
def test_any_text_parses_without_raising(text, fmt, cut):
    calls = parse_tool_calls(text, fmt, DECLARED, "length" if cut else "stop")
    assert all(isinstance(c, ToolCall | ToolCallError) for c in calls)


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON])
def test_a_call_nested_past_the_bound_is_refused_unread(fmt):
    deep = '{"name": "add", "arguments": {"a": ' + "[" * 5000 + "]" * 5000 + "}}"
    (call,) = parse_tool_calls(f"<tool_call>{deep}</tool_call>" if fmt == HERMES else deep, fmt, DECLARED)  # fmt: skip
    assert isinstance(call, ToolCallError) and f"deeper than {MAX_DEPTH}" in call.message
    nested = '{"name": "add", "arguments": {"a": ' + "[" * 60 + "]" * 60 + ', "s": "' + "[" * 500 + '"}}'  # fmt: skip
    (ok,) = parse_tool_calls(f"<tool_call>{nested}</tool_call>" if fmt == HERMES else nested, fmt, DECLARED)  # fmt: skip
    assert isinstance(ok, ToolCall)  # brackets in strings do not count
