"""Conversations on real chat templates (ChatML, Qwen2.5, Qwen3, Llama 3.1): the tokens a
turn conditions on are the sampled ones plus the template's delta, refusals of templates
that re-render what the model was shown, and the boundary between sampled and appended."""

import pytest
from chat_fixtures import TOOLS, call_text, chat_tokenizer, ids, stop_ids
from transformers import PreTrainedTokenizerFast

from dorarl.errors import UserInputError
from dorarl.tasks.conversation import Conversation, TemplateDrift, tool_message
from dorarl.tasks.tool_calls import ToolCall, ToolCallError

FAMILIES = ["chatml", "qwen2_5", "qwen3", "llama3_1"]
QUESTION = [{"role": "user", "content": "What is 12 plus 30?"}]


def _conversation(family: str, tools=TOOLS, **kw) -> tuple[Conversation, PreTrainedTokenizerFast]:
    tok = chat_tokenizer(family)
    return Conversation(tok, tools, stop_token_ids=stop_ids(tok, family), **kw), tok


def _end(tok, family: str, name: str | None = None) -> int:
    default = "<|eot_id|>" if family == "llama3_1" else "<|im_end|>"
    return tok.convert_tokens_to_ids(name or default)


def _whole(conv: Conversation, tok) -> list[int]:
    """Tokenizing the template's rendering of the whole conversation at once."""
    text = tok.apply_chat_template(
        conv.messages, tools=conv._template_tools, add_generation_prompt=True, tokenize=False,
        **conv.template_kwargs,
    )  # fmt: skip
    return ids(tok, text)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_turn_sees_exactly_its_history_and_the_whole_tokenizes_the_same(family):
    conv, tok = _conversation(family)
    prompt = conv.start(QUESTION)
    assert prompt == _whole(conv, tok)
    replies = [call_text(family, "add", {"a": 12, "b": 30}), "The answer is 42."]
    answers = [lambda r: [tool_message(r.calls[0], "42")], lambda r: [{"role": "user", "content": "thanks"}]]  # fmt: skip
    for text, answer in zip(replies, answers, strict=True):
        turn = ids(tok, text) + [_end(tok, family)]
        seen = list(conv.token_ids)
        reply = conv.add_reply(turn, "stop")
        assert reply.text == text and reply.end_text == tok.convert_ids_to_tokens(turn[-1])
        delta = conv.render_delta(answer(reply))
        assert conv.token_ids == seen + turn + delta  # only appended, the turn as sampled
        assert conv.token_ids == _whole(conv, tok)  # and what the template gives at once
    assert conv.rewritten_replies == conv.boundary_merges == 0
    call = conv.messages[-4]
    assert call["role"] == "assistant" and call["content"] == replies[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_history_holding_a_call_renders_the_call_as_the_model_sampled_it(family):
    # The call as an agent's client sends it back (OpenAI's shape, its arguments a JSON
    # string, its block out of the text): a new conversation on that history is shown the
    # tokens the first one was, the call as sampled (ChatML's template ignores tool_calls:
    # the call is written into the text, in the format dorarl told the model).
    first, tok = _conversation(family)
    first.start(QUESTION)
    thought = "<think>\nI should add.\n</think>\n\n" if family == "qwen3" else ""
    text = thought + call_text(family, "add", {"a": 12, "b": 30})
    reply = first.add_reply(ids(tok, text) + [_end(tok, family)], "stop")
    [call] = reply.tool_calls
    first.render_delta([tool_message(call, "42")])
    sent = {"role": "assistant", "content": thought.strip() or None, "tool_calls": [call.openai()]}
    again, _ = _conversation(family)
    prompt = again.start([*QUESTION, sent, tool_message(call, "42")])
    assert prompt == _whole(first, tok)
    [kept] = [m["tool_calls"] for m in again.messages if m["role"] == "assistant"]
    assert kept[0]["function"] == {"name": "add", "arguments": {"a": 12, "b": 30}}
    assert text in tok.decode(prompt)


def test_a_calls_arguments_must_be_a_json_object_in_one_line():
    conv, _ = _conversation("qwen2_5")
    call = {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{oops"}}
    with pytest.raises(UserInputError, match=r"^messages\[1\]\.tool_calls\[0\]\.function\.arguments: expected a JSON object$"):  # fmt: skip
        conv.start([*QUESTION, {"role": "assistant", "content": "", "tool_calls": [call]}])
    with pytest.raises(UserInputError, match=r"messages\[0\]\.tool_calls: only an assistant"):
        conv.start([{**QUESTION[0], "tool_calls": [call]}])


@pytest.mark.parametrize("family", ["chatml", "qwen2_5", "llama3_1"])
def test_sampled_tokens_stay_as_sampled_and_the_delta_is_the_whole_texts(family):
    conv, tok = _conversation(family)
    conv.start(QUESTION)
    text = "The answer is 42."
    odd = [i for ch in text for i in ids(tok, ch)] + [_end(tok, family)]  # one byte a token
    assert odd[:-1] != ids(tok, text)
    before = list(conv.token_ids)
    reply = conv.add_reply(odd, "stop")
    assert reply.text == text
    delta = conv.render_delta([{"role": "user", "content": "thanks"}])
    assert conv.token_ids[: len(before) + len(odd)] == before + odd
    canonical = _whole(conv, tok)
    assert canonical[len(canonical) - len(delta) :] == delta  # the whole text's tokens there


def test_qwen3_keeps_think_blocks_through_tool_calls():
    conv, tok = _conversation("qwen3")
    conv.start(QUESTION)
    thought = "<think>\nI should add.\n</think>\n\n" + call_text("qwen3", "add", {"a": 12, "b": 30})
    reply = conv.add_reply(ids(tok, thought) + [_end(tok, "qwen3")], "stop")
    assert [c.name for c in reply.tool_calls] == ["add"]
    conv.render_delta([tool_message(reply.calls[0], "42")])
    conv.add_reply(ids(tok, "<think>\nDone.\n</think>\n\nIt is 42.") + [_end(tok, "qwen3")], "stop")
    conv.render_delta([tool_message(ToolCall("call_1", "add", {}, ""), "ok")])
    assert conv.token_ids == _whole(conv, tok)


def test_qwen3_dropping_a_think_block_after_a_user_message_is_refused_in_one_line():
    conv, tok = _conversation("qwen3")
    conv.start(QUESTION)
    conv.add_reply(ids(tok, "<think>\nEasy.\n</think>\n\n42") + [_end(tok, "qwen3")], "stop")
    with pytest.raises(TemplateDrift) as caught:
        conv.render_delta([{"role": "user", "content": "and 1 plus 1?"}])
    line = str(caught.value)
    assert "\n" not in line and "tests/qwen3" in line and "turn 1" in line
    assert "the model wrote '<think>" in line and "drops a reply's <think> block" in line


def test_qwen3_without_thinking_changes_its_generation_prompt_and_is_refused():
    conv, tok = _conversation("qwen3", template_kwargs={"enable_thinking": False})
    prompt = conv.start(QUESTION)
    assert tok.decode(prompt).endswith("<think>\n\n</think>\n\n")
    reply = conv.add_reply(ids(tok, call_text("qwen3", "add", {"a": 1, "b": 2})) + [2], "stop")
    with pytest.raises(TemplateDrift, match="change text it rendered before, at character"):
        conv.render_delta([tool_message(reply.calls[0], "3")])


def test_llama3_trims_a_reply_and_closes_a_call_with_its_own_end_token():
    conv, tok = _conversation("llama3_1")
    conv.start(QUESTION)
    call = " " + call_text("llama3_1", "add", {"a": 12, "b": 30}) + "\n"
    turn = ids(tok, call) + [_end(tok, "llama3_1", "<|eom_id|>")]  # ipython mode's end
    reply = conv.add_reply(turn, "stop")
    assert reply.tool_calls[0].arguments == {"a": 12, "b": 30}
    before = list(conv.token_ids)
    delta = conv.render_delta([tool_message(reply.calls[0], "42")])
    assert conv.rewritten_replies == 1 and conv.token_ids == before + delta
    assert tok.decode(delta).startswith("<|start_header_id|>ipython<|end_header_id|>")
    assert before[-len(turn) :] == turn  # the model keeps its spaces and its end token


def test_a_turn_ended_by_a_stop_string_is_closed_by_the_template():
    conv, tok = _conversation("qwen2_5")
    conv.start(QUESTION)
    text = call_text("qwen2_5", "add", {"a": 12, "b": 30})
    reply = conv.add_reply(ids(tok, text), "stop_string", "</tool_call>")
    assert reply.end_text == "" and reply.stop_string == "</tool_call>"
    delta = conv.render_delta([tool_message(reply.calls[0], "42")])
    assert delta[0] == _end(tok, "qwen2_5")
    assert conv.token_ids == _whole(conv, tok)


def test_a_call_cut_by_the_length_cap_is_an_error_not_a_call():
    conv, tok = _conversation("qwen2_5")
    conv.start(QUESTION)
    text = call_text("qwen2_5", "add", {"a": 12, "b": 30})[:-20]
    reply = conv.add_reply(ids(tok, text), "length")
    assert reply.tool_calls == [] and "length cap" in reply.tool_errors[0].message
    conv.render_delta([tool_message(reply.calls[0], reply.tool_errors[0].message)])
    assert conv.token_ids == _whole(conv, tok)


def test_a_template_without_tools_gets_dorarls_instructions_and_the_default_format():
    conv, tok = _conversation("chatml")
    prompt = tok.decode(conv.start(QUESTION))
    assert conv.format == "hermes" and conv._template_tools is None
    assert (
        prompt.startswith("<|im_start|>system\nYou can call tools.")
        and '"name": "lookup"' in prompt
    )
    plain, _ = _conversation("chatml", tools=None)
    assert "You can call tools" not in tok.decode(plain.start(QUESTION))


def test_call_ids_run_on_over_the_conversation():
    conv, tok = _conversation("qwen2_5")
    conv.start(QUESTION)
    two = call_text("qwen2_5", "add", {"a": 1, "b": 2}) + "\n" + call_text("qwen2_5", "nope", {})
    reply = conv.add_reply(ids(tok, two) + [_end(tok, "qwen2_5")], "stop")
    assert [c.id for c in reply.calls] == ["call_0", "call_1"]
    assert (
        isinstance(reply.calls[1], ToolCallError)
        and "unknown tool 'nope'" in reply.calls[1].message
    )
    conv.render_delta([tool_message(c, "x") for c in reply.calls])
    again = conv.add_reply(ids(tok, call_text("qwen2_5", "lookup", {"word": "hi"})) + [2], "stop")
    assert again.calls[0].id == "call_2"


def test_a_merge_across_the_boundary_keeps_the_sampled_tokens_and_is_counted():
    tok = chat_tokenizer("chatml")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    conv = Conversation(tok)
    conv.start([{"role": "user", "content": "say "}])
    hel = ids(tok, "hel")
    conv.add_reply(hel, "length")
    delta = conv.render_delta([{"role": "user", "content": "lo world"}])
    assert ids(tok, "say hello world")[:2] != ids(tok, "say ") + hel[:1]  # hello is one token
    assert conv.boundary_merges == 1 and delta == ids(tok, "lo world")
    assert conv.token_ids == ids(tok, "say ") + hel + delta


def test_bad_messages_and_a_missing_template_are_one_line_naming_the_field():
    conv, _ = _conversation("qwen2_5")
    with pytest.raises(UserInputError, match=r"messages\[1\]\.role: expected one of"):
        conv.start([QUESTION[0], {"role": "robot", "content": "x"}])
    with pytest.raises(UserInputError, match=r"messages\[0\]\.content: expected a string"):
        conv.start([{"role": "user", "content": None}])
    tok = chat_tokenizer("qwen2_5")
    tok.chat_template = None
    with pytest.raises(UserInputError, match="has no chat template"):
        Conversation(tok)
    with pytest.raises(UserInputError, match=r"tools\[0\]: expected"):
        Conversation(chat_tokenizer("qwen2_5"), [{"type": "function", "function": {}}])
