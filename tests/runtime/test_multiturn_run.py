"""Multi-turn episodes end to end on local Ray: multiturn_sum on the multi-turn base, with
env latency, a user env that fails, the audit and one version per episode."""

import asyncio
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


@pytest.mark.usefixtures("shared_ray")
def test_episodes_with_env_latency_keep_the_audit(tmp_path):
    summary, trajectories, metrics = _run(tmp_path, "steps=3", "task.env_latency_s=0.05", "K=1")
    _audit(summary, trajectories, k=1)
    turns = Counter(t["turns"] for t in trajectories)
    assert max(turns) >= 2 and sum(turns.values()) == len(trajectories)
    # The trainer sees the sampled tokens only: the observations are masked out.
    sampled = sum(sum(t["turn_tokens"]) for t in trajectories)
    assert sum(m["tokens"] for m in metrics) == sampled
    assert summary["eval"]


@pytest.mark.usefixtures("shared_ray")
def test_waiting_episodes_free_their_slots_and_nothing_is_lost(tmp_path):
    """Four slots an instance and a slow environment: episodes waiting for it free their
    decode slot, so an instance holds more requests than slots (at most twice, the default
    orchestrator.episode_overcommit), and the audit holds."""
    summary, trajectories, _ = _run(
        tmp_path, "steps=3", "task.env_latency_s=0.3", "K=1", "engine.max_num_seqs=4"
    )
    _audit(summary, trajectories, k=1)
    assert summary["env_waits"] >= sum(t["turns"] - 1 for t in trajectories) > 0
    assert 4 < summary["peak_requests_held"] <= 8
    assert 0 < summary["slot_utilization"] <= 1


class FlakyEnv(Env):
    """Its reset takes half a second (a sandbox starting); fails on every third episode's
    first step; the others end after one turn."""

    count = 0

    async def reset(self, prompt):
        await asyncio.sleep(0.5)
        FlakyEnv.count += 1
        self.fail = FlakyEnv.count % 3 == 0
        return ""

    async def step(self, response):
        if self.fail:
            raise RuntimeError("the tool is down")
        return EnvStep("", 1.0 if response else 0.0, True)


class DownEnv(Env):
    """Its tool is down: every episode's first step raises."""

    async def reset(self, prompt):
        return " go"

    async def step(self, response):
        raise RuntimeError("the tool is down")


def _env_on_path(monkeypatch) -> None:
    """As a user would: the env's module is on the path of the driver and of Ray's workers
    (the evaluator plays episodes too)."""
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)


def test_a_user_env_that_resets_slowly_and_raises_loses_nothing(tmp_path, monkeypatch, caplog):
    """Four slots an instance and resets of 0.5 s: the driver never waits for a reset, an
    episode whose reset is out frees its decode slot (an instance holds more requests than
    slots, at most twice) and reaches its engine when its reset answers; an episode whose
    step raises ends with reward 0, told once; and the audit holds."""
    _env_on_path(monkeypatch)
    summary, trajectories, metrics = _run(
        tmp_path, "steps=2", "eval.every=0", f"task.env={__name__}:FlakyEnv", "record.text=true",
        "K=1", "engine.max_num_seqs=4",
    )  # fmt: skip
    _audit(summary, trajectories, k=1)
    assert all(t["turns"] == 1 for t in trajectories)
    # every reset is still out at the poll after its dispatch: a wait; and a completed
    # episode's one turn is another (those in flight at the end may not have ended it)
    assert summary["env_waits"] >= 4 * (summary["dispatched"] + summary["completed"])
    assert 4 < summary["peak_requests_held"] <= 8
    failed = [t for t in trajectories if "error" in t]
    assert failed and all(
        t["error"] == "step raised RuntimeError: the tool is down" for t in failed
    )
    assert summary["env_errors"] >= len(failed) and summary["reward_errors"] == 0
    assert metrics[-1]["env_errors"] == summary["env_errors"]
    told = [r for r in caplog.records if "ended by its environment" in r.getMessage()]
    # One line for training's first, one for each evaluation's (v0, the last): not one each.
    assert 1 <= len(told) <= 3 < summary["env_errors"]
    for t in trajectories:  # the prompt as the model saw it, each turn's reply in full
        assert t["prompt"] and len(t["turn_texts"]) == 1 and t["turn_texts"][0]["reply"]


def test_an_env_that_fails_every_episode_of_a_step_stops_the_run_in_one_line(
    tmp_path, monkeypatch, capsys
):
    from dorarl.cli import main as cli_main

    _env_on_path(monkeypatch)
    out = tmp_path / "run"
    args = [*COMMON, "steps=3", "eval.every=0", f"task.env={__name__}:DownEnv", "--out", str(out)]
    assert cli_main(["train", *args]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dorarl:")]
    assert err == [err[0]] and err[0].startswith(
        "dorarl: error: task.env: the environment failed every episode of step 0"
    )
    assert "the first with: step raised RuntimeError: the tool is down" in err[0]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["env_errors"] >= 4 and summary["steps"] == 1
