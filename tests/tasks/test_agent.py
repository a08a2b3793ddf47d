"""Users' agents through the OpenAI endpoint: the real `openai` client against dorarl's
server, episodes fed turns as an engine samples them (or sampled by a real engine), their
tokens, rewards, bounds and the endpoint's errors."""

import asyncio
import json
import re
import sys
import time
from pathlib import Path

import aiohttp
import openai
import pytest
import torch
from chat_fixtures import TOOLS, call_text, chat_tokenizer, ids
from transformers import Qwen2Config, Qwen2ForCausalLM

from dorarl.engine import Engine, EngineConfig, SamplingParams
from dorarl.errors import UserInputError
from dorarl.tasks.agent import AgentTask, load_agent
from dorarl.tasks.episodes import EpisodeState, reset, run_episodes, step
from dorarl.tasks.jsonl import JsonlTask

AGENT = __name__


async def two_calls(client, prompt):
    """Asks, then asks again after the reply: the second call extends the first."""
    messages = [{"role": "user", "content": prompt.text}]
    first = await client.chat.completions.create(model="m", messages=messages)
    messages += [first.choices[0].message.model_dump(), {"role": "user", "content": "Again."}]
    second = await client.chat.completions.create(model="m", messages=messages)
    return float(second.choices[0].finish_reason in ("stop", "length"))


async def adds(client, prompt):
    """Offers `add`, runs the call the model makes, and wins on a reply that says 3."""
    messages = [{"role": "user", "content": prompt.text}]
    reply = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
    call = message.tool_calls[0]
    total = sum(json.loads(call.function.arguments).values())
    messages += [message.model_dump(), {"role": "tool", "tool_call_id": call.id, "content": str(total)}]  # fmt: skip
    final = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    return float("3" in final.choices[0].message.content)


async def trims(client, prompt):
    """Runs the model's call, then drops its system message: a new segment whose history
    holds the call."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt.text}]  # fmt: skip
    reply = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    message = reply.choices[0].message
    call = message.tool_calls[0]
    messages += [message.model_dump(), {"role": "tool", "tool_call_id": call.id, "content": "3"}]
    final = await client.chat.completions.create(model="m", messages=messages[1:], tools=TOOLS)
    return float("3" in final.choices[0].message.content)


async def hangs(client, prompt):
    await asyncio.sleep(3600)


async def hangs_after_a_call(client, prompt):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    await asyncio.sleep(3600)


async def raises(client, prompt):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    raise RuntimeError("the grader is down")


async def says_yes(client, prompt):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    return "yes"


async def summarises(client, prompt):
    """Asks, then starts over from a summary of the exchange (a conversation that does not
    extend the first: a new segment), then extends that one."""
    first = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt.text}])  # fmt: skip
    said = first.choices[0].message.content or ""
    messages = [{"role": "system", "content": f"Summary: asked, got {said[:12]!r}."}, {"role": "user", "content": "Go on."}]  # fmt: skip
    second = await client.chat.completions.create(model="m", messages=messages)
    messages += [second.choices[0].message.model_dump(), {"role": "user", "content": "Again."}]
    third = await client.chat.completions.create(model="m", messages=messages)
    return float(third.choices[0].finish_reason in ("stop", "length"))


async def starts_over(client, prompt):
    """Starts a new conversation at every call (its tools change too) until refused."""
    for i in range(10):
        tools = TOOLS[: 1 + i % 2]
        try:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"x{i}"}], tools=tools)  # fmt: skip
        except openai.BadRequestError as exc:
            return float(i) if exc.body["code"] == "max_segments" else -1.0
    return 0.0


async def never_stops(client, prompt):
    """Calls until refused (task.max_turns), then returns its reward."""
    messages = [{"role": "user", "content": "hi"}]
    while True:
        try:
            reply = await client.chat.completions.create(model="m", messages=messages)
        except openai.BadRequestError as exc:
            return 1.0 if exc.body["code"] == "max_turns" else 0.0
        messages += [reply.choices[0].message.model_dump(), {"role": "user", "content": "more"}]


async def disconnects(client, prompt):
    """Its first try gives up before the reply (the client leaves); its retry gets it."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    url = f"{client.base_url}chat/completions"
    async with aiohttp.ClientSession() as session:
        with pytest.raises(TimeoutError):
            await session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=0.2))
    reply = await client.chat.completions.create(**body)
    return float(reply.choices[0].message.content == "Hello there.")


