"""A user's agent end to end on local Ray: `task.agent` episodes through the real `openai`
client, trained for a few steps under dora, every episode on one version, the audit kept;
an agent that summarises its history mid-episode, its episodes of two segments; and agents
that overrun their bound while an engine dies under episodes in flight."""

import asyncio
import json
import os
import signal
import threading
from pathlib import Path

import psutil
import pytest
from test_ray_runtime import _check_invariants

from dorarl.jobs.train import main as train_main
from dorarl.tasks import openai_endpoint

pytestmark = pytest.mark.slow


async def asks_twice(client, prompt):
    """Two calls, the second extending the first; the reward says whether the first reply
    had an even length (so groups mix right and wrong)."""
    messages = [{"role": "user", "content": prompt.text}]
    first = await client.chat.completions.create(model="m", messages=messages)
    reply = first.choices[0].message
    messages += [reply.model_dump(), {"role": "user", "content": "Again."}]
    await client.chat.completions.create(model="m", messages=messages)
    return float(len(reply.content or "") % 2 == 0)


async def summarises(client, prompt):
    """Asks, then starts over from a summary of the exchange (a conversation that does not
    extend the first: segment 2), then extends that one; the reward as `asks_twice`'s."""
    messages = [{"role": "user", "content": prompt.text}]
    first = await client.chat.completions.create(model="m", messages=messages)
    said = first.choices[0].message.content or ""
    summary = [{"role": "user", "content": f"Earlier you said {said[:10]!r}. Go on."}]
    second = await client.chat.completions.create(model="m", messages=summary)
    summary += [second.choices[0].message.model_dump(), {"role": "user", "content": "Again."}]
    await client.chat.completions.create(model="m", messages=summary)
    return float(len(said) % 2 == 0)


_KILLED: list[int] = []  # the engine process an agent killed (once per test process)


def _kill_an_engine() -> int:
    """SIGKILL one engine actor's process of this process's Ray (as a lost machine would)."""
    for proc in psutil.Process().children(recursive=True):
        try:
            if " ".join(proc.cmdline()).startswith("ray::EngineWorker"):
                os.kill(proc.pid, signal.SIGKILL)
                return proc.pid
        except psutil.Error:
            continue
    raise AssertionError("no engine process to kill")


async def overruns_or_dies_mid_episode(client, prompt):
    """Two calls with a think between them. The run's first agent to get a reply kills an
    engine then (the episodes on it are mid-way: they start again, their agents cancelled);
    every fourth prompt's agent thinks past task.env_timeout_s (1 s): reward 0, counted."""
    messages = [{"role": "user", "content": prompt.text}]
    first = await client.chat.completions.create(model="m", messages=messages)
    if not _KILLED:
        _KILLED.append(_kill_an_engine())
    await asyncio.sleep(30.0 if prompt.prompt_id % 4 == 3 else 0.2)
    reply = first.choices[0].message
    messages += [reply.model_dump(), {"role": "user", "content": "Again."}]
    await client.chat.completions.create(model="m", messages=messages)
    return float(len(reply.content or "") % 2 == 0)


def _run(tmp_path, model_dir, monkeypatch, agent: str, steps: int, *extra: str):
    """Train `steps` steps with `agent`; the run's summary, trajectories and metrics rows,
    with the audit checked: nothing dropped, every dispatched group accounted for once."""
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)  # the agent's module, for Ray's workers too
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(20)))  # fmt: skip
    out = tmp_path / "run"
    args = [
        f"model={model_dir}", "task.name=jsonl", f"task.path={data}",
        f"task.agent={__name__}:{agent}", f"steps={steps}", "mode=dora", "K=1", "instances=2",
        "tbs=4", "rbs=8", "group_size=4", "sampling.max_new_tokens=8",
        "engine.max_model_len=256", "eval.every=off", "progress=false", *extra,
    ]  # fmt: skip
    assert train_main([*args, "--out", str(out)]) == 0
    assert "127.0.0.1" not in openai_endpoint._ENDPOINTS  # served for the run only
    summary = json.loads((out / "summary.json").read_text())
    trajectories = [json.loads(line) for line in (out / "trajectories.jsonl").open()]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert summary["steps"] == steps and summary["dropped_total"] == 0
    assert summary["consumed"] * 4 == len(trajectories)
    assert summary["dispatched"] == (
        summary["consumed"] + summary["in_flight_at_end"] + summary["queued_at_end"]
    )
    return trajectories, metrics


