"""The calculator task: its prompts and held-out set, the calculator, the model's calls read,
the episodes' rewards and tool messages, its registration and keys; and one episode played
by a tiny model taught it, on a real engine, as a ChatEnv and through the OpenAI endpoint."""

import asyncio
import json
import re

import pytest
from chat_fixtures import chat_tokenizer, ids

from dorarl.config import load_config
from dorarl.data import Group, Sample
from dorarl.engine import Engine, EngineConfig, SamplingParams
from dorarl.errors import UserInputError
from dorarl.jobs.config import TrainConfig
from dorarl.jobs.evaluation import format_scores
from dorarl.jobs.workload import build_task
from dorarl.tasks import TASK_NAMES, evaluate, make_task
from dorarl.tasks.agent import AgentTask
from dorarl.tasks.calculator import (
    CALCULATOR_TOOL,
    SYSTEM_PROMPT,
    CalculatorConfig,
    CalculatorTask,
    calculate,
    served,
)
from dorarl.tasks.env import ToolError
from dorarl.tasks.episodes import EpisodeState, reset, run_episodes, step
from dorarl.tasks.tool_calls import HERMES, ToolCall, ToolCallError, Tools, parse_tool_calls
from dorarl.trainer.metrics import batch_metrics


def _call(expression: str, name: str = "calculator") -> str:
    """A call as SmolLM2-135M-Instruct writes it after the worked example."""
    arguments = json.dumps({"expression": expression})
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'


def _numbers(prompt) -> list[int]:
    return [int(w.strip("?.")) for w in prompt.text.split() if w.strip("?.").isdigit()]


def _expression(prompt) -> str:
    """The call that computes the prompt's answer from its two numbers."""
    a, b = _numbers(prompt)
    tried = [f"{a} + {b}", f"{a} - {b}", f"{b} - {a}", f"{a} * {b}"]
    return next(e for e in tried if calculate(e) == prompt.answer)


def _task(**fields) -> CalculatorTask:
    """On a ChatML tokenizer (SmolLM2's template) whose small vocabulary spells a call in
    about 40 tokens, so a turn gets 64."""
    config = CalculatorConfig(**{"n_train": 40, "n_eval": 10, **fields})
    return CalculatorTask(
        chat_tokenizer("chatml"), config=config, max_new_tokens=64, max_model_len=2048
    )


@pytest.fixture(scope="module")
def task() -> CalculatorTask:
    return _task()


# --- the calculator ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("347 * 28", "9716"),
        ("347*28=", "9716"),
        ("982 - 535", "447"),
        ("1,234 + 1", "1235"),
        ("12 × 3", "36"),
        ("12 x 3", "36"),
        ("(2 + 3) * -4", "-20"),
        ("7 / 2", "3.5"),
        ("1 / 3", "0.333333"),
        ("2.5 * 2", "5"),
    ],
)
def test_the_calculator_evaluates_arithmetic(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("2 ** 10", "only numbers, + - * /"),
        ("__import__('os').getcwd()", "only numbers, + - * /"),
        ("abc", "only numbers, + - * /"),
        ("2.95.6705", "cannot read '2.95.6705' as arithmetic"),
        ("", "cannot read '' as arithmetic"),
        ("1 / 0", "division by zero"),
        ("9" * 30, "too large"),
        ("1 + " * 60 + "1", "longer than 200 characters"),
    ],
)
def test_the_calculator_refuses_anything_else_in_one_line(expression, error):
    with pytest.raises(ToolError, match=re.escape(error)):
        calculate(expression)


def test_the_agents_calls_are_served_as_the_environment_serves_them():
    assert served('{"expression": "852 + 128"}') == "980"
    assert served('{"expression": 7}') == "7"
    assert served('{"a": 1}') == 'error: the arguments are {"expression": "<arithmetic>"}'
    assert served("{not json") == "error: the arguments are not JSON"
    assert served('{"expression": "1 / 0"}') == "error: division by zero"


