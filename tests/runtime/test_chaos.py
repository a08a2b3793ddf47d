"""Chaos: a `dorarl train` run whose trainer is killed once and engines twice (kill -9 of
the actors' processes, as the OOM killer or a lost machine would) ends with every
invariant intact and one consistent history in its files."""

import json
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
from test_ray_runtime import COMMON, _check_invariants, _read

from dorarl.jobs.train import main as train_main

pytestmark = pytest.mark.slow

STEPS = 10
KILLS = {2: "ray::EngineWorker", 4: "ray::TrainerWorker", 7: "ray::EngineWorker"}
"""Step rows in metrics.jsonl after which a process of that actor class gets SIGKILL."""


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

    def __init__(self, out: Path) -> None:
        super().__init__(daemon=True)
        self.out, self.done, self.killed = out, threading.Event(), []

    def run(self) -> None:
        pending = dict(KILLS)
        while pending and not self.done.is_set():
            steps = self._steps()
            for step in [s for s in pending if s <= steps]:
                victims = _actor_processes(pending[step])
                if victims:
                    victim = victims[step % len(victims)]
                    os.kill(victim.pid, signal.SIGKILL)
                    self.killed.append((step, pending.pop(step), victim.pid))
            time.sleep(0.05)

    def _steps(self) -> int:
        path = self.out / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0


def test_a_run_survives_a_dead_trainer_and_two_dead_engines(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    killer = Killer(out)
    killer.start()
    try:
        rc = train_main([f"model={tiny_model_dir}", *COMMON, "mode=dora", "K=1",
                         f"steps={STEPS}", "checkpoint_every=3", "--out", str(out)])  # fmt: skip
    finally:
        killer.done.set()
        killer.join()
    assert [kind for _, kind, _ in killer.killed] == [KILLS[s] for s in sorted(KILLS)]
    assert rc == 0
    summary, trajectories, metrics, _ = _read(out)
    assert summary["trainer_restarts"] == 1 and summary["engine_restarts"] == 2
    assert summary["replay_mismatches"] == 0
    _check_invariants(summary, trajectories, k=1)  # Eq. 1, once each, one version, 0 dropped
    # one history: every step once, in order, each with the groups its trajectories show
    assert [(m["step"], m["version"], m["new_version"]) for m in metrics] == [
        (s, s, s + 1) for s in range(STEPS)
    ]
    groups = Counter()
    for t in trajectories:
        groups[t["train_version"]] += t["sample_index"] == 0
    assert all(groups[m["version"]] == m["consumed_groups"] == 4 for m in metrics)
    assert summary["consumed"] == 4 * STEPS
    newest = sorted((out / "checkpoints").glob("version_*"))[-1]
    state = json.loads((newest / "trainer_state.json").read_text())
    assert newest.name == f"version_{STEPS:05d}" and state["version"] == STEPS
