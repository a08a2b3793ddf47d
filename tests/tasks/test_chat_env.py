"""Chat environments: episodes of messages and tool calls on a chat template, their books
(tool calls and errors per turn, in the step metrics), and greedy episodes through the engine
whose tokens are the conversation's."""

import asyncio
import json
import re
from pathlib import Path

import pytest
import torch
from chat_fixtures import TOOLS, call_text, chat_tokenizer, ids
from transformers import Qwen2Config, Qwen2ForCausalLM

from dorarl.data import Group, Sample
from dorarl.engine import Engine, EngineConfig, SamplingParams
from dorarl.tasks.conversation import TemplateDrift
from dorarl.tasks.env import ChatEnv, ChatStep, ToolError, load_env_class
from dorarl.tasks.env_task import EnvTask
from dorarl.tasks.episodes import EpisodeState, reset, run_episodes, step
from dorarl.tasks.jsonl import JsonlTask
from dorarl.trainer.metrics import batch_metrics


class AddEnv(ChatEnv):
    """Asks a sum; serves `add` (refusing non-integers); the reply that says it wins."""

    tools = TOOLS
    stop_strings = ("</tool_call>",)

    def __init__(self) -> None:
        self.served: list[dict] = []

    async def reset(self, prompt):
        return [{"role": "user", "content": prompt.text}]

    async def call_tool(self, call):
        if call.name == "lookup":
            raise RuntimeError("the dictionary is down")
        if not all(isinstance(call.arguments.get(k), int) for k in ("a", "b")):
            raise ToolError("a and b must be integers")
        self.served.append(call.arguments)
        return {"sum": call.arguments["a"] + call.arguments["b"]}

    async def step(self, reply, results):
        if reply.calls:
            return ChatStep()
        return ChatStep(reward=float("42" in reply.text), done=True)


class GoOnEnv(AddEnv):
    """Asks for more after every reply, until the turn cap."""

    async def step(self, reply, results):
        return ChatStep([{"role": "user", "content": "Go on."}] if not reply.calls else [])


def _task(tmp_path, env: str) -> EnvTask:
    rows = [
        {"prompt": f"What is {a} plus {b}?", "answer": str(a + b)} for a, b in [(12, 30), (1, 2)]
    ]
    (tmp_path / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows * 5))
    base = JsonlTask(tmp_path / "sums.jsonl", tokenizer=chat_tokenizer("qwen2_5"), max_model_len=1024)  # fmt: skip
    return EnvTask(base, load_env_class(f"test_chat_env:{env}"), max_turns=4, timeout_s=5.0)


@pytest.fixture()
def task(tmp_path):
    return _task(tmp_path, "AddEnv")


def _turn(task, text: str) -> list[int]:
    return ids(task.tokenizer, text) + [task.tokenizer.convert_tokens_to_ids("<|im_end|>")]


def _play(task, prompt, texts):
    state = EpisodeState(prompt, task.make_env())
    shown = [asyncio.run(reset(task, state))]
    for text in texts:
        nxt = asyncio.run(step(task, state, _turn(task, text), "stop"))
        if nxt is None:
            break
        shown.append(nxt)
    return state, shown


def test_calls_are_served_in_order_and_bad_ones_answered_and_counted(task):
    prompt = task.train_prompts()[0]
    texts = [
        call_text("qwen2_5", "add", {"a": 12, "b": 30}) + call_text("qwen2_5", "mul", {}),
        "<tool_call>{not json}</tool_call>" + call_text("qwen2_5", "add", {"a": "x", "b": 1}),
        "The answer is 42.",
    ]
    state, shown = _play(task, prompt, texts)
    assert state.reward == 1.0 and state.end_reason == "env" and state.error is None
    assert [(t.tool_calls, t.tool_errors) for t in state.turns] == [(2, 1), (2, 2), (0, 0)]
    assert state.env.served == [{"a": 12, "b": 30}]
    first = task.tokenizer.decode(shown[1])
    assert '{"sum": 42}' in first and "unknown tool 'mul'" in first
    assert "error: a and b must be integers" in task.tokenizer.decode(shown[2])
    conv = state.conversation
    assert conv.token_ids[: len(shown[0])] == shown[0]  # the episode is the conversation's
    assert [m["role"] for m in conv.messages] == ["user", "assistant", "tool", "tool", "assistant", "tool", "tool"]  # fmt: skip


def test_a_tool_that_fails_otherwise_ends_the_episode_in_one_line(task):
    state, _ = _play(task, task.train_prompts()[0], [call_text("qwen2_5", "lookup", {"word": "hi"})])  # fmt: skip
    assert state.end_reason == "env_error" and state.reward == 0.0
    assert state.error == "call_tool lookup raised RuntimeError: the dictionary is down"


def test_tool_counts_reach_the_step_metrics(task):
    state, _ = _play(task, task.train_prompts()[0], [call_text("qwen2_5", "mul", {}), "42"])
    sample = Sample(0, 0, 0, [1], [2], [0.0], [0], turns=state.turns)
    metrics = batch_metrics([Group(0, 0, 0, [sample])], train_version=1)
    assert metrics["tool_calls"] == 1.0 and metrics["tool_call_errors"] == 1.0


def test_a_drifting_template_stops_the_run_not_the_episode(task):
    task.tokenizer.chat_template = "{% for m in messages %}{{ m.content | replace('x', 'y') }}|{% endfor %}"  # fmt: skip
    state = EpisodeState(task.train_prompts()[0], task.make_env())
    asyncio.run(reset(task, state))
    turn = ids(task.tokenizer, call_text("qwen2_5", "add", {"a": 1, "b": 2}) + " x")
    with pytest.raises(TemplateDrift, match="the model wrote 'x', the template 'y"):
        asyncio.run(step(task, state, turn, "length"))


def test_greedy_chat_episodes_through_the_engine_are_their_conversations(tmp_path):
    task = _task(tmp_path, "GoOnEnv")
    torch.manual_seed(0)
    vocab = len(task.tokenizer)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
    )).eval()  # fmt: skip
    config = EngineConfig(
        max_num_seqs=4, block_size=16, num_blocks=128, max_model_len=1024, attention="torch"
    )
    engine = Engine.from_hf_config(model.config, config, model.state_dict())
    engine.decode = lambda t: task.tokenizer.decode(t, skip_special_tokens=False)
    params = SamplingParams(
        temperature=0.0, max_new_tokens=12, stop_token_ids=task.stop_token_ids,
        stop_strings=task.stop_strings, multi_turn=True,
    )  # fmt: skip
    results = run_episodes(engine, task, task.train_prompts()[:2], params)
    for state, out in results.values():
        conv = state.conversation
        assert conv.token_ids == out.prompt_ids + out.output_ids
        assert sum(out.observed) == sum(t.observed for t in state.turns)
        assert len(state.turns) == conv.turns == 4 and state.end_reason == "max_turns"
        assert [m["role"] for m in conv.messages].count(
            "assistant"
        ) == 3  # the last is not rendered


def test_the_documented_environment_plays_as_written(tmp_path):
    page = (Path(__file__).parents[2] / "docs" / "environments.md").read_text()
    code = re.search(r"```python\n(.*?)```", page, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "docs/environments.md", "exec"), scope)
    task = _task(tmp_path, "AddEnv")
    task.env_class = scope["CalculatorEnv"]
    state, shown = _play(task, task.train_prompts()[0], [call_text("qwen2_5", "add", {"a": 12, "b": 30}), "It is 42"])  # fmt: skip
    assert state.reward == 1.0 and "<tool_response>\n42\n</tool_response>" in task.tokenizer.decode(shown[1])  # fmt: skip