def test_an_agent_trains_through_the_openai_endpoint_and_keeps_the_audit(
    tmp_path, tiny_chat_model_dir, monkeypatch
):
    trajectories, metrics = _run(tmp_path, tiny_chat_model_dir, monkeypatch, "asks_twice", 4)
    for t in trajectories:  # every episode on one version, both its calls
        assert isinstance(t["behavior_version"], int), t
        assert 0 <= t["train_version"] - t["behavior_version"] <= 1
        assert t["turns"] == len(t["turn_tokens"]) == len(t["observation_tokens"]) == 2
        assert t["response_tokens"] == sum(t["turn_tokens"]) + sum(t["observation_tokens"])
        assert t["segments"] == 1
    assert {t["reward"] for t in trajectories} == {0.0, 1.0}
    # The trainer sees the sampled tokens only: the second call's new messages are masked.
    assert sum(m["tokens"] for m in metrics) == sum(sum(t["turn_tokens"]) for t in trajectories)
    assert sum(m["new_segments"] for m in metrics) == 0


def test_an_agent_that_summarises_its_history_trains_on_both_segments_of_each_episode(
    tmp_path, tiny_chat_model_dir, monkeypatch
):
    trajectories, metrics = _run(
        tmp_path, tiny_chat_model_dir, monkeypatch, "summarises", 3, "record.text=true"
    )
    for t in trajectories:  # every episode on one version, its three calls in two segments
        assert isinstance(t["behavior_version"], int), t
        assert 0 <= t["train_version"] - t["behavior_version"] <= 1
        assert (t["turns"], t["segments"]) == (3, 2)
        assert t["response_tokens"] == sum(t["turn_tokens"]) + sum(t["observation_tokens"])
        first, second, third = t["turn_texts"]
        assert "Earlier you said" in first["new_segment"] and first["observation"] == ""
        assert "Again." in second["observation"] and "new_segment" not in second
    assert {t["reward"] for t in trajectories} == {0.0, 1.0}
    # Every sampled token of both segments is trained on (their prompts masked), and each
    # step counts the segments its episodes opened.
    assert sum(m["tokens"] for m in metrics) == sum(sum(t["turn_tokens"]) for t in trajectories)
    assert [m["new_segments"] for m in metrics] == [4.0 * 4] * 3


@pytest.mark.usefixtures("shared_ray", "fresh_actors")  # it kills an engine by its title
def test_agents_that_overrun_or_whose_engine_dies_end_or_restart_their_episodes(
    tmp_path, tiny_chat_model_dir, monkeypatch
):
    """Every overrunning agent ends its episode (reward 0, counted in env_errors); the
    episodes of the killed engine start again with fresh agents, the old ones cancelled
    without stopping the driver; the run ends with its audit kept. A watchdog interrupts
    the run (SIGINT: rc 130, a failure here) should it ever hang."""
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(20)))  # fmt: skip
    out, ended = tmp_path / "run", threading.Event()
    watchdog = threading.Timer(300.0, lambda: ended.is_set() or os.kill(os.getpid(), signal.SIGINT))
    watchdog.start()
    _KILLED.clear()
    try:
        rc = train_main([
            f"model={tiny_chat_model_dir}", "task.name=jsonl", f"task.path={data}",
            f"task.agent={__name__}:overruns_or_dies_mid_episode", "task.env_timeout_s=1",
            "steps=3", "mode=dora", "K=1", "instances=2", "tbs=4", "rbs=8", "group_size=4",
            "sampling.max_new_tokens=8", "engine.max_model_len=256", "eval.every=off",
            "progress=false", "--out", str(out),
        ])  # fmt: skip
    finally:
        ended.set()
        watchdog.cancel()
    assert rc == 0 and _KILLED
    summary = json.loads((out / "summary.json").read_text())
    trajectories = [json.loads(line) for line in (out / "trajectories.jsonl").open()]
    assert summary["steps"] == 3 and summary["engine_restarts"] == 1
    assert summary["env_errors"] > 0  # the overrunning agents' episodes, each counted
    _check_invariants(summary, trajectories, k=1)
    overran = [t for t in trajectories if t["prompt_id"] % 4 == 3]
    assert all(t["reward"] == 0.0 for t in overran)
