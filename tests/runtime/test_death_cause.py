"""The one line a worker's death is recorded with, read from the errors Ray 2.60 raised when
an actor's process was killed (SIGKILL, SIGTERM), exited (`sys.exit(3)`), was killed by
Ray's memory monitor (RAY_memory_usage_threshold=0.02) or by `ray.kill`: ray_deaths.json
holds their texts as Ray wrote them (the memory monitor's list of the node's top processes
cut)."""

import json
from pathlib import Path

import pytest

from dorarl.runtime.death_cause import classify, death_cause

SAMPLES = json.loads((Path(__file__).parent / "ray_deaths.json").read_text())

EXPECTED = {
    "sigkill": "its process ended with no exit status (SIGKILL, the kernel's OOM killer or a "
    "crash; `dmesg` on its node tells them apart)",
    "sigterm": "exit code 1 after SIGTERM",
    "sys_exit_3": "exit code 3",
    "memory_monitor": "killed by Ray's memory monitor (node memory 4.9 GB > threshold 0.5 GB "
    "of 25.3 GB; the process held 0.04 GB)",
    "ray_kill": "killed by ray.kill",
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_real_death_of_ray_reads_as_its_cause_in_one_line(name):
    sample = SAMPLES[name]
    line = classify(sample["kind"], sample["text"])
    assert line == EXPECTED[name]
    assert "\n" not in line


def test_an_exit_code_of_a_signal_names_it_and_unknown_text_keeps_its_first_line():
    assert classify("ActorDiedError", "Worker exits with an exit code 137.") == (
        "exit code 137 (SIGKILL)"
    )
    assert classify("ActorUnavailableError", "\nconnection lost\nmore") == (
        "unreachable: connection lost"
    )
    assert classify("RankDied", "trainer rank 1 died\nTraceback") == (
        "RankDied: trainer rank 1 died"
    )


def test_a_death_seen_by_another_actor_reads_as_the_inner_death():
    class Wrapped(Exception):
        cause = RuntimeError("Worker exits unexpectedly. Worker exits with an exit code 3.")

    assert death_cause(Wrapped("ray::TrainerWorker.step()")) == "exit code 3"