SEEN: list = []  # what agents below saw, for their tests to read


async def mixed_calls(client, prompt):
    """Gets a reply with a well-formed call and a malformed one, and keeps its message."""
    reply = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], tools=TOOLS)  # fmt: skip
    SEEN.append(reply.choices[0].message)
    return 1.0


async def calls_across_segments(client, prompt):
    """Gets a call of `add`, starts over (a new segment) with that exchange in a rewritten
    history and gets a call of `lookup`, then starts over again with both exchanges."""
    messages = [{"role": "user", "content": prompt.text}]
    first = (await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)).choices[0].message  # fmt: skip
    messages += [first.model_dump(), {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "3"}]  # fmt: skip
    messages = [{"role": "system", "content": "Summary one."}, *messages, {"role": "user", "content": "Look it up."}]  # fmt: skip
    second = (await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)).choices[0].message  # fmt: skip
    messages += [second.model_dump(), {"role": "tool", "tool_call_id": second.tool_calls[0].id, "content": "found"}]  # fmt: skip
    messages = [{"role": "system", "content": "Summary two."}, *messages[1:]]
    await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    SEEN.append((first.tool_calls[0].id, second.tool_calls[0].id))
    return 1.0


async def asks_twice_the_same(client, prompt):
    """Best of two: the same messages twice, on purpose, after the first reply came."""
    messages = [{"role": "user", "content": prompt.text}]
    first = await client.chat.completions.create(model="m", messages=messages)
    second = await client.chat.completions.create(model="m", messages=messages)
    return float(first.choices[0].message.content != second.choices[0].message.content)


async def calls_twice_at_once(client, prompt):
    """Two different calls at once: one is served, the other refused (409)."""
    asked = [client.chat.completions.create(model="m", messages=[{"role": "user", "content": t}]) for t in ("a", "b")]  # fmt: skip
    answers = await asyncio.gather(*asked, return_exceptions=True)
    refused = [a for a in answers if isinstance(a, openai.ConflictError)]
    served = [a for a in answers if not isinstance(a, BaseException)]
    assert len(refused) == len(served) == 1, answers
    return float(refused[0].body["code"] == "concurrent_call")


async def overflows(client, prompt):
    """A call too long for the context gets context_length_exceeded; a short one then fits."""
    messages = [{"role": "user", "content": "hi"}]
    reply = await client.chat.completions.create(model="m", messages=messages)
    messages.append(reply.choices[0].message.model_dump())
    try:
        await client.chat.completions.create(model="m", messages=[*messages, {"role": "user", "content": "word " * 200}])  # fmt: skip
    except openai.BadRequestError as exc:
        code = exc.body["code"]
    reply = await client.chat.completions.create(model="m", messages=[*messages, {"role": "user", "content": "ok"}])  # fmt: skip
    return float(code == "context_length_exceeded" and reply.choices[0].message.content == "Two.")


