"""A reward model end to end through `dorarl train`: on the built-in task beside the
verifier (its score a part of each reward, its batch times in metrics.jsonl, the summary
and the trace), and a classifier whose score is the verifier's learning as the verifier
does (the same curve within noise, every sampled response scored alike by both)."""

import json

import pytest
from reward_models import lean_towards, save_classifier, save_exact_classifier
from tiny_model import save_tiny_model

from dorarl.cli import main as cli_main
from dorarl.record.trace import REWARD_MODEL_PID, read_events
from dorarl.tasks.chartok import build_char_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]

SMALL = ["instances=2", "tbs=2", "rbs=4", "group_size=4", "engine.max_num_seqs=8",
         "eval.max_prompts=4", "eval.every=off", "progress=false"]  # fmt: skip


def _rows(path):
    return [json.loads(line) for line in path.open()]


def test_a_reward_model_scores_the_built_in_task_beside_the_verifier(tmp_path):
    out = tmp_path / "run"
    args = [f"task.reward_model={save_classifier(tmp_path / 'rm')}", "task.reward_mix=0.5",
            "steps=2", "sampling.max_new_tokens=16", *SMALL]  # fmt: skip
    assert cli_main(["train", *args, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["reward_errors"] == 0
    assert summary["reward_model_batches"] >= 1 and summary["reward_model_restarts"] == 0
    metrics = _rows(out / "metrics.jsonl")
    assert all(set(m["reward_parts"]) == {"verifier", "reward_model"} for m in metrics)
    timed = [m for m in metrics if "reward_model_s" in m]
    assert timed and all(m["reward_model_s"] > 0 and m["reward_model_batches"] >= 1 for m in timed)
    trajectories = _rows(out / "trajectories.jsonl")
    for row in trajectories:
        parts = row["reward_parts"]
        assert row["reward"] == pytest.approx(0.5 * parts["verifier"] + 0.5 * parts["reward_model"])
    assert len({row["reward_parts"]["reward_model"] for row in trajectories}) > 1
    events = [e for e in read_events(out / "trace.json") if e.get("pid") == REWARD_MODEL_PID]
    assert any(e["ph"] == "M" and e["args"].get("name") == "reward model" for e in events)
    assert sum(e["args"]["size"] for e in events if e["ph"] == "X") >= len(trajectories)


def test_a_reward_model_equal_to_the_verifier_learns_as_the_verifier_does(tmp_path):
    """One-character answers ("7"), sampled one token long, so the `exact` verifier's
    reward is whether the response is "7"; the classifier set by hand scores 1.0 exactly
    when the text's last character is "7" (tests/reward_models.py). The policy starts
    writing "7" a fifth of the time."""
    target = build_char_tokenizer().convert_tokens_to_ids("7")
    prompts = [f"{i}+{j}=" for i in range(10) for j in range(4)]
    policy = lean_towards(save_tiny_model(tmp_path / "policy"), target, prompts)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": "7"}) + "\n" for p in prompts))
    common = [f"model={policy}", "task.name=jsonl", f"task.path={data}", "task.reward=exact",
              "sampling.max_new_tokens=1", "instances=2", "tbs=4", "rbs=8", "group_size=8",
              "engine.max_num_seqs=16", "eval.every=off", "eval.max_prompts=4", "progress=false",
              "steps=16", "trainer.lr=3e-3"]  # fmt: skip
    model = [f"task.reward_model={save_exact_classifier(tmp_path / 'rm', target)}",
             "task.reward_mix=1"]  # fmt: skip
    curves = {}
    for name, extra in (("verifier", []), ("reward_model", model)):
        assert cli_main(["train", *common, *extra, "--out", str(tmp_path / name)]) == 0
        curves[name] = [m["reward_mean"] for m in _rows(tmp_path / name / "metrics.jsonl")]
    scored = _rows(tmp_path / "reward_model" / "trajectories.jsonl")
    assert scored and all(
        r["reward"] == r["reward_parts"]["reward_model"] == r["reward_parts"]["verifier"]
        for r in scored
    )  # the model's score is the verifier's on every sampled response, and the reward
    for curve in curves.values():
        first, last = sum(curve[:4]) / 4, sum(curve[-4:]) / 4
        assert first < 0.4 and last > first + 0.3, curve
    ends = [sum(c[-4:]) / 4 for c in curves.values()]
    assert abs(ends[0] - ends[1]) < 0.15, curves
