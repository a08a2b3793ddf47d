"""Thread plan: explicit per-actor threads, or the cores shared out with the trainer first."""

import subprocess
import sys

import pytest

from dorarl.config import ConfigError
from dorarl.runtime.threads import ENGINE_NICE, EVALUATOR_NICE, ThreadPlan, share_threads


def test_explicit_threads_go_to_every_actor_without_priorities():
    assert share_threads(3, instances=2, cpus=2) == ThreadPlan(3, 3, 3, 0, 0)


@pytest.mark.parametrize(
    ("cpus", "instances", "engine"), [(2, 2, 1), (2, 1, 2), (16, 3, 5), (1, 4, 1), (8, 0, 8)]
)
def test_automatic_plan_gives_the_trainer_every_core(cpus, instances, engine):
    plan = share_threads(0, instances=instances, cpus=cpus)
    assert plan == ThreadPlan(engine, cpus, 1, ENGINE_NICE, EVALUATOR_NICE)
    assert plan.engine * max(1, instances) <= max(cpus, instances)


def test_negative_threads_name_the_key():
    with pytest.raises(ConfigError, match="ray.threads_per_actor"):
        share_threads(-1, instances=2)


def test_apply_threads_lowers_every_thread_of_the_process():
    """In a child process: its torch threads and the niceness of all its threads."""
    code = (
        "import os, threading, time, torch\n"
        "from dorarl.runtime.threads import apply_threads\n"
        "t = threading.Thread(target=time.sleep, args=(2,)); t.start()\n"
        "before = os.getpriority(os.PRIO_PROCESS, t.native_id)\n"
        "apply_threads(1, 5)\n"
        "tids = [int(x) for x in os.listdir('/proc/self/task')]\n"
        "print(torch.get_num_threads(), before,"
        " os.getpriority(os.PRIO_PROCESS, t.native_id),"
        " min(os.getpriority(os.PRIO_PROCESS, tid) for tid in tids))\n"
    )
    threads, before, after, lowest = _printed_by(code)
    assert threads == 1
    assert after == min(19, before + 5) and lowest >= min(19, before + 5)


def test_lowering_again_keeps_the_niceness_a_new_process_would_have():
    """An actor built again in its process (an idle one, reused) lowers to where it was, not
    further: niceness is measured from the process's start."""
    code = (
        "import os\n"
        "from dorarl.runtime.threads import START_NICENESS, lower_priority\n"
        "lower_priority(5); once = os.getpriority(os.PRIO_PROCESS, 0)\n"
        "lower_priority(5); lower_priority(3); again = os.getpriority(os.PRIO_PROCESS, 0)\n"
        "print(START_NICENESS, once, again)\n"
    )
    start, once, again = _printed_by(code)
    assert once == again == min(19, start + 5)


def _printed_by(code: str) -> list[int]:
    """The numbers a child process running `code` prints (niceness is per thread on Linux)."""
    if sys.platform != "linux":
        pytest.skip("per-thread niceness is Linux's")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return [int(word) for word in out.stdout.split()]