BAD_CALLS = [
    ({"role": "assistant", "content": None, "tool_calls": 5}, {}, "messages[0].tool_calls"),
    ({"role": "user", "content": [{"type": "text", "text": 5}]}, {}, "messages[0].content[0].text"),
    ({"role": "tool", "content": "3", "tool_call_id": [1]}, {}, "messages[0].tool_call_id"),
    ({"role": "user", "content": "hi"}, {"tools": 5}, "tools"),
    ({"role": "user", "content": "hi"}, {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
    ({"role": "user", "content": "hi"}, {"chat_template_kwargs": {"return_dict": True}}, "chat_template_kwargs.return_dict"),
    ({"role": "user", "content": "hi"}, {"chat_template_kwargs": 3}, "chat_template_kwargs"),
    ({"role": "user", "content": "hi"}, {"tools": [{"type": "function", "function": {"name": 5}}]}, "tools[0].function.name"),
    ({"role": "robot", "content": "hi"}, {}, "messages[0].role"),
]  # fmt: skip


async def sends_bad_calls(client, prompt):
    """Every bad call first (each must get a 400 naming its field), then a good one."""
    url = f"{client.base_url}chat/completions"
    async with aiohttp.ClientSession() as session:
        for message, extra, param in BAD_CALLS:
            async with session.post(url, json={"messages": [message], **extra}) as answer:
                error = (await answer.json())["error"]
            assert answer.status == 400 and error["param"] == param, (param, error)
            assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"  # fmt: skip
    reply = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])  # fmt: skip
    return float(reply.choices[0].message.content == "One.")


def _task(
    tmp_path,
    agent: str,
    max_turns: int = 4,
    timeout_s: float = 5.0,
    max_segments: int = 8,
    max_model_len: int = 1024,
) -> AgentTask:
    rows = [{"prompt": f"What is {a} plus {b}?", "answer": str(a + b)} for a, b in [(1, 2)] * 6]
    (tmp_path / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = JsonlTask(tmp_path / "sums.jsonl", tokenizer=chat_tokenizer("qwen2_5"), max_model_len=max_model_len, max_new_tokens=16)  # fmt: skip
    return AgentTask(base, f"{AGENT}:{agent}", max_turns, timeout_s, max_segments=max_segments)


def _turn(task, text: str) -> list[int]:
    return ids(task.tokenizer, text) + [task.tokenizer.convert_tokens_to_ids("<|im_end|>")]


async def _episode(task, texts):
    """Play an episode, each turn sampling the next of `texts`: its state and prompts."""
    state = EpisodeState(task.train_prompts()[0], task.make_env())
    shown = [await reset(task, state)]
    for text in texts:
        nxt = await step(task, state, _turn(task, text), "stop")
        if nxt is None:
            break
        shown.append(nxt)
    return state, shown


def test_an_agent_with_a_tool_plays_through_the_client_and_its_reward_is_the_episodes(tmp_path):
    task = _task(tmp_path, "adds")
    call = call_text("qwen2_5", "add", {"a": 1, "b": 2})
    state, shown = asyncio.run(_episode(task, [call, "It is 3."]))
    assert state.error is None and state.reward == 1.0 and state.end_reason == "env"
    assert [(t.tool_calls, t.tool_errors) for t in state.turns] == [(1, 0), (0, 0)]
    conversation = state.env.conversation
    assert conversation.token_ids == shown[0] + _turn(task, call) + shown[1] + _turn(task, "It is 3.")  # fmt: skip
    assert conversation.messages[-1] == {"role": "tool", "content": "3", "tool_call_id": "call_0", "name": "add"}  # fmt: skip


def test_a_new_segment_whose_history_holds_a_call_is_shown_the_call_as_sampled(tmp_path):
    task = _task(tmp_path, "trims")
    call = call_text("qwen2_5", "add", {"a": 1, "b": 2})
    state, shown = asyncio.run(_episode(task, [call, "It is 3."]))
    assert state.error is None and state.reward == 1.0 and state.env.segments == 2
    assert type(shown[1]).__name__ == "NewSegment"
    text = task.tokenizer.decode(shown[1])
    assert "Be brief." not in text
    assert f"<|im_start|>assistant\n{call}<|im_end|>\n<|im_start|>user\n<tool_response>\n3\n" in text  # fmt: skip


class _Counting:
    """An engine whose steps' prefilled tokens are written down, one entry per prefill."""

    def __init__(self, engine):
        self.engine, self.prefills = engine, []

    def step(self):
        out = self.engine.step()
        if self.engine.last_step.prefill_tokens:
            self.prefills.append(self.engine.last_step.prefill_tokens)
        return out

    def __getattr__(self, name):
        return getattr(self.engine, name)


def _real_engine(task) -> _Counting:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(task.tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
    )).eval()  # fmt: skip
    config = EngineConfig(max_num_seqs=2, block_size=16, num_blocks=64, max_model_len=1024, attention="torch")  # fmt: skip
    return _Counting(Engine.from_hf_config(model.config, config, model.state_dict()))