# --- the model's calls ---------------------------------------------------------------------
def test_the_models_calls_are_read_in_the_hermes_format():
    tools = Tools.of([CALCULATOR_TOOL])
    [good] = parse_tool_calls(_call("852 + 128") + "<|im_end|>", HERMES, tools)
    assert isinstance(good, ToolCall) and good.arguments == {"expression": "852 + 128"}
    [unknown] = parse_tool_calls(_call("1 + 2", name="calc"), HERMES, tools)
    assert isinstance(unknown, ToolCallError) and "unknown tool 'calc'" in unknown.message
    [broken] = parse_tool_calls('<tool_call>{"name": "calculator", "arguments": {</tool_call>', HERMES, tools)  # fmt: skip
    assert isinstance(broken, ToolCallError) and "not JSON" in broken.message
    [cut] = parse_tool_calls('<tool_call>{"name": "calculator", "argu', HERMES, tools, "length")
    assert isinstance(cut, ToolCallError) and "length cap" in cut.message
    assert parse_tool_calls("The answer is 980.", HERMES, tools) == []


# --- episodes ------------------------------------------------------------------------------
def _end(task) -> int:
    return task.tokenizer.convert_tokens_to_ids("<|im_end|>")


async def _episode(task, turns: list[tuple[str, str]], prompt=None):
    """Play one episode, each turn sampling the next (text, how it ended); its state and
    what it was shown after each turn."""
    state = EpisodeState(prompt or task.train_prompts()[0], task.make_env())
    await reset(task, state)
    shown = []
    for text, finish in turns:
        turn_ids = ids(task.tokenizer, text) + ([_end(task)] if finish == "stop" else [])
        stop = "</tool_call>" if finish == "stop_string" else None
        nxt = await step(task, state, turn_ids, finish, stop)
        if nxt is None:
            break
        shown.append(task.tokenizer.decode(nxt))
    return state, shown


def _play(task, turns, prompt=None):
    return asyncio.run(_episode(task, turns, prompt))


def _question(task, op: str):
    return next(p for p in task.train_prompts() if f" {op} " in p.text)


def test_a_call_then_the_right_answer_scores_1_and_the_model_reads_the_result(task):
    prompt = _question(task, "times")
    answer = prompt.answer
    state, shown = _play(
        task,
        [(_call(_expression(prompt)), "stop_string"), (f"The answer is {answer}.", "stop")],
        prompt,
    )
    assert state.reward == 1.0 and state.end_reason == "env" and state.error is None
    assert [(t.tool_calls, t.tool_errors) for t in state.turns] == [(1, 0), (0, 0)]
    assert shown == [f"<|im_end|>\n<|im_start|>tool\n{answer}<|im_end|>\n<|im_start|>assistant\n"]


@pytest.mark.parametrize(
    ("final", "reward"),
    [
        ("The answer is {answer}.", 1.0),
        ("{answer}", 1.0),
        ("The answer is {wrong}.", 0.0),
        ("I cannot say.", 0.0),
        ("", 0.0),
        ("{question}", 0.0),  # the question restated: unevaluated arithmetic scores nothing
        ("It is {answer} or {wrong}.", 0.0),  # a hedge scores nothing
    ],
)
def test_only_the_final_answer_is_scored_strictly(task, final, reward):
    prompt = _question(task, "plus")
    a, b = _numbers(prompt)
    text = final.format(answer=prompt.answer, wrong=int(prompt.answer) + 1, question=f"{a} + {b}")
    state, _ = _play(task, [(text, "stop")], prompt)
    assert state.reward == reward and state.end_reason == "env"
    assert [(t.tool_calls, t.tool_errors) for t in state.turns] == [(0, 0)]


@pytest.mark.parametrize(
    ("reply", "told"),
    [
        (
            '<tool_call>{"name": "calculator", "arguments": {</tool_call>',
            "error: the call is not JSON",
        ),  # fmt: skip
        (_call("1 + 2", name="add"), "error: unknown tool 'add' (the tools: calculator)"),
        (
            '<tool_call>{"name": "calculator", "arguments": {"a": 1}}</tool_call>',
            'error: the arguments are {"expression": "<arithmetic>"}',
        ),  # fmt: skip
        (_call("2 ** 8"), "error: only numbers, + - * / and parentheses are calculated"),
    ],
)
def test_a_call_that_cannot_run_gets_a_tool_message_and_the_episode_goes_on(task, reply, told):
    prompt = task.train_prompts()[0]
    final = f"The answer is {prompt.answer}."
    state, shown = _play(task, [(reply, "stop_string"), (final, "stop")], prompt)
    assert shown[0].startswith("<|im_end|>\n<|im_start|>tool\n" + told)
    assert state.reward == 1.0 and state.end_reason == "env" and len(state.turns) == 2
    assert [(t.tool_calls, t.tool_errors) for t in state.turns] == [(1, 1), (0, 0)]


