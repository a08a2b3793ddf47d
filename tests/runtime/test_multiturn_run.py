"""Multi-turn episodes end to end on local Ray: multiturn_sum on the multi-turn base, with
env latency, a user env that fails, the audit and one version per episode."""

import json
import os
from collections import Counter
from pathlib import Path

import pytest

from dorarl.jobs.train import main as train_main
from dorarl.tasks.env import Env, EnvStep

pytestmark = pytest.mark.slow

COMMON = [
    "task.name=multiturn_sum",
    "instances=2",
    "tbs=4",
    "rbs=8",
    "group_size=4",
    "eval.max_prompts=20",
    "eval.every=2",
    "progress=false",
]


def _run(tmp_path, *overrides):
    out = tmp_path / "run"
    assert train_main([*COMMON, *overrides, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    trajectories = [json.loads(line) for line in (out / "trajectories.jsonl").open()]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    return summary, trajectories, metrics


def _audit(summary, trajectories, k):
    assert summary["dropped_total"] == 0
    assert summary["consumed"] * 4 == len(trajectories)
    assert summary["dispatched"] == (
        summary["consumed"] + summary["in_flight_at_end"] + summary["queued_at_end"]
    )
    assert len({(t["group_id"], t["sample_index"]) for t in trajectories}) == len(trajectories)
    for t in trajectories:  # every episode on one version, first turn to last
        assert isinstance(t["behavior_version"], int), t
        assert 0 <= t["train_version"] - t["behavior_version"] <= k
        assert t["turns"] == len(t["turn_tokens"]) == len(t["observation_tokens"]) >= 1
        assert t["response_tokens"] == sum(t["turn_tokens"]) + sum(t["observation_tokens"])


def test_episodes_with_env_latency_keep_the_audit(tmp_path):
    summary, trajectories, metrics = _run(tmp_path, "steps=3", "task.env_latency_s=0.05", "K=1")
    _audit(summary, trajectories, k=1)
    turns = Counter(t["turns"] for t in trajectories)
    assert max(turns) >= 2 and sum(turns.values()) == len(trajectories)
    # The trainer sees the sampled tokens only: the observations are masked out.
    sampled = sum(sum(t["turn_tokens"]) for t in trajectories)
    assert sum(m["tokens"] for m in metrics) == sampled
    assert summary["eval"]


class FlakyEnv(Env):
    """Fails on every third episode's first step; the others end after one turn."""

    count = 0

    async def reset(self, prompt):
        FlakyEnv.count += 1
        self.fail = FlakyEnv.count % 3 == 0
        return ""

    async def step(self, response):
        if self.fail:
            raise RuntimeError("the tool is down")
        return EnvStep("", 1.0 if response else 0.0, True)


def test_a_user_env_that_raises_ends_its_episodes_and_nothing_is_lost(tmp_path, monkeypatch):
    # As a user would: the env's module is on the path of the driver and of Ray's workers
    # (the evaluator plays episodes too).
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)
    summary, trajectories, _ = _run(
        tmp_path, "steps=2", "eval.every=0", f"task.env={__name__}:FlakyEnv"
    )
    _audit(summary, trajectories, k=1)
    assert all(t["turns"] == 1 for t in trajectories)
