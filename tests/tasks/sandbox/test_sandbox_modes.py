"""Where bubblewrap cannot isolate, the code task refuses to start unless the risk key is
set; the weaker sandbox (rlimits, process group, temp folder) still holds its limits."""

from __future__ import annotations

import os
import time
import uuid

import pytest
from sandbox_programs import processes_named, processes_with, settled

from dorarl.errors import UserInputError
from dorarl.tasks.sandbox import Limits, Sandbox, sandbox

LIMITS = Limits(cpu_s=2, wall_s=20.0, memory_mb=512, processes=16, output_bytes=1 << 16)
SHORT = Limits(cpu_s=2, wall_s=3.0, memory_mb=512, processes=16, output_bytes=1 << 16)


@pytest.fixture
def no_namespaces(monkeypatch):
    """A machine where bubblewrap is missing (the probe's answer, uncached)."""
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    sandbox.bwrap_problem.cache_clear()
    yield
    sandbox.bwrap_problem.cache_clear()


def test_bwrap_is_refused_where_it_cannot_isolate_naming_the_risk_key(no_namespaces):
    with pytest.raises(UserInputError) as refused:
        Sandbox("bwrap", LIMITS)
    message = str(refused.value)
    assert message.startswith("task.sandbox=bwrap: bubblewrap (bwrap) is not installed")
    assert "task.sandbox=unsafe_rlimits_only" in message and "\n" not in message


def test_an_unknown_sandbox_is_refused_naming_the_key():
    with pytest.raises(UserInputError, match="task.sandbox: unknown sandbox 'docker'"):
        Sandbox("docker", LIMITS)


def test_the_weak_sandbox_runs_where_bubblewrap_cannot(no_namespaces):
    result = Sandbox("unsafe_rlimits_only", LIMITS).run(
        "import os, sys\nprint(sys.stdin.read().upper(), os.listdir('.'))", "hello"
    )
    assert result.ok and result.stdout == "HELLO ['main.py']\n"


@pytest.fixture(scope="module")
def weak() -> Sandbox:
    return Sandbox("unsafe_rlimits_only", LIMITS)


def test_the_weak_sandbox_kills_a_sleeper_at_the_wall_time():
    start = time.monotonic()
    result = Sandbox("unsafe_rlimits_only", SHORT).run("import time\ntime.sleep(10**6)")
    assert result.killed_for == "wall time" and time.monotonic() - start < SHORT.wall_s + 2


def test_the_weak_sandbox_bounds_memory_and_output(weak):
    assert weak.run("block = bytearray(16 << 30)").cause() == "MemoryError"
    printed = weak.run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)")
    assert printed.killed_for == "output" and len(printed.stdout) <= LIMITS.output_bytes


def test_the_weak_sandbox_kills_a_child_left_in_its_group(weak):
    marker = f"orphan{uuid.uuid4().hex[:8]}"
    program = (
        "import subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)  # {marker}'])\n"
    )
    assert weak.run(program).ok
    assert settled(lambda: processes_with(marker)) == 0


def test_the_weak_sandbox_leaves_no_temp_folder(weak, tmp_path):
    result = weak.run("import os\nprint(os.getcwd())")
    assert result.ok and not os.path.exists(result.stdout.strip())


@pytest.mark.skipif(
    os.geteuid() != 0,
    reason="as root the weak sandbox runs as nobody, whose "
    "process limit is its own; as another user the limit counts all of theirs",
)
def test_the_weak_sandbox_bounds_a_fork_bomb_when_root():
    name = f"bomb{uuid.uuid4().hex[:8]}"
    program = (
        "import ctypes, os\n"
        f"ctypes.CDLL(None).prctl(15, b'{name}', 0, 0, 0)\n"
        "while True:\n"
        "    try:\n"
        "        os.fork()\n"
        "    except OSError:\n"
        "        pass\n"
    )
    assert Sandbox("unsafe_rlimits_only", SHORT).run(program).killed_for == "wall time"
    assert settled(lambda: processes_named(name)) == 0
