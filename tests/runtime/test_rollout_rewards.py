"""The rollout plan's samples scored by a user's reward: together, each bounded, its
named parts kept on the sample, a bad one counted in reward_errors."""

import json
import textwrap

from dorarl.data import Sample
from dorarl.driver import RequestSpec
from dorarl.engine import RequestOutput
from dorarl.runtime.rollout import RolloutPlan, RolloutSettings
from dorarl.tasks import make_task
from dorarl.tasks.chartok import build_char_tokenizer
from dorarl.tasks.user_rewards import Rewards, RewardSpec


def _task(workdir):
    rows = [{"prompt": "1+1=", "answer": "2"}]
    path = workdir / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return make_task(
        "jsonl", path=path, tokenizer=build_char_tokenizer(), max_model_len=64,
        max_new_tokens=16, eval_fraction=0.0,
    )  # fmt: skip


def _ids(task, text):
    return task.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_one_bad_sample_in_a_batch_leaves_the_others_and_is_counted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    workdir = tmp_path
    (workdir / "rw_some.py").write_text(textwrap.dedent("""
        import time

        def reward(row, response):
            if response.strip() == "h":
                time.sleep(3600)
            return {"match": float(response.strip() == row["answer"])}
    """))  # fmt: skip
    task = _task(workdir)
    task.user_rewards = Rewards([RewardSpec("rw_some:reward")], 0.3)
    plan = RolloutPlan(task, RolloutSettings())
    finished = [
        (RequestSpec(f"r{i}", 0, i, 0, 0, i), RequestOutput(f"r{i}", [1], _ids(task, text), [0.0], [0], "stop"))
        for i, text in enumerate(["2", "h", "3"])
    ]  # fmt: skip
    samples: list[Sample] = plan.samples(finished)
    assert [(s.reward, s.reward_parts) for s in samples] == [
        (1.0, {"match": 1.0}),
        (0.0, {}),
        (0.0, {"match": 0.0}),
    ]
    assert samples[1].reward_error.startswith("TimeoutError") and plan.reward_errors == 1