def test_a_call_cut_by_the_length_cap_is_not_run_and_the_episode_goes_on(task):
    state, shown = _play(task, [('<tool_call>{"name": "calc', "length"), ("9", "stop")])
    assert "the reply reached its length cap inside it" in shown[0] and len(state.turns) == 2
    assert state.turns[0].tool_errors == 1


def test_an_episode_that_only_calls_ends_at_max_turns_with_reward_0(task):
    state, shown = _play(task, [(_call("1 + 1"), "stop_string")] * 6)
    assert state.end_reason == "max_turns" and state.reward == 0.0
    assert len(state.turns) == task.max_turns == 4 and len(shown) == 3


def test_tool_use_reaches_the_step_metrics(task):
    called, _ = _play(task, [(_call("1 + 1"), "stop_string"), ("2", "stop")])
    answered, _ = _play(task, [("2", "stop")])
    samples = [Sample(0, i, 0, [1], [2], [0.0], [0], turns=s.turns) for i, s in enumerate([called, answered, answered, answered])]  # fmt: skip
    metrics = batch_metrics([Group(0, 0, 0, samples)], train_version=1)
    assert metrics["tool_use"] == 0.25 and metrics["tool_calls"] == 1.0


# --- prompts -------------------------------------------------------------------------------
def test_each_first_prompt_is_what_its_episode_renders(task):
    for prompt in task.train_prompts()[:8] + task.eval_prompts()[:4]:
        state = EpisodeState(prompt, task.make_env())
        assert asyncio.run(reset(task, state)) == prompt.prompt_ids
    text = task.tokenizer.decode(task.train_prompts()[0].prompt_ids)
    assert SYSTEM_PROMPT in text and "What is 214 times 37?" in text and "<tools>" in text


def test_without_the_demonstration_the_question_follows_the_system_prompt():
    bare = _task(demonstration=False)
    text = bare.tokenizer.decode(bare.train_prompts()[0].prompt_ids)
    assert "214 times 37" not in text and bare.train_prompts()[0].text in text


def test_prompts_are_deterministic_and_no_held_out_problem_is_trained_on():
    a, b = _task(n_train=600, n_eval=100), _task(n_train=600, n_eval=100)
    assert [p.text for p in a.train_prompts()] == [p.text for p in b.train_prompts()]

    def key(prompt):
        return (int(prompt.answer), *sorted(_numbers(prompt)))

    assert not {key(p) for p in a.eval_prompts()} & {key(p) for p in a.train_prompts()}
    for p in a.train_prompts():
        numbers = _numbers(p)
        assert int(p.answer) not in numbers and all(100 <= n <= 999 or 11 <= n <= 99 for n in numbers)  # fmt: skip


# --- registration and keys -----------------------------------------------------------------
def test_the_task_is_registered_and_its_keys_reach_it(calculator_model_dir):
    assert "calculator" in TASK_NAMES
    built = make_task("calculator", tokenizer=chat_tokenizer("chatml"), max_model_len=2048, n_train=5, n_eval=2)  # fmt: skip
    assert isinstance(built, CalculatorTask) and built.multi_turn and built.max_turns == 4
    keys = ["task.name=calculator", "task.ops=[multiply]", "task.min_value=200",
            "task.max_value=300", "task.max_turns=3", "sampling.max_new_tokens=30",
            "engine.max_model_len=2048"]  # fmt: skip
    task = build_task(load_config(TrainConfig, overrides=keys), str(calculator_model_dir))
    assert isinstance(task, CalculatorTask) and task.max_turns == 3 and task.max_new_tokens == 30
    assert task.stop_strings == ["</tool_call>"]
    assert all(" times " in p.text or "Multiply" in p.text or "product" in p.text for p in task.train_prompts())  # fmt: skip
    agent = build_task(load_config(TrainConfig, overrides=[*keys, "task.agent=dorarl.tasks.calculator:solve"]), str(calculator_model_dir))  # fmt: skip
    assert isinstance(agent, AgentTask) and agent.max_turns == 3


