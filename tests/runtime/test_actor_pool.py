"""Idle actors kept between the runs of one process (dorarl.runtime.actor_pool): a run builds
its engines, trainer and evaluator again in the processes of the last run that finished,
even on another model (whose weights the fingerprint checks then compare); an idle actor
that died meanwhile is replaced by a new one; a run that did not finish keeps none; turning
keeping off kills the idle ones."""

from __future__ import annotations

import json
import re

import psutil
import pytest
import ray

from dorarl.errors import RunFailed
from dorarl.jobs.train import main as train_main
from dorarl.runtime.actor_pool import POOL, idle_actors, keep_idle_actors, kept_ray, pool_key
from dorarl.runtime.actors import TrainerSpec, spawn_trainer
from dorarl.runtime.workers.engine_worker import EngineWorker
from dorarl.trainer import TrainerConfig

SMALL = ["instances=1", "tbs=2", "rbs=4", "group_size=2", "engine.max_num_seqs=4",
         "eval.max_prompts=4", "progress=false", "steps=2", "mode=dora", "K=1"]  # fmt: skip
TITLES = ("ray::EngineWorker", "ray::TrainerWorker", "ray::EvalWorker")


def _actor_pids() -> set[int]:
    """Live processes of this test process's Ray that are our actors (idle or working)."""
    pids = set()
    for proc in psutil.Process().children(recursive=True):
        try:
            if " ".join(proc.cmdline()).startswith(TITLES):
                pids.add(proc.pid)
        except psutil.Error:
            continue
    return pids


def _train(model, out, *extra) -> str:
    assert train_main([f"model={model}", *SMALL, *extra, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dropped_total"] == 0 and summary["steps"] == 2
    ends = summary["queued_at_end"] + summary["in_flight_at_end"]
    assert summary["dispatched"] == summary["consumed"] + summary["filtered"] + ends
    return summary


def _actors_line(text: str) -> str:
    return next(line for line in text.splitlines() if "actors up in" in line)


@pytest.mark.slow
@pytest.mark.usefixtures("shared_ray", "fresh_actors")
def test_a_run_builds_again_in_the_last_runs_processes(
    tmp_path, tiny_model_dir, tiny_chat_model_dir, capsys
):
    keep_idle_actors()
    _train(tiny_model_dir, tmp_path / "first")
    first = _actor_pids()
    assert len(first) == 3 and idle_actors().size() == 3  # engine, trainer, evaluator
    capsys.readouterr()

    # another model: the rebuilt engines must hold its weights, or the fingerprints refuse
    _train(tiny_chat_model_dir, tmp_path / "second")
    told = _actors_line(capsys.readouterr().out)
    assert re.search(r"engine \(reused, model [\d.]+s\), trainer \(reused", told), told
    assert "evaluator (reused" in told and _actor_pids() == first

    # an idle engine killed meanwhile: the next run starts a new one in its place
    victim = psutil.Process(min(pid for pid in first if _title(pid).startswith(TITLES[0])))
    victim.kill()
    victim.wait(timeout=10)
    _train(tiny_model_dir, tmp_path / "third")
    told = _actors_line(capsys.readouterr().out)
    assert "engine (process " in told and "trainer (reused" in told, told
    assert victim.pid not in _actor_pids() and len(_actor_pids()) == 3

    keep_idle_actors(False)  # kills the idle ones
    assert idle_actors().size() == 0
    psutil.wait_procs([psutil.Process(pid) for pid in _actor_pids()], timeout=10)
    assert not _actor_pids()


@pytest.mark.slow
@pytest.mark.usefixtures("shared_ray", "fresh_actors")
def test_a_run_that_fails_keeps_no_actor(tmp_path, tiny_model_dir):
    """New actors (none is idle) cannot be up in 0.05 s: the run fails and kills them all."""
    keep_idle_actors()
    with pytest.raises(RunFailed, match="actors not up"):
        _train(tiny_model_dir, tmp_path / "run", "ray.startup_timeout_s=0.05")
    assert idle_actors().size() == 0
    psutil.wait_procs([psutil.Process(pid) for pid in _actor_pids()], timeout=10)
    assert not _actor_pids()


def _title(pid: int) -> str:
    return " ".join(psutil.Process(pid).cmdline())


def test_only_cpu_actors_outside_a_placement_group_are_kept():
    cpu = {"num_cpus": 0, "num_gpus": 0, "resources": {}}
    assert pool_key(EngineWorker, cpu) is not None
    assert pool_key(EngineWorker, cpu, "nice=10") != pool_key(EngineWorker, cpu, "nice=0")
    assert pool_key(EngineWorker, cpu | {"num_gpus": 0.5}) is None
    assert pool_key(EngineWorker, cpu | {"scheduling_strategy": object()}) is None


@pytest.mark.slow
def test_a_benchmarks_ray_keeps_actors_for_its_runs_and_goes_with_them(tiny_model_dir):
    """`kept_ray` (a benchmark's runs in a row) opens a Ray where none is joined, keeps the
    actors its runs give back, and at its end kills them and shuts its Ray down."""
    assert not ray.is_initialized()
    with kept_ray():
        trainer = spawn_trainer(TrainerSpec(str(tiny_model_dir), TrainerConfig()), pool=POOL)
        assert ray.get(trainer.version.remote(), timeout=120) == 0
        assert idle_actors().park([trainer]) == [] and idle_actors().size() == 1
    assert not ray.is_initialized() and not idle_actors().enabled
    assert idle_actors().size() == 0
