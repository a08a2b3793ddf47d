"""Chaos: a `dorarl train` run whose trainer and engines are killed mid-run (kill -9 of the
actors' processes, as the OOM killer or a lost machine would; at trainer.world_size=2 both
of its ranks in turn) and whose driver gets SIGINT ends with every invariant intact and one
consistent history; at world_size=2 the printed command then finishes it, and the history
holds both segments."""

import json
import os
import signal
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import psutil
import pytest
from test_ray_runtime import COMMON, _read

from dorarl.jobs.train import main as train_main
from dorarl.runtime.transfer.weights_config import WeightsConfig

pytestmark = pytest.mark.slow

STEPS = 16
KILLS = {
    1: {3: "ray::EngineWorker", 6: "ray::TrainerWorker", 9: "ray::EngineWorker"},
    2: {3: "ray::TrainerRank", 6: "ray::EngineWorker", 9: "ray::TrainerGroupWorker"},
}
"""By trainer.world_size: step rows in metrics.jsonl after which a process of that actor
class gets SIGKILL (with two ranks: rank 1, an engine, then rank 0)."""
RESTARTS = {1: (1, 2), 2: (2, 1)}
"""By trainer.world_size: the trainer's and the engines' restarts those kills make."""
INTERRUPT_AT = 12
"""Step rows after which the driver (this process) gets SIGINT, as from a Ctrl-C."""


def _actor_processes(title: str) -> list[psutil.Process]:
    """Live processes of this test's own Ray (descendants of this process) named `title`."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            name = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if name.startswith(title):
            found.append(proc)
    return found


class Killer(threading.Thread):
    """Follows metrics.jsonl and kills one actor process at each step of `KILLS`."""

    def __init__(self, out: Path, kills: dict[int, str]) -> None:
        super().__init__(daemon=True)
        self.out, self.kills, self.done, self.killed = out, kills, threading.Event(), []
        self.interrupted = False

    def run(self) -> None:
        pending = dict(self.kills)
        while (pending or not self.interrupted) and not self.done.is_set():
            steps = self._steps()
            for step in [s for s in pending if s <= steps]:
                victims = _actor_processes(pending[step])
                if victims:
                    victim = victims[step % len(victims)]
                    os.kill(victim.pid, signal.SIGKILL)
                    self.killed.append((step, pending.pop(step), victim.pid))
            if not pending and not self.interrupted and steps >= INTERRUPT_AT:
                os.kill(os.getpid(), signal.SIGINT)
                self.interrupted = True
            time.sleep(0.05)

    def _steps(self) -> int:
        path = self.out / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.usefixtures("shared_ray", "fresh_actors")  # no Ray of their own; no idle actor to kill
def test_a_run_survives_dead_workers_and_a_ctrl_c(tmp_path, tiny_model_dir, world_size, capfd):
    """On the default transport, collective, whose recovery has the more paths (replacements
    outside the group, a trainer replaying while engines ask it for versions); the object
    store's trainer and engine recovery are tested on both transports in their own files.
    With two trainer ranks, the death of either replaces the group."""
    assert WeightsConfig().resolve("cpu", "cpu") == "collective"
    out = tmp_path / "run"
    kills = KILLS[world_size]
    killer = Killer(out, kills)
    killer.start()
    try:
        # two engines: one serves while the other is replaced
        interrupted = train_main([f"model={tiny_model_dir}", *COMMON, "instances=2",
                                  "mode=dora", "K=1", f"steps={STEPS}", "checkpoint_every=4",
                                  f"trainer.world_size={world_size}",
                                  "ray.max_trainer_restarts=2", "--out", str(out)])  # fmt: skip
    finally:
        killer.done.set()
        killer.join()
    assert [kind for _, kind, _ in killer.killed] == [kills[s] for s in sorted(kills)]
    assert interrupted == 130 and killer.interrupted
    first = json.loads((out / "summary.json").read_text())
    assert first["stopped_by"] == "SIGINT" and first["stopped_at_version"] < STEPS
    trainer_restarts, engine_restarts = RESTARTS[world_size]
    assert first["trainer_restarts"] == trainer_restarts
    assert first["engine_restarts"] == engine_restarts
    assert first["replay_mismatches"] == 0 and first["dropped_total"] == 0
    assert first["resume_command"] == f"dorarl train resume={out}"
    # each death in one line with the cause Ray reports (SIGKILL leaves no exit status), on
    # the trace too; Ray's own paragraph on a dead worker stays off the terminal
    assert len(first["deaths"]) == trainer_restarts + engine_restarts
    assert all("no exit status (SIGKILL" in d["cause"] for d in first["deaths"])
    trace = json.loads((out / "trace.json").read_text())["traceEvents"]
    assert sum(" died: " in e["name"] for e in trace) == len(first["deaths"])
    terminal = capfd.readouterr()
    assert "A worker died" not in terminal.out + terminal.err

    if world_size == 1:
        # the stopped segment's history (resuming a one-rank trainer is the resume tests'
        # case; a resume after deaths is checked with two ranks below)
        _check_one_history(out, first["stopped_at_version"])
        return
    assert train_main([f"resume={out}"]) == 0  # the printed command, run in-process
    _check_one_history(out, STEPS)


def _check_one_history(out: Path, versions_done: int) -> None:
    """The run folder's history, across its segments: nothing dropped, Eq. 1, each
    trajectory consumed once, every step once and in order, and the checkpoint of its last
    version."""
    summary, trajectories, metrics, _ = _read(out)
    assert summary["dropped_total"] == 0
    # Eq. 1, each trajectory consumed once, one version per group, across both segments
    seen, versions = set(), defaultdict(set)
    for t in trajectories:
        key = (t["group_id"], t["sample_index"])
        assert key not in seen, f"trajectory {key} consumed twice"
        seen.add(key)
        assert 0 <= t["train_version"] - t["behavior_version"] <= 1, t
        versions[t["group_id"]].add(t["behavior_version"])
    assert all(len(v) == 1 for v in versions.values())
    # one history: every step once, in order, each with the groups its trajectories show
    assert [(m["step"], m["version"], m["new_version"]) for m in metrics] == [
        (s, s, s + 1) for s in range(versions_done)
    ]
    groups = Counter()
    for t in trajectories:
        groups[t["train_version"]] += t["sample_index"] == 0
    assert all(groups[m["version"]] == m["consumed_groups"] == 4 for m in metrics)
    assert len(trajectories) == 4 * 4 * versions_done
    newest = sorted((out / "checkpoints").glob("version_*"))[-1]
    state = json.loads((newest / "trainer_state.json").read_text())
    assert newest.name == f"version_{versions_done:05d}" and state["version"] == versions_done
