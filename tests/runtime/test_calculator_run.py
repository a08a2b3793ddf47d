"""The calculator task end to end on local Ray, both ways: as its ChatEnv and through the
OpenAI endpoint with its shipped agent, on a tiny model that calls the real tool (it learnt
one episode by heart), a few steps under dora K=1 with the audit kept."""

import json

import pytest

from dorarl.jobs.train import main as train_main

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]


def _run(model_dir, out, *keys: str) -> tuple[dict, list[dict], list[dict]]:
    args = [
        f"model={model_dir}", "task.name=calculator", "mode=dora", "K=1", "instances=2",
        "tbs=2", "rbs=4", "group_size=4", "sampling.max_new_tokens=64",
        "engine.max_model_len=2048", "eval.every=0", "eval.max_prompts=4", "progress=false",
        "checkpoint_every=off", *keys,
    ]  # fmt: skip
    assert train_main([*args, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    trajectories = [json.loads(line) for line in (out / "trajectories.jsonl").open()]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    return summary, trajectories, metrics


def _audit(summary: dict, trajectories: list[dict], metrics: list[dict], steps: int) -> None:
    assert summary["steps"] == steps and summary["dropped_total"] == 0
    # Every group dispatched was consumed once, or is still out when the last step ends.
    left = summary["in_flight_at_end"] + summary["queued_at_end"]
    assert summary["dispatched"] == summary["consumed"] + left
    assert summary["consumed"] * 4 == len(trajectories) and summary["env_errors"] == 0
    for t in trajectories:  # every episode on one version, within the staleness bound
        assert isinstance(t["behavior_version"], int), t
        assert 0 <= t["train_version"] - t["behavior_version"] <= 1
        assert t["response_tokens"] == sum(t["turn_tokens"]) + sum(t["observation_tokens"])
    # Episodes called the real tool and read its result: two turns, one call each time.
    called = [t for t in trajectories if t.get("tool_calls")]
    assert called and all(t["turns"] >= 2 for t in called)
    assert sum(m["tool_calls"] for m in metrics) == sum(t.get("tool_calls", 0) for t in trajectories)  # fmt: skip
    assert all(0.0 <= m["tool_use"] <= 1.0 for m in metrics) and any(m["tool_use"] for m in metrics)  # fmt: skip
    # The trainer sees the sampled tokens only: tool results and prompts are masked.
    assert sum(m["tokens"] for m in metrics) == sum(sum(t["turn_tokens"]) for t in trajectories)


def test_the_calculator_env_trains_on_ray_with_real_tool_calls(tmp_path, calculator_model_dir):
    summary, trajectories, metrics = _run(calculator_model_dir, tmp_path / "run", "steps=3")
    _audit(summary, trajectories, metrics, steps=3)
    evaluations = [json.loads(line) for line in (tmp_path / "run" / "evaluations.jsonl").open()]
    assert [e["version"] for e in evaluations] == [0, 3]
    assert all(0.0 <= e["tool_served"] <= e["tool_use"] <= 1.0 for e in evaluations)


def test_the_calculator_agent_trains_through_the_openai_endpoint(tmp_path, calculator_model_dir):
    agent = "task.agent=dorarl.tasks.calculator:solve"
    summary, trajectories, metrics = _run(calculator_model_dir, tmp_path / "run", "steps=4", agent)
    _audit(summary, trajectories, metrics, steps=4)
