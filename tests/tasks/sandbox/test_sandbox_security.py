"""Programs "the model wrote" that try to do harm, run in the bubblewrap sandbox: each fails
to, and the run says why. Skipped, with the reason, where bubblewrap cannot make namespaces."""

from __future__ import annotations

import os
import socket
import time
import uuid

import pytest
from sandbox_programs import PeakCount, processes_named, processes_with, settled

from dorarl.tasks.sandbox import Limits, Sandbox, bwrap_problem

LIMITS = Limits(cpu_s=2, wall_s=20.0, memory_mb=512, processes=16, output_bytes=1 << 16)
"""The wall bound far off (a loaded machine starts an interpreter slowly), but where a test
waits for it: `SHORT`."""
SHORT = Limits(cpu_s=2, wall_s=3.0, memory_mb=512, processes=16, output_bytes=1 << 16)
SECRET = "hf_secret_token_0123456789"

pytestmark = pytest.mark.skipif(
    bwrap_problem() is not None, reason=f"no bubblewrap sandbox here: {bwrap_problem()}"
)


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox("bwrap", LIMITS)


@pytest.fixture(scope="module")
def short() -> Sandbox:
    return Sandbox("bwrap", SHORT)


@pytest.fixture
def run_folder(tmp_path):
    """A stand-in for a run's folder: its config.json holds a secret."""
    config = tmp_path / "config.json"
    config.write_text(f'{{"token": "{SECRET}"}}')
    (tmp_path / "canary.txt").write_text("keep me")
    return tmp_path


def test_a_program_reads_no_file_outside_its_folder(sandbox, run_folder):
    for path in (
        run_folder / "config.json",
        "/etc/shadow",
        os.path.expanduser("~/.bashrc"),
        __file__,
    ):
        result = sandbox.run(f"print(open({str(path)!r}).read())")
        assert not result.ok and SECRET not in result.stdout and result.stdout == ""
        assert "FileNotFoundError" in result.cause()
    listing = sandbox.run(f"import os; print(os.listdir({str(run_folder)!r}))")
    assert not listing.ok and "FileNotFoundError" in listing.cause()


def test_a_program_writes_nothing_outside_its_folder(sandbox, run_folder):
    config = run_folder / "config.json"
    before = config.read_text()
    program = (
        f"open({str(config)!r}, 'w').write('owned')\n"
        f"open({str(run_folder / 'new.txt')!r}, 'w').write('x')\n"
    )
    result = sandbox.run(program)
    assert not result.ok and "No such file or directory" in result.cause()
    for path in ("/usr/owned.txt", "/tmp/../usr/lib/owned.txt"):
        assert not sandbox.run(f"open({path!r}, 'w').write('x')").ok
    assert config.read_text() == before and not (run_folder / "new.txt").exists()
    assert sorted(p.name for p in run_folder.iterdir()) == ["canary.txt", "config.json"]


def test_a_program_changing_folder_and_deleting_files_deletes_none_of_the_hosts(
    sandbox, run_folder
):
    program = (
        "import os, shutil\n"
        f"for folder in ({str(run_folder)!r}, '/tmp', '/'):\n"
        "    try:\n"
        "        os.chdir(folder)\n"
        "        shutil.rmtree(folder)\n"
        "    except OSError as exc:\n"
        "        print(type(exc).__name__)\n"
        f"os.remove({str(run_folder / 'canary.txt')!r})\n"
    )
    result = sandbox.run(program)
    assert not result.ok and "No such file or directory" in result.cause()
    assert (run_folder / "canary.txt").read_text() == "keep me"
    assert (run_folder / "config.json").exists()


def test_a_program_reaches_no_local_server(sandbox):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        port = server.getsockname()[1]
        program = (
            "import socket\n"
            f"socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'hi')\n"
            "print('connected')\n"
        )
        result = sandbox.run(program)
        server.settimeout(0.5)
        with pytest.raises(TimeoutError):
            server.accept()  # nobody knocked
    assert not result.ok and "connected" not in result.stdout
    assert "ConnectionRefusedError" in result.cause()


def test_a_program_reaches_no_outside_address(sandbox):
    program = (
        "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)\nprint('connected')\n"
    )
    result = sandbox.run(program)
    assert not result.ok and "connected" not in result.stdout
    assert "Network is unreachable" in result.cause()
    dns = sandbox.run("import socket; print(socket.gethostbyname('example.com'))")
    assert not dns.ok and "gaierror" in dns.cause()


def test_a_fork_bomb_stays_within_the_process_limit_and_dies(short):
    name = f"bomb{uuid.uuid4().hex[:8]}"
    program = (
        "import ctypes, os\n"
        f"ctypes.CDLL(None).prctl(15, b'{name}', 0, 0, 0)\n"  # PR_SET_NAME: host can count us
        "while True:\n"
        "    try:\n"
        "        os.fork()\n"
        "    except OSError:\n"
        "        pass\n"
    )
    with PeakCount(lambda: processes_named(name)) as peak:
        result = short.run(program)
    assert result.killed_for == "wall time" and "timed out" in result.cause()
    assert 1 < peak.peak <= LIMITS.processes  # it forked, and the kernel stopped it there
    assert settled(lambda: processes_named(name)) == 0


def test_a_program_cannot_allocate_16_gib(sandbox):
    result = sandbox.run("block = bytearray(16 << 30)\nprint('allocated')")
    assert not result.ok and result.cause() == "MemoryError" and result.stdout == ""


def test_a_program_that_sleeps_forever_is_killed_at_the_wall_time(short):
    start = time.monotonic()
    result = short.run("import time\ntime.sleep(10**6)")
    assert result.killed_for == "wall time" and "timed out after 3.0 s" in result.cause()
    assert time.monotonic() - start < SHORT.wall_s + 2


def test_a_program_burning_cpu_is_stopped_at_the_cpu_limit():
    limits = Limits(cpu_s=1, wall_s=60.0, memory_mb=512)  # the wall bound far off, under load
    result = Sandbox("bwrap", limits).run("while True:\n    pass")
    assert result.cause() == "past the CPU-time limit" and result.killed_for is None


def test_printing_a_gigabyte_keeps_at_most_the_output_limit(sandbox):
    program = "import sys\nfor _ in range(1 << 14):\n    sys.stdout.write('x' * (1 << 16))\n"
    result = sandbox.run(program)  # stopped by the output limit, not the wall time
    assert result.killed_for == "output" and result.cause() == "printed past the output limit"
    assert len(result.stdout) <= LIMITS.output_bytes


def test_a_child_that_outlives_its_parent_is_killed(sandbox):
    marker = f"orphan{uuid.uuid4().hex[:8]}"
    program = (
        "import subprocess, sys\n"
        f"child = [sys.executable, '-c', 'import time; time.sleep(60)  # {marker}']\n"
        "subprocess.Popen(child, start_new_session=True)\n"
        "subprocess.Popen(child)\n"
        "print('parent done')\n"
    )
    result = sandbox.run(program)
    assert result.stdout == "parent done\n"
    assert settled(lambda: processes_with(marker)) == 0