def _greedy(task) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_new_tokens=6, stop_token_ids=task.stop_token_ids, multi_turn=True
    )


def test_an_extending_call_prefills_only_its_new_tokens_on_a_real_engine(tmp_path):
    task = _task(tmp_path, "two_calls")
    engine = _real_engine(task)
    params = _greedy(task)
    [(state, out)] = run_episodes(engine, task, task.train_prompts()[:1], params).values()
    assert state.error is None and state.reward == 1.0 and len(state.turns) == 2
    first_prompt, first_turn, shown = len(out.prompt_ids), state.turns[0].sampled, state.turns[0].observed  # fmt: skip
    assert shown > 0 and state.env.conversation.token_ids == out.prompt_ids + out.output_ids
    # Turn 2's prompt is the whole conversation, but only the new messages' tokens (and the
    # stop token that ended turn 1, never fed) are prefilled: the KV of the rest is kept.
    assert engine.prefills[0] == first_prompt
    assert sum(engine.prefills[1:]) == shown + 1 < first_prompt + first_turn + shown


def test_a_call_that_does_not_extend_starts_segment_2_which_later_calls_extend(tmp_path, caplog):
    task = _task(tmp_path, "summarises")
    engine = _real_engine(task)
    [(state, out)] = run_episodes(engine, task, task.train_prompts()[:1], _greedy(task)).values()
    assert state.error is None and state.reward == 1.0 and len(state.turns) == 3
    assert state.env.segments == 2 and state.env.refused == 0
    first, second = state.turns[0], state.turns[1]
    # Segment 2 starts after turn 1's reply: its prompt is the new conversation's whole
    # rendering, prefilled from scratch; turn 3 then prefills only its new messages on it.
    [start] = out.segments
    assert (start.at, start.prompt) == (first.sampled, first.observed)
    conversation = state.env.conversation  # segment 2's
    assert conversation.token_ids == out.output_ids[start.at :]
    assert out.output_ids[start.at : start.at + start.prompt] == conversation.token_ids[: start.prompt]  # fmt: skip
    assert engine.prefills == [len(out.prompt_ids), start.prompt, second.observed + 1]
    assert out.observed == (
        [False] * first.sampled + [True] * first.observed + [False] * second.sampled
        + [True] * second.observed + [False] * state.turns[2].sampled
    )  # fmt: skip
    assert engine.stats().kv_blocks_used == 0
    assert not [r for r in caplog.records if r.name.startswith("dorarl")]  # counted, not logged


@pytest.mark.parametrize(
    ("agent", "error"),
    [
        ("raises", "the agent raised RuntimeError: the grader is down"),
        ("says_yes", "the agent returned 'yes', not a finite number"),
        ("hangs_after_a_call", "the agent timed out after 0.5 s (no call, no return)"),
    ],
)
def test_an_agent_that_fails_ends_its_episode_with_reward_0_and_one_line(tmp_path, agent, error):
    task = _task(tmp_path, agent, timeout_s=0.5)
    state, _ = asyncio.run(_episode(task, ["Hello there."]))
    assert (state.error, state.reward, state.end_reason) == (error, 0.0, "env_error")
    assert len(state.turns) == 1


def test_an_agent_that_hangs_before_calling_ends_its_episode_on_its_first_turn(tmp_path):
    task = _task(tmp_path, "hangs", timeout_s=0.3)
    state, shown = asyncio.run(_episode(task, ["Hello there."]))
    assert state.error == "the agent timed out after 0.3 s (no call, no return)"
    assert shown == [task.train_prompts()[0].prompt_ids] and len(state.turns) == 1
    assert state.env._agent.cancelled()


