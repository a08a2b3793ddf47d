"""An environment's answers as episodes read them: a step that is no step, a reward that is
no finite number, or nothing to show next ends the episode as the env's failure (reward 0,
one line), and the group's advantages stay finite."""

import asyncio
import json
import math

import pytest
from chat_fixtures import chat_tokenizer, ids

from dorarl.tasks.env import ChatEnv, ChatStep, Env, EnvStep
from dorarl.tasks.env_task import EnvTask
from dorarl.tasks.episodes import EpisodeState, reset, step
from dorarl.tasks.jsonl import JsonlTask
from dorarl.trainer.advantages import group_advantages


class _Answers(Env):
    """Answers each step with the next of `answers`; reset with `first`."""

    first: object = "go"
    answers: tuple = ()

    def __init__(self) -> None:
        self.turn = 0

    async def reset(self, prompt):
        return self.first

    async def step(self, response):
        self.turn += 1
        return self.answers[self.turn - 1]


class _ChatAnswers(ChatEnv):
    first: object = ()
    answers: tuple = ()

    def __init__(self) -> None:
        self.turn = 0

    async def reset(self, prompt):
        return self.first if self.first != () else [{"role": "user", "content": prompt.text}]

    async def step(self, reply, results):
        self.turn += 1
        return self.answers[self.turn - 1]


def _task(tmp_path, env_class) -> EnvTask:
    (tmp_path / "q.jsonl").write_text(json.dumps({"prompt": "What is 1 plus 2?", "answer": "3"}) + "\n")  # fmt: skip
    base = JsonlTask(tmp_path / "q.jsonl", tokenizer=chat_tokenizer("qwen2_5"), max_model_len=512)  # fmt: skip
    return EnvTask(base, env_class, max_turns=4, timeout_s=5.0)


def _play(task, turns: int = 3) -> EpisodeState:
    state = EpisodeState(task.train_prompts()[0], task.make_env())
    turn = ids(task.tokenizer, "Three.") + [task.tokenizer.convert_tokens_to_ids("<|im_end|>")]

    async def play():
        await reset(task, state)
        for _ in range(turns):
            if await step(task, state, turn, "stop") is None:
                return
        raise AssertionError("the episode did not end")

    asyncio.run(play())
    return state


def _env(base, **fields):
    return type("Env", (base,), fields)


BAD_STEPS = [
    (None, "step: got NoneType, expected EnvStep"),
    ((1.0, True), "step: got tuple, expected EnvStep"),
    (EnvStep("", float("nan"), True), "step's reward: got nan, expected a finite number"),
    (EnvStep("", float("inf"), True), "step's reward: got inf, expected a finite number"),
    (EnvStep("", "1.0", True), "step's reward: got str, expected a finite number"),
    (EnvStep("", None, True), "step's reward: got NoneType, expected a finite number"),
    (
        EnvStep("", 10**400, True),
        "step's reward: got int, too large for a float, expected a finite number",
    ),  # fmt: skip
    (EnvStep(None, 0.5, False), "step's observation: got NoneType, expected a str"),
]


@pytest.mark.parametrize(("answer", "error"), BAD_STEPS)
def test_a_bad_step_answer_ends_the_episode_as_an_env_error_with_reward_0(tmp_path, answer, error):
    task = _task(tmp_path, _env(_Answers, answers=(EnvStep("more", 0.5, False), answer)))
    state = _play(task)
    assert (state.error, state.reward, state.end_reason) == (error, 0.0, "env_error")
    assert len(state.turns) == 2


def test_rewards_whose_sum_overflows_end_the_episode_and_good_ones_add_up(tmp_path):
    big = EnvStep("more", 1e308, False)
    state = _play(_task(tmp_path, _env(_Answers, answers=(big, EnvStep("", 1e308, True)))))
    assert state.end_reason == "env_error" and "makes the episode's sum inf" in state.error
    fine = (EnvStep("more", 1, False), EnvStep("", True, True))  # an int and a bool are numbers
    state = _play(_task(tmp_path, _env(_Answers, answers=fine)))
    assert (state.error, state.reward, state.end_reason) == (None, 2.0, "env")


@pytest.mark.parametrize(
    ("env_class", "error"),
    [
        (_env(_Answers, first=None), "reset: got NoneType, expected a str"),
        (_env(_ChatAnswers, first=None), "reset: got NoneType, expected a list of messages"),
    ],
)
def test_a_reset_that_answers_no_text_or_messages_ends_the_episode(tmp_path, env_class, error):
    state = _play(_task(tmp_path, env_class))
    assert (state.error, state.reward, state.end_reason) == (error, 0.0, "env_error")


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (None, "step: got NoneType, expected ChatStep"),
        (EnvStep("", 1.0, True), "step: got EnvStep, expected ChatStep"),
        (ChatStep([], float("nan"), True), "step's reward: got nan, expected a finite number"),
        (ChatStep(None, 0.0, False), "step's messages: got NoneType, expected a list of messages"),
    ],
)
def test_a_chat_envs_bad_step_answer_ends_its_episode_too(tmp_path, answer, error):
    state = _play(_task(tmp_path, _env(_ChatAnswers, answers=(answer,))))
    assert (state.error, state.reward, state.end_reason) == (error, 0.0, "env_error")


def test_a_nan_reward_never_reaches_the_groups_advantages(tmp_path):
    nan = _play(_task(tmp_path, _env(_Answers, answers=(EnvStep("", float("nan"), True),))))
    won = _play(_task(tmp_path, _env(_Answers, answers=(EnvStep("", 1.0, True),))))
    advantages = group_advantages([nan.reward, won.reward])
    assert all(math.isfinite(a) for a in advantages) and advantages[0] < 0 < advantages[1]
