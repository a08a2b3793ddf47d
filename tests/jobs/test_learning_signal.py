"""Saying when learning cannot happen: zero-advantage steps and all-zero rewards warn once,
then every N steps; record.text puts prompt, answer and response text in trajectories."""

import json

from dorarl.data import Group, Sample
from dorarl.jobs.learning_signal import LearningSignal
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
    task = JsonlTask(data, tokenizer=tiny_model_dir, eval_fraction=0.0, max_new_tokens=8)
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