def test_calls_past_max_segments_are_refused_with_an_openai_error_and_counted(tmp_path):
    task = _task(tmp_path, "starts_over", max_turns=8, max_segments=3)
    state, shown = asyncio.run(_episode(task, ["One.", "Two.", "Three."]))
    # Three conversations, each with other tools than the one before; the fourth is refused.
    assert state.error is None and state.reward == 3.0 and state.env.refused == 1
    assert state.env.segments == 3 and len(state.turns) == 3
    assert [type(ids).__name__ for ids in shown] == ["list", "NewSegment", "NewSegment"]
    assert task.tokenizer.decode(shown[2]).count("x2") == 1  # the third conversation alone


def test_calls_past_max_turns_are_refused_and_the_agent_still_gives_the_reward(tmp_path):
    state, _ = asyncio.run(_episode(_task(tmp_path, "never_stops", max_turns=2), ["a", "b", "c"]))
    assert (state.reward, state.end_reason, len(state.turns)) == (1.0, "max_turns", 2)


def test_a_client_that_disconnects_leaves_the_episode_whole_and_its_retry_gets_the_reply(
    tmp_path,
):
    task = _task(tmp_path, "disconnects")

    async def play():
        state = EpisodeState(task.train_prompts()[0], task.make_env())
        await reset(task, state)
        await asyncio.sleep(0.5)  # the client has left; the engine samples the turn meanwhile
        return state, await step(task, state, _turn(task, "Hello there."), "stop")

    state, nxt = asyncio.run(play())
    assert nxt is None and state.error is None and state.reward == 1.0


def test_a_call_that_repeats_an_answered_one_on_purpose_is_sampled_again(tmp_path):
    state, _ = asyncio.run(_episode(_task(tmp_path, "asks_twice_the_same"), ["One.", "Two."]))
    assert state.error is None and state.reward == 1.0 and len(state.turns) == 2
    assert state.env.segments == 2  # its messages do not extend the reply: a new conversation


def test_a_second_call_while_one_is_unanswered_is_refused_409_in_openais_shape(tmp_path):
    task = _task(tmp_path, "calls_twice_at_once")

    async def play():
        state = EpisodeState(task.train_prompts()[0], task.make_env())
        await reset(task, state)
        await asyncio.sleep(0.5)  # both calls are in before the engine samples the first's turn
        return state, await step(task, state, _turn(task, "One."), "stop")

    state, nxt = asyncio.run(play())
    assert nxt is None and state.error is None and state.reward == 1.0 and state.env.refused == 1


def test_a_call_past_the_context_is_refused_context_length_exceeded_and_counted(tmp_path):
    task = _task(tmp_path, "overflows", max_model_len=160)
    state, _ = asyncio.run(_episode(task, ["One.", "Two."]))
    assert state.error is None and state.reward == 1.0 and len(state.turns) == 2
    assert (state.env.overflows, state.env.refused, state.env.segments) == (1, 1, 1)
    assert len(state.env.conversation.token_ids) < 160  # the refused messages never joined it


def test_every_malformed_call_gets_a_400_naming_its_field_and_the_episode_goes_on(tmp_path):
    state, _ = asyncio.run(_episode(_task(tmp_path, "sends_bad_calls"), ["One."]))
    assert (state.error, state.reward, state.end_reason) == (None, 1.0, "env")
    assert state.env.refused == len(BAD_CALLS)


