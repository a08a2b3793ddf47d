"""The start-up lines of a run, and its bounded waits on actors: for them to come up at the
start, for the evaluations at the end."""

import json
import os
import re
import time

import pytest

from dorarl.errors import RunFailed
from dorarl.jobs.eval_actor import Evaluations
from dorarl.jobs.startup import StartupLines, breakdown_line, wait_for_actors
from dorarl.runtime.workers.startup import ActorStartup, StartupClock


def _lines() -> tuple[StartupLines, list[str], list[str]]:
    said, phases = [], []
    return StartupLines(said.append, phases.append), said, phases


def test_actors_built_again_in_kept_processes_are_told_as_reused():
    startup, said, _ = _lines()
    engines = [ActorStartup(0.0, 0.2, 0.1, reused=True), ActorStartup(4.5, 0.3)]
    trainer = [ActorStartup(0.0, 0.4, 0.3, reused=True)]
    startup.actors_up({"engine": engines, "trainer": trainer})
    assert said[0].endswith(
        "2 engines (1 reused, process 0.0-4.5s, model 0.2-0.3s), trainer (reused, model 0.4s)"
    )


def test_each_phase_is_one_line_with_the_seconds_since_the_start():
    startup, said, phases = _lines()
    startup.ray_up(None)
    engines = [ActorStartup(4.12, 0.31), ActorStartup(4.61, 0.33)]
    startup.actors_up({"engine": engines, "trainer": [ActorStartup(3.0, 1.2)], "evaluator": []})
    row = {"version": 0, "new_version": 1, "step_time_s": 2.5}
    startup.step(row)
    startup.step(dict(row, version=1, new_version=2))  # only the first step is told
    startup.evaluation(0, {"eval_s": 1.25}, "acc 0.500")
    startup.evaluation(2, {"eval_s": 1.0}, "acc 0.750")
    assert len(said) == 4 and all(line.startswith("start ") for line in said)
    assert "Ray up in" in said[0] and "(a local cluster)" in said[0]
    assert said[1].endswith(
        "2 engines (process 4.1-4.6s, model 0.3s), trainer (process 3.0s, model 1.2s)"
    )
    assert "first step done (v0 -> v1, 2.5s of training" in said[2]
    assert said[3].endswith("first evaluation (v0): acc 0.500, 1.2s")
    counted = StartupLines(said.append, phases.append)
    counted.evaluation(0, {"eval_s": 1.0, "n": 3.0}, "acc 0.333")
    assert said[-1].endswith("first evaluation (v0, n=3): acc 0.333, 1.0s")
    assert phases == ["starting the actors", "waiting for the first step"]


def test_a_joined_cluster_is_named():
    startup, said, _ = _lines()
    startup.ray_up("10.0.0.1:6379")
    assert "joined the cluster at 10.0.0.1:6379" in said[0]


def test_the_clock_counts_the_process_before_the_constructor():
    clock = StartupClock()
    time.sleep(0.05)
    times = clock.done()
    assert times.process_s > 0.1  # this test process started well before this line
    assert times.cpu_s > 0.1  # and had used CPU by then (its imports)
    assert 0.05 <= times.setup_s < times.process_s


@pytest.fixture(scope="module")
def local_ray():
    import ray

    from dorarl.runtime.local_ray import start_local_ray

    start_local_ray(num_cpus=1)
    yield ray
    ray.shutdown()


@pytest.mark.slow
def test_actors_not_up_in_time_fail_the_run_naming_them(local_ray):
    class SlowStart:  # defined here, so Ray ships it to the worker by value
        def __init__(self, seconds: float) -> None:
            clock = StartupClock()
            time.sleep(seconds)
            self._startup = clock.done()

        def startup(self) -> ActorStartup:
            return self._startup

    actor = local_ray.remote(num_cpus=0)(SlowStart)
    quick, slow = actor.remote(0.0), actor.remote(60.0)
    up = wait_for_actors({"engine": [quick]}, timeout_s=60)
    assert len(up["engine"]) == 1 and up["engine"][0].process_s > 0
    started = time.monotonic()
    with pytest.raises(RunFailed, match=r"not up after 2s \(ray.startup_timeout_s\): trainer0"):
        wait_for_actors({"engine": [quick], "trainer": [slow]}, timeout_s=2)
    assert time.monotonic() - started < 10


@pytest.mark.slow
def test_an_evaluation_not_done_in_time_is_left_out_and_the_run_goes_on(
    local_ray, tmp_path, caplog
):
    class Evaluator:  # v0 answers at once, v2 never within the bound
        def evaluate(self, weights, version: int, manifest=None) -> dict:
            if version:
                time.sleep(60)
            return {"version": version, "accuracy": 0.5, "n": 4}

        def up(self) -> bool:
            return True

    evaluator = local_ray.remote(num_cpus=0)(Evaluator).remote()
    # the bound times evaluations, not the actor's start (seconds on a loaded machine)
    assert local_ray.get(evaluator.up.remote(), timeout=120)
    record = tmp_path / "evaluations.jsonl"
    evals = Evaluations(evaluator, {0, 2}, 0, False, record, timeout_s=3)
    evals.offer(2, None, None)
    started = time.monotonic()
    results = evals.all()
    assert time.monotonic() - started < 15
    assert list(results) == [0] and len(record.read_text().splitlines()) == 1
    assert "evaluation of v2 not finished after 3s (eval.timeout_s): left out" in caplog.text