@pytest.mark.parametrize(
    ("keys", "error"),
    [
        (
            ["task.min_value=500", "task.max_value=400"],
            "task.min_value, max_value: need 0 <= min_value < max_value",
        ),  # fmt: skip
        (["task.min_factor=9", "task.max_factor=9"], "task.min_factor, max_factor"),
        (["task.ops=[divide]"], "task.ops: a non-empty list of add, subtract, multiply"),
        (["task.ops=[]"], "task.ops: a non-empty list"),
        (["task.max_turns=1"], "task.max_turns: a call and its answer need 2 turns"),
        (
            ["engine.max_model_len=300"],
            "exceed the context limit of 300 tokens; raise engine.max_model_len",
        ),  # fmt: skip
        (["task.min_value=1", "task.max_value=2", "task.ops=[add]"], "too few to hold some out"),
    ],
)
def test_a_bad_calculator_key_is_one_line_naming_it(calculator_model_dir, keys, error):
    config = load_config(TrainConfig, overrides=["task.name=calculator", "engine.max_model_len=2048", *keys])  # fmt: skip
    with pytest.raises(UserInputError, match=re.escape(error)) as caught:
        build_task(config, str(calculator_model_dir))
    assert "\n" not in str(caught.value)


# --- one episode on a real engine, both ways -----------------------------------------------
def _engine(folder) -> "_Counting":
    config = EngineConfig(
        max_num_seqs=2, block_size=16, num_blocks=128, max_model_len=2048, attention="torch",
        prefill_chunk_size=2048,  # the first prompt in one prefill
    )  # fmt: skip
    return _Counting(Engine.from_pretrained(folder, config))


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


def _greedy(task) -> SamplingParams:
    return SamplingParams(
        temperature=0.0,
        max_new_tokens=task.max_new_tokens,
        stop_token_ids=task.stop_token_ids,
        stop_strings=list(getattr(task, "stop_strings", [])),
        multi_turn=True,
    )


@pytest.fixture(scope="module")
def taught(calculator_model_dir) -> CalculatorTask:
    """The calculator task on the tiny model that learnt its first prompt's episode."""
    return CalculatorTask(calculator_model_dir, max_new_tokens=64, max_model_len=2048)


def test_the_agent_plays_the_episode_through_the_endpoint_and_its_second_call_prefills_only_the_new_tokens(  # fmt: skip
    taught, calculator_model_dir
):
    agent = AgentTask(taught, "dorarl.tasks.calculator:solve", max_turns=4, timeout_s=10.0)
    engine = _engine(calculator_model_dir)
    [(state, out)] = run_episodes(engine, agent, taught.train_prompts()[:1], _greedy(agent)).values()  # fmt: skip
    assert state.error is None and state.reward == 1.0 and state.end_reason == "env"
    assert [(t.tool_calls, t.tool_errors) for t in state.turns] == [(1, 0), (0, 0)]
    first, shown = len(out.prompt_ids), state.turns[0].observed
    assert state.env.conversation.token_ids == out.prompt_ids + out.output_ids
    # The second call's prompt is the whole conversation, but only its new messages' tokens
    # (and the stop token that ended the first reply, sampled but never fed) are prefilled.
    assert engine.prefills[0] == first
    assert sum(engine.prefills[1:]) == shown + 1 < first + state.turns[0].sampled + shown


def test_the_env_plays_the_same_episode_with_the_same_tokens_as_the_agent(
    taught, calculator_model_dir
):
    agent = AgentTask(taught, "dorarl.tasks.calculator:solve", max_turns=4, timeout_s=10.0)
    prompts = taught.train_prompts()[:1]
    [(by_agent, agent_out)] = run_episodes(_engine(calculator_model_dir), agent, prompts, _greedy(agent)).values()  # fmt: skip
    engine = _engine(calculator_model_dir)
    [(by_env, env_out)] = run_episodes(engine, taught, prompts, _greedy(taught)).values()
    assert by_env.reward == by_agent.reward == 1.0 and by_env.end_reason == "env"
    assert env_out.prompt_ids + env_out.output_ids == agent_out.prompt_ids + agent_out.output_ids
    assert by_env.turns[0].finish_reason == "stop_string"  # the env's call ends its turn
    assert sum(engine.prefills[1:]) == by_env.turns[0].observed + 1


def test_evaluation_counts_the_episodes_that_call_the_tool(taught, calculator_model_dir):
    prompts = taught.train_prompts()[:1]
    result = evaluate(_engine(calculator_model_dir), taught, prompts=prompts)
    assert (result["accuracy"], result["tool_use"], result["tool_served"]) == (1.0, 1.0, 1.0)
    assert format_scores(result) == "1.000 tool use 1.000"
