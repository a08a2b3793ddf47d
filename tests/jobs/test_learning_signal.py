"""Saying when learning cannot happen: zero-advantage steps and all-zero rewards warn once,
then every N steps, a step whose every episode its environment failed stops the run;
record.text puts prompt, answer and response text in trajectories (an episode's by turn)."""

import json

import pytest

from dorarl.data import Group, Sample, Turn
from dorarl.jobs.learning_signal import EnvFailed, LearningSignal, check_episodes
from dorarl.jobs.workload import trajectory_texts
from dorarl.record.recorder import Recorder
from dorarl.tasks.jsonl import JsonlTask


def _row(step, zero_advantage=0.0, reward_mean=0.0, reward_std=0.0):
    return {"step": step, "zero_advantage_groups": zero_advantage,
            "reward_mean": reward_mean, "reward_std": reward_std}  # fmt: skip


def test_zero_advantage_steps_warn_once_then_every_n_steps(caplog):
    signal = LearningSignal(every=3, first_steps=100)
    warned = [s for s in range(10) if signal.observe(_row(s, 1.0, 0.5, 0.5))]
    assert warned == [0, 3, 6, 9]
    assert "zero advantage" in caplog.text and "record.text=true" in caplog.text
    mixed = LearningSignal(every=3, first_steps=100)
    assert not any(mixed.observe(_row(s, 0.5, 0.5, 0.5)) for s in range(10))


def test_with_record_text_on_the_warnings_say_where_the_texts_are(tmp_path):
    texts = tmp_path / "run" / "trajectories.jsonl"
    signal = LearningSignal(texts_at=texts, first_steps=1)
    warnings = signal.observe(_row(0, 1.0))  # zero advantage, and reward 0 from the first step
    assert len(warnings) == 2
    for warning in warnings:
        assert f"are in {texts}" in warning and "record.text=true" not in warning


def test_all_zero_rewards_warn_after_the_first_steps_until_a_reward_comes():
    signal = LearningSignal(every=4, first_steps=3)
    warnings = {s: signal.observe(_row(s, 0.5)) for s in range(9)}
    assert [s for s, w in warnings.items() if w] == [2, 6]
    assert "reward 0" in warnings[2][0]
    signal.observe(_row(9, 0.5, reward_mean=0.25, reward_std=0.4))
    assert not any(signal.observe(_row(s, 0.5)) for s in range(10, 30))


def test_record_text_writes_prompt_answer_and_response(tmp_path, tiny_model_dir):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": i + 1}) + "\n"
                            for i in range(5)))  # fmt: skip
    task = JsonlTask(data, tokenizer=tiny_model_dir, eval_fraction=0.0, max_new_tokens=8,
                     shuffle=False)  # fmt: skip
    prompt = task.train_prompts()[2]
    response = task.tokenizer(prompt.answer, add_special_tokens=False)["input_ids"]
    sample = Sample(0, 0, prompt_id=prompt.prompt_id, prompt_ids=prompt.prompt_ids,
                    response_ids=[*response, *task.stop_token_ids[:1], 9], versions=[0] * 3)  # fmt: skip
    rec = Recorder(tmp_path / "run", mode="dora", k=1, num_instances=1, slots_per_instance=1,
                   texts=trajectory_texts(task))  # fmt: skip
    assert rec.texts_path == tmp_path / "run" / "trajectories.jsonl"
    rec.consumed([Group(0, prompt.prompt_id, 0, [sample])], 0)
    rec.close(1.0)
    plain = Recorder(tmp_path / "plain", mode="dora", k=1, num_instances=1, slots_per_instance=1)
    assert plain.texts_path is None  # record.text=false: the warnings say how to turn it on
    (row,) = [json.loads(x) for x in (tmp_path / "run" / "trajectories.jsonl").open()]
    assert (row["prompt"], row["answer"], row["response"]) == ("2+1=", "3", "3")


def _episode(task, prompt, error=None, group_id=0):
    """A two-turn episode: reply, stop token, the environment's observation, reply."""
    ids = lambda text: task.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    first, observation, second = ids("7"), ids(" no, again:"), ids("3")
    stop = task.stop_token_ids[:1]
    response = [*first, *stop, *observation, *second]
    observed = [False] * (len(first) + 1) + [True] * len(observation) + [False] * len(second)
    turns = [Turn(len(first) + 1, len(observation), "stop"), Turn(len(second), 0, "length")]
    return Sample(group_id, 0, prompt_id=prompt.prompt_id, prompt_ids=[*prompt.prompt_ids, *ids(" go")],
                  response_ids=response, versions=[0] * len(response), reward_error=error,
                  observed=observed, turns=turns)  # fmt: skip


def test_record_text_writes_an_episodes_prompt_as_seen_and_every_turn_and_its_error(
    tmp_path, tiny_model_dir
):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "2+1=", "answer": 3}) + "\n")
    task = JsonlTask(data, tokenizer=tiny_model_dir, eval_fraction=0.0, max_new_tokens=8,
                     shuffle=False)  # fmt: skip
    (prompt,) = task.train_prompts()
    sample = _episode(task, prompt, error="step raised KeyError: 'x'")
    rec = Recorder(tmp_path / "run", mode="dora", k=1, num_instances=1, slots_per_instance=1,
                   texts=trajectory_texts(task))  # fmt: skip
    rec.consumed([Group(0, prompt.prompt_id, 0, [sample])], 0)
    rec.close(1.0)
    (row,) = [json.loads(x) for x in (tmp_path / "run" / "trajectories.jsonl").open()]
    # As the model saw it: its special tokens (the template's) and the first observation.
    assert row["prompt"] == task.tokenizer.decode(sample.prompt_ids, skip_special_tokens=False)
    assert row["prompt"].replace(" ", "").endswith("2+1=go")
    stop = task.tokenizer.decode(task.stop_token_ids[:1])
    replies = [(t["reply"].replace(" ", ""), t["observation"]) for t in row["turn_texts"]]
    assert replies == [(f"7{stop}", " no, again:"), ("3", "")]
    assert row["error"] == "step raised KeyError: 'x'" and row["turns"] == 2


def test_a_step_whose_every_episode_failed_stops_the_run_naming_the_error(tmp_path, tiny_model_dir):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "2+1=", "answer": 3}) + "\n")
    task = JsonlTask(data, tokenizer=tiny_model_dir, eval_fraction=0.0, max_new_tokens=8,
                     shuffle=False)  # fmt: skip
    (prompt,) = task.train_prompts()
    failed = [Group(g, 0, 0, [_episode(task, prompt, "reset raised OSError: down", g)])
              for g in range(2)]  # fmt: skip
    with pytest.raises(EnvFailed) as stopped:
        check_episodes(4, failed)
    assert str(stopped.value).startswith(
        "task.env: the environment failed every episode of step 4 (2 of 2), the first with: "
        "reset raised OSError: down"
    )
    check_episodes(4, [*failed, Group(2, 0, 0, [_episode(task, prompt)])])  # one went through
    single = Sample(0, 0, prompt_id=0, prompt_ids=[1], reward_error="reward raised")
    check_episodes(4, [Group(0, 0, 0, [single])])  # a reward function's: counted, not a stop