@pytest.mark.slow
def test_an_evaluator_that_dies_costs_its_evaluations_not_the_run(local_ray, tmp_path, caplog):
    """Ray's memory monitor may kill the evaluator: its evaluation is left out in one line,
    later versions go unevaluated, and nothing raises into the run."""

    class Evaluator:  # v0 answers at once, v2 takes the process down
        def evaluate(self, weights, version: int, manifest=None) -> dict:
            if version:
                os._exit(1)
            return {"version": version, "accuracy": 0.5, "n": 4}

    evaluator = local_ray.remote(num_cpus=0, max_restarts=0)(Evaluator).remote()
    record = tmp_path / "evaluations.jsonl"
    evals = Evaluations(evaluator, {0, 2, 4}, 0, False, record, timeout_s=30)
    deadline = time.monotonic() + 30
    # v0's reply must reach us before v2 takes the process down, or it dies with it
    while 0 not in evals.recorded and time.monotonic() < deadline:
        evals.finished()
        time.sleep(0.1)
    evals.offer(2, None, None)
    while 2 in evals.running and time.monotonic() < deadline:
        evals.finished()
        time.sleep(0.1)
    assert evals.gone and "evaluation of v2 failed, left out (ActorDiedError" in caplog.text
    evals.offer(4, None, None)  # nobody left to evaluate it: not asked
    assert list(evals.all()) == [0] and len(record.read_text().splitlines()) == 1


@pytest.mark.slow
def test_a_dead_evaluator_is_replaced_and_what_it_was_asked_is_asked_again(
    local_ray, tmp_path, caplog
):
    """The first evaluator dies on v2 with v4 queued behind it: one new evaluator (restart
    1 of 2) evaluates both, and every version is recorded once."""
    marker = tmp_path / "died"

    class Evaluator:  # the first to evaluate v2 takes its process down
        def evaluate(self, weights, version: int, manifest=None) -> dict:
            if version == 2 and not marker.exists():
                marker.touch()
                os._exit(1)
            return {"version": version, "accuracy": 0.5, "n": 4}

    def spawn():
        return local_ray.remote(num_cpus=0, max_restarts=0)(Evaluator).remote()

    record = tmp_path / "evaluations.jsonl"
    evals = Evaluations(spawn(), {0, 2, 4}, 0, False, record, timeout_s=60, respawn=spawn)
    evals.offer(2, None, None)
    evals.offer(4, None, None)
    results = evals.all()
    assert sorted(results) == [0, 2, 4] and not evals.gone and evals.restarts == 1
    assert sorted(json.loads(line)["version"] for line in record.open()) == [0, 2, 4]
    # v0's answer may still be on its way out of the process os._exit ends: then the line
    # names v0, which is asked again like v2 (the record above holds each version once)
    assert re.search(r"the evaluator died evaluating v[02] \(ActorDiedError", caplog.text)
    assert "(restart 1 of 2)" in caplog.text


def test_the_first_step_says_the_start_up_by_phase_and_names_the_slowest():
    said, phases = [], []
    startup = StartupLines(said.append, phases.append, {"imports": 4.0, "checks": 1.5})
    startup.ray_up(None)
    startup.phases["ray"] = 2.0  # the lap's own seconds are too short to order by
    startup.actors_up({"engine": [ActorStartup(9.5, 0.3, 2.0), ActorStartup(12.25, 0.4, 2.5)],
                       "trainer": [ActorStartup(6.0, 3.0, 4.0)], "evaluator": []})  # fmt: skip
    startup.phases["actors"] = 13.0
    startup.step({"version": 0, "new_version": 1, "step_time_s": 1.0})
    (line,) = [line for line in said if "first step done" in line]
    assert line.endswith("; " + breakdown_line(startup.record()))  # one line at the first step
    startup.phases["first_step"] = 1.5  # the lap's own seconds are too short to order by
    record = startup.record()
    cpu = record.pop("cpu_s")
    assert cpu["actors"] == 8.5 and 0 < cpu["driver"] < 600  # this test process's own
    assert record == {
        "total_s": 22.0,
        "phases_s": {"imports": 4.0, "checks": 1.5, "ray": 2.0, "actors": 13.0, "first_step": 1.5},
        "slowest": "actors",
        "actors": {
            "engine": {"process_s": 12.25, "model_s": 0.4},
            "trainer": {"process_s": 6.0, "model_s": 3.0},
        },
    }
    assert breakdown_line(record) == (
        "start-up 22.0s to the first step: imports 4.0s, checks 1.5s, Ray 2.0s, actors 13.0s, "
        "first step 1.5s; slowest: actors (engine process 12.2s)"
    )
    startup.step({"version": 1, "new_version": 2, "step_time_s": 1.0})
    assert sum("start-up " in line for line in said) == 1  # said once


def test_a_slow_phase_other_than_the_actors_is_named_alone():
    record = {"total_s": 9.0, "phases_s": {"imports": 6.0, "ray": 3.0}, "slowest": "imports",
              "actors": {}}  # fmt: skip
    assert breakdown_line(record).endswith("imports 6.0s, Ray 3.0s; slowest: imports")
