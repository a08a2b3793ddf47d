"""`task.agent` episodes in the Ray runtime's books (dorarl.runtime.episodes), no Ray needed:
an agent the driver stops (its episode finished, or started again after its engine died)
or one that only re-asks ends its episode (reward 0, one line, counted) and never raises
in the driver; whatever escapes an episode's coroutine ends that episode alone."""

import asyncio
import json
import time

import openai
import pytest
from episodes_testlib import answers

from dorarl.engine import RequestOutput
from dorarl.runtime.episodes import Episodes
from dorarl.tasks.agent import AgentTask
from dorarl.tasks.conversation import TemplateDrift
from dorarl.tasks.episodes import EpisodeSource
from dorarl.tasks.jsonl import JsonlTask

GRACE_S = 1.0  # the driver's bound past env_timeout_s (5 s in a run)


async def sleeps_between_calls(client, prompt):
    """One call, then a long think (shorter than its timeout) before the next."""
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    await asyncio.sleep(3600)


async def re_asks(client, prompt):
    """One call, then calls with nothing new after the reply again and again, each refused
    (HTTP 400): it never returns."""
    messages = [{"role": "user", "content": "hi"}]
    reply = await client.chat.completions.create(model="m", messages=messages)
    messages.append(reply.choices[0].message.model_dump())
    while True:
        try:
            await client.chat.completions.create(model="m", messages=messages)
        except openai.BadRequestError:
            await asyncio.sleep(0.01)


def _task(tmp_path, tokenizer, agent: str, timeout_s: float) -> AgentTask:
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    base = JsonlTask(tmp_path / "p.jsonl", tokenizer=tokenizer, max_new_tokens=8, max_model_len=256)
    return AgentTask(base, f"{__name__}:{agent}", 4, timeout_s)


def _drain(episodes, for_s):
    """Poll as the runtime does for `for_s`: every answer that came (none may raise)."""
    got, deadline = [], time.monotonic() + for_s
    while time.monotonic() < deadline:
        got += episodes.ready() + episodes.overdue()
        time.sleep(0.01)
    return got


def _turn_ends(episodes, task, rid):
    end = task.tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = RequestOutput(rid, [1], [5, end], [0.0, 0.0], [0, 0], "stop", waits_env=True)
    episodes.turn_ended(rid, out)


def _thinking(tmp_path, tokenizer):
    """An episode whose agent got its first reply and now thinks: its step is out."""
    task = _task(tmp_path, tokenizer, "sleeps_between_calls", timeout_s=30.0)
    episodes = Episodes(task, grace_s=GRACE_S)
    prompt = task.train_prompts()[0]
    episodes.begin([("r0", prompt)])
    assert isinstance(answers(episodes, 1, 10.0)["r0"], list)
    _turn_ends(episodes, task, "r0")
    time.sleep(0.2)  # the reply is out; the agent sleeps
    return task, episodes, prompt


def test_an_episode_finished_while_its_agent_thinks_never_raises_in_the_driver(
    tmp_path, chat_tokenizer
):
    task, episodes, _ = _thinking(tmp_path, chat_tokenizer)
    state, _ = episodes.finish("r0", "env_error")  # as after its overdue bound
    assert _drain(episodes, 0.5) == []  # the cancelled agent's step: dropped, not raised
    assert episodes.pending == 0 and state.env._agent.cancelled()
    task.close()


def test_an_episode_started_again_while_its_agent_thinks_plays_its_new_agent(
    tmp_path, chat_tokenizer
):
    """The engine died: the episode begins again, its old agent cancelled; the old step's
    answer is dropped and the new reset's comes."""
    task, episodes, prompt = _thinking(tmp_path, chat_tokenizer)
    old = episodes._live["r0"].state
    episodes.begin([("r0", prompt)])
    answers = _drain(episodes, 1.0)
    assert [rid for rid, _ in answers] == ["r0"] and isinstance(answers[0][1], list)
    assert episodes.pending == 0 and old.env._agent.cancelled()
    assert old.error == "the agent was cancelled: the episode ended" and old.reward == 0.0
    task.close()


def test_an_agent_that_only_re_asks_times_out_on_its_own_bound_not_the_drivers(
    tmp_path, chat_tokenizer
):
    task = _task(tmp_path, chat_tokenizer, "re_asks", timeout_s=0.5)
    episodes = Episodes(task, grace_s=GRACE_S)
    episodes.begin([("r0", task.train_prompts()[0])])
    answers(episodes, 1, 10.0)
    _turn_ends(episodes, task, "r0")
    started = time.monotonic()
    assert answers(episodes, 1, 0.5 + GRACE_S + 2) == {"r0": None}
    assert time.monotonic() - started < 0.5 + GRACE_S  # before the driver's overdue bound
    state, _ = episodes.finish("r0")
    assert state.error == "the agent timed out after 0.5 s (no call, no return)"
    assert state.reward == 0.0 and episodes.env_errors == 1 and state.env.refused > 1
    assert episodes.counts["agent_refused_calls"] == state.env.refused  # the run's sum
    assert _drain(episodes, 0.3) == []
    task.close()


class _Broken(EpisodeSource):
    """An episode source whose step raises what it names (a bug past its own catch)."""

    raised: BaseException = RuntimeError("a bug")

    async def first_ids(self, task, episode):
        return [1, 2]

    async def next_ids(self, task, episode, turn_ids, finish_reason, stop_string):
        raise self.raised

    def close(self):
        pass


class _BrokenTask:
    max_turns, env_timeout_s, multi_turn = 4, 5.0, True

    def make_env(self):
        return _Broken()

    def episode_prompt_ids(self, prompt):
        return [1]


@pytest.mark.parametrize(
    ("raised", "error"),
    [
        (RuntimeError("a bug\nmore"), "the env call raised RuntimeError: a bug"),
        (asyncio.CancelledError(), "the env call raised CancelledError: the call was cancelled"),
    ],
)
def test_a_step_that_raises_past_its_coroutine_ends_its_episode_counted(raised, error):
    _Broken.raised = raised
    episodes = Episodes(_BrokenTask(), grace_s=GRACE_S)
    episodes.begin([("r0", None)])
    assert answers(episodes, 1, 5.0) == {"r0": [1, 2]}
    episodes.turn_ended("r0", RequestOutput("r0", [1], [2], [0.0], [0], "stop", waits_env=True))
    assert answers(episodes, 1, 5.0) == {"r0": None}
    state, _ = episodes.finish("r0")
    assert (state.error, state.reward, state.end_reason) == (error, 0.0, "env_error")
    assert episodes.env_errors == 1 and episodes.pending == 0


def test_a_chat_templates_drift_still_stops_the_run():
    _Broken.raised = TemplateDrift("chat template x: it renders again otherwise")
    episodes = Episodes(_BrokenTask(), grace_s=GRACE_S)
    episodes.begin([("r0", None)])
    answers(episodes, 1, 5.0)
    episodes.turn_ended("r0", RequestOutput("r0", [1], [2], [0.0], [0], "stop", waits_env=True))
    with pytest.raises(TemplateDrift, match="renders again"):
        _drain(episodes, 1.0)