def test_the_endpoint_answers_every_bad_call_with_an_openai_error_body(tmp_path):
    task = _task(tmp_path, "two_calls")
    endpoint = task.endpoint()

    async def calls():
        root = f"http://{endpoint.host}:{endpoint.port}"
        client = openai.AsyncOpenAI(base_url=endpoint.base_url("nobody"), api_key="-", max_retries=0)  # fmt: skip
        with pytest.raises(openai.NotFoundError) as unknown:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])  # fmt: skip
        with pytest.raises(openai.NotFoundError):
            await client.models.list()
        async with aiohttp.ClientSession() as session:
            bad = await session.post(f"{root}/episodes/nobody/v1/chat/completions", data=b"{")
            route = await session.get(f"{root}/v2/nothing")
            return unknown.value, (bad.status, await bad.json()), (route.status, await route.json())  # fmt: skip

    unknown, bad, route = asyncio.run(calls())
    assert unknown.body["code"] == "no_episode" and "'nobody' is unknown or finished" in unknown.body["message"]  # fmt: skip
    assert bad[0] == 404  # an unknown episode first; a known one's bad JSON is below
    assert route[0] == 404 and route[1]["error"]["code"] == "route"


def test_bad_json_and_late_calls_of_an_episode_get_errors_not_hangs(tmp_path):
    task = _task(tmp_path, "two_calls")

    async def play():
        state = EpisodeState(task.train_prompts()[0], task.make_env())
        await reset(task, state)
        url = f"{state.env.endpoint.base_url(state.env.id)}/chat/completions"
        async with aiohttp.ClientSession() as session:
            bad = await session.post(url, data=b'{"messages": [')
            listed = await session.post(url, json=[1, 2])
            streamed = await session.post(url, json={"messages": [{"role": "user", "content": "a"}], "stream": True})  # fmt: skip
            answers = [(r.status, (await r.json())["error"]["code"]) for r in (bad, listed, streamed)]  # fmt: skip
            client = openai.AsyncOpenAI(base_url=state.env.endpoint.base_url(state.env.id), api_key="-")  # fmt: skip
            models = [m.id for m in (await client.models.list()).data]
            await step(task, state, _turn(task, "One."), "stop")
            await step(task, state, _turn(task, "Two."), "stop")
            late = await session.post(url, json={"messages": [{"role": "user", "content": "a"}]})
            answers.append((late.status, (await late.json())["error"]["code"]))
        return state, answers, models

    state, answers, models = asyncio.run(play())
    assert models == ["qwen2_5"]
    assert answers == [(400, "bad_json"), (400, "bad_json"), (400, "unsupported"), (404, "no_episode")]  # fmt: skip
    assert state.reward == 1.0 and state.done


def test_task_agent_must_name_an_async_function():
    with pytest.raises(UserInputError, match="task.agent: expected 'module:function'"):
        load_agent("no_colon")
    with pytest.raises(UserInputError, match="is not an async function"):
        load_agent(f"{AGENT}:_turn")
    assert load_agent(f"{AGENT}:two_calls") is two_calls


