"""multiturn_sum's environment, the Env plumbing (timeouts, errors, turn cap, user classes)
and greedy episodes through the engine on the shipped multi-turn base."""

import asyncio
import collections

import pytest

from dorarl.errors import UserInputError
from dorarl.tasks import make_task
from dorarl.tasks.env import Env, EnvStep, load_env_class
from dorarl.tasks.episodes import EpisodeState, reset, step
from dorarl.tasks.multiturn_sum import MultiTurnSumEnv, chunks
from dorarl.tasks.running_sum import running_answer


@pytest.fixture(scope="module")
def task():
    return make_task("multiturn_sum", seed=0)


def _play(task, prompt, answers):
    """Drive one episode with the given per-turn response texts; its state at the end."""
    state = EpisodeState(prompt, task.make_env())
    ids = asyncio.run(reset(task, state))
    observations = [task.tokenizer.decode(ids, skip_special_tokens=True)]
    for text in answers:
        turn = task.tokenizer(text, add_special_tokens=False)["input_ids"]
        nxt = asyncio.run(step(task, state, turn + task.stop_token_ids, "stop"))
        if nxt is None:
            break
        observations.append(task.tokenizer.decode(nxt))
    return state, observations


def _right_answers(task, prompt):
    parts = chunks(prompt, task.mt.max_chunk, task.mt.seed)
    items = [d for c in parts for d in c]
    full, out, offset = running_answer(items, 10), [], 0
    for c in parts:
        out.append(full[3 * offset : 3 * (offset + len(c))])
        offset += len(c)
    return out


def test_right_answers_earn_1_and_reveal_every_item_in_order(task):
    prompt = next(p for p in task.train_prompts() if len(chunks(p, 3, 0)) >= 3)
    answers = _right_answers(task, prompt)
    state, observations = _play(task, prompt, answers)
    assert state.reward == 1.0 and state.end_reason == "env" and len(state.turns) == len(answers)
    assert "".join(o.rstrip("=") for o in observations) == prompt.text.rstrip("=")


def test_a_wrong_answer_ends_the_episode_with_the_share_of_items_right_before_it(task):
    prompt = next(p for p in task.train_prompts() if len(chunks(p, 3, 0)) >= 3)
    parts = chunks(prompt, 3, 0)
    answers = _right_answers(task, prompt)
    answers[1] = answers[1][:-1] + str((int(answers[1][-1]) + 1) % 10)  # its last item wrong
    state, _ = _play(task, prompt, answers)
    right = len(parts[0]) + len(parts[1]) - 1
    assert state.reward == right / sum(map(len, parts)) and 0 < state.reward < 1
    assert len(state.turns) == 2 and state.end_reason == "env"
    strict = make_task("multiturn_sum", seed=0, partial_credit=False)  # all or nothing
    assert _play(strict, prompt, answers)[0].reward == 0.0


def test_turn_counts_are_long_tailed_and_the_chunking_is_fixed(task):
    turns = [len(chunks(p, 3, 0)) for p in task.train_prompts()]
    counts = collections.Counter(turns)
    assert counts[1] > 0 and sum(v for k, v in counts.items() if k >= 3) > 0.1 * len(turns)
    assert max(turns) >= 4 * sorted(turns)[len(turns) // 2]
    p = task.train_prompts()[7]
    assert chunks(p, 3, 0) == chunks(p, 3, 0) != chunks(p, 3, 1) or len(p.text) < 6


class _Raises(Env):
    async def reset(self, prompt):
        return "go"

    async def step(self, response):
        raise RuntimeError("tool down\nTraceback: more")


class _Slow(Env):
    async def reset(self, prompt):
        return "go"

    async def step(self, response):
        await asyncio.sleep(5)
        return EnvStep("", 1.0, True)


class _Forever(Env):
    async def reset(self, prompt):
        return "go"

    async def step(self, response):
        return EnvStep("more", 0.5, False)


def _episode(task, env, timeout_s=0.05, max_turns=3):
    task.env_timeout_s, task.max_turns = timeout_s, max_turns
    state = EpisodeState(task.train_prompts()[0], env)
    asyncio.run(reset(task, state))
    for _ in range(10):
        if asyncio.run(step(task, state, [5, 6], "stop")) is None:
            return state
    raise AssertionError("the episode did not end")


def test_env_errors_timeouts_and_the_turn_cap_end_an_episode_in_one_line(task):
    raised = _episode(task, _Raises())
    assert raised.end_reason == "env_error" and raised.reward == 0.0
    assert raised.error == "step raised RuntimeError: tool down" and "\n" not in raised.error
    slow = _episode(task, _Slow())
    assert slow.error == "step timed out after 0.05 s" and len(slow.turns) == 1
    capped = _episode(task, _Forever())
    assert capped.end_reason == "max_turns" and len(capped.turns) == 3 and capped.reward == 1.5


def test_a_user_env_class_is_found_or_refused_in_one_line():
    assert load_env_class("dorarl.tasks.multiturn_sum:MultiTurnSumEnv") is MultiTurnSumEnv
    for spec, message in [
        ("nocolon", "expected 'module:Class'"),
        ("no_such_module_xyz:Env", "cannot import module"),
        ("dorarl.tasks.env:EnvStep", "not a subclass"),
    ]:
        with pytest.raises(UserInputError, match=message) as info:
            load_env_class(spec)
        assert str(info.value).startswith("task.env: ") and "\n" not in str(info.value)


def test_the_shipped_multiturn_base_plays_episodes_through_the_engine(task):
    from dorarl.engine import Engine, EngineConfig
    from dorarl.tasks.assets import shipped_base_model
    from dorarl.tasks.evaluate import evaluate

    engine = Engine.from_pretrained(shipped_base_model("multiturn_sum"), EngineConfig())
    result = evaluate(engine, task, max_prompts=100)
    assert 0.05 <= result["accuracy"] <= 0.6  # room for RL, and something to reinforce
    assert result["mean_turns"] > 1.0 and result["reward_errors"] == 0
    assert not engine.has_unfinished() and engine.stats().kv_blocks_used == 0


def test_an_evaluation_counts_and_names_the_episodes_its_environment_failed():
    from dorarl.engine import Engine, EngineConfig
    from dorarl.tasks.assets import shipped_base_model
    from dorarl.tasks.evaluate import evaluate

    failing = make_task("multiturn_sum", seed=0)
    failing.make_env = _Raises  # every episode's first step raises
    engine = Engine.from_pretrained(shipped_base_model("multiturn_sum"), EngineConfig())
    result = evaluate(engine, failing, max_prompts=4)
    assert result["env_errors"] == result["n"] == 4 and result["accuracy"] == 0.0
    assert result["env_error"] == "step raised RuntimeError: tool down"


def test_each_turn_records_how_the_engine_ended_it(task):
    from dorarl.engine import Engine, EngineConfig, SamplingParams
    from dorarl.tasks.assets import shipped_base_model
    from dorarl.tasks.episodes import run_episodes

    engine = Engine.from_pretrained(shipped_base_model("multiturn_sum"), EngineConfig())
    prompts = task.train_prompts()[:8]
    for cap in (2, task.max_new_tokens):
        params = SamplingParams(
            temperature=0.0, max_new_tokens=cap, stop_token_ids=task.stop_token_ids, multi_turn=True
        )
        for state, out in run_episodes(engine, task, prompts, params).values():
            assert state.turns[-1].finish_reason == out.finish_reason
            for turn in state.turns:  # an answer needs more than 2 tokens, then a stop
                assert turn.finish_reason == ("length" if cap == 2 else "stop")
                assert turn.sampled <= cap