def test_an_agent_module_in_the_working_directory_is_found_as_an_envs_is(tmp_path, monkeypatch):
    """`task.agent=my_agent:solve` from the folder that holds my_agent.py (the README's
    example), without PYTHONPATH: the `dorarl` command's path does not hold that folder."""
    (tmp_path / "my_cwd_agent.py").write_text("async def solve(client, prompt):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    try:
        assert load_agent("my_cwd_agent:solve").__name__ == "solve"
        assert sys.path[-1] == str(tmp_path)  # after the installed packages: it shadows none
        with pytest.raises(UserInputError, match=r"task.agent: cannot import module 'nope_x' from the Python path or"):  # fmt: skip
            load_agent("nope_x:solve")
    finally:
        sys.modules.pop("my_cwd_agent", None)


def test_the_documented_agent_plays_as_written(tmp_path):
    page = (Path(__file__).parents[2] / "docs" / "environments.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "async def solve" in b)
    scope: dict = {}
    exec(compile(code, "docs/environments.md", "exec"), scope)
    task = _task(tmp_path, "two_calls")
    task._agent = scope["solve"]
    call = call_text("qwen2_5", "add", {"a": 1, "b": 2})
    state, shown = asyncio.run(_episode(task, [call, "It is 3"]))
    assert state.error is None and state.reward == 1.0 and len(state.turns) == 2
    assert "<tool_response>\n3\n</tool_response>" in task.tokenizer.decode(shown[1])


def test_an_agent_task_pickles_for_rays_workers_and_imports_its_agent_there(tmp_path):
    import pickle

    task = _task(tmp_path, "two_calls")
    assert task.agent is two_calls
    copy = pickle.loads(pickle.dumps(task))
    assert copy._agent is None and copy.agent is two_calls and copy.max_turns == 4


def test_the_endpoint_serves_until_the_run_closes_its_task(tmp_path):
    task = _task(tmp_path, "two_calls")
    url = f"http://{task.endpoint().host}:{task.endpoint().port}/v1/models"

    async def get():
        async with aiohttp.ClientSession() as session, session.get(url) as answer:
            return answer.status

    assert asyncio.run(get()) == 200
    task.close()
    with pytest.raises(aiohttp.ClientConnectionError):
        asyncio.run(get())


def test_hundreds_of_episodes_at_once_all_get_their_calls_answered_in_time(tmp_path):
    task = _task(tmp_path, "two_calls", timeout_s=10.0)

    async def play_all():
        return await asyncio.gather(*(_episode(task, ["One.", "Two."]) for _ in range(200)))

    states = [state for state, _ in asyncio.run(play_all())]
    assert [s.error for s in states if s.error] == []
    assert all(s.reward == 1.0 and len(s.turns) == 2 for s in states)


def test_closing_with_calls_in_flight_cancels_them_and_returns_at_once(tmp_path):
    task = _task(tmp_path, "two_calls")
    state = EpisodeState(task.train_prompts()[0], task.make_env())
    asyncio.run(reset(task, state))  # the agent's first call now waits for its turn
    started = time.monotonic()
    task.close()
    assert time.monotonic() - started < 5.0


def test_a_malformed_call_stays_in_the_content_beside_the_well_formed_ones(tmp_path):
    task = _task(tmp_path, "mixed_calls")
    SEEN.clear()
    bad = "<tool_call>{name: add}</tool_call>"
    text = "First. " + call_text("qwen2_5", "add", {"a": 1, "b": 2}) + " Then. " + bad
    state, _ = asyncio.run(_episode(task, [text]))
    assert state.error is None and state.turns[0].tool_errors == 1
    [message] = SEEN
    assert [c.function.name for c in message.tool_calls] == ["add"]
    assert message.content == "First.  Then. " + bad


def test_call_ids_are_unique_across_an_episodes_segments_and_name_their_tools(tmp_path):
    task = _task(tmp_path, "calls_across_segments")
    SEEN.clear()
    add = call_text("qwen2_5", "add", {"a": 1, "b": 2})
    lookup = call_text("qwen2_5", "lookup", {"word": "hi"})
    state, _ = asyncio.run(_episode(task, [add, lookup, "Done."]))
    assert state.error is None and state.env.segments == 3
    assert SEEN == [("call_0", "call_1")]
    # The third segment holds both exchanges: each tool message is named after its call.
    tools = [m for m in state.env.conversation.messages if m["role"] == "tool"]
    assert [(m["tool_call_id"], m["name"]) for m in tools] == [("call_0", "add"), ("call_1", "lookup")]  # fmt: skip


@pytest.mark.parametrize("host", ["::1", "0.0.0.0"])
def test_an_agent_plays_on_an_ipv6_host_and_off_loopback_with_the_runs_token(tmp_path, host):
    task = _task(tmp_path, "adds")
    task.host = host
    try:
        endpoint = task.endpoint()
        assert endpoint.needs_key == (host == "0.0.0.0")
        call = call_text("qwen2_5", "add", {"a": 1, "b": 2})
        state, _ = asyncio.run(_episode(task, [call, "It is 3."]))
        assert state.error is None and state.reward == 1.0
    finally:
        task.close()
