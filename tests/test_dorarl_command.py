"""The `dorarl` entry point: output whose reader left (`| head`) ends the command quietly."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dorarl.cli import main


def _into_closed_pipe(args: list[str]) -> subprocess.CompletedProcess:
    """Run `dorarl ARGS` with stdout a pipe whose reader is already gone (`| head` that left)."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([sys.executable, "-m", "dorarl.cli", *args], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120)  # fmt: skip
    finally:
        os.close(write)


def _run_folder(path: Path) -> Path:
    path.mkdir()
    rows = [{"step": i, "new_version": i + 1, "time_s": float(i + 1), "reward_mean": 0.1 * i,
             "eval_accuracy": 0.2, "eval_version": i} for i in range(3)]  # fmt: skip
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "summary.json").write_text(json.dumps({"mode": "sync", "K": 0, "dropped_total": 0}))
    return path


@pytest.mark.parametrize("command", ["help", "report compare"])
def test_a_reader_that_left_ends_the_command_quietly(tmp_path, command):
    if command == "help":
        args = ["--help"]
    else:
        run = _run_folder(tmp_path / "a")
        args = ["report", "compare", str(run), str(run), "--names", "a,b",
                "--out", str(tmp_path / "cmp.png")]  # fmt: skip
    done = _into_closed_pipe(args)
    assert (done.stderr, done.returncode) == ("", 1)  # no traceback


def test_a_broken_pipe_that_is_not_stdout_still_raises(monkeypatch):
    def broken(argv):
        raise BrokenPipeError("a worker's socket")

    monkeypatch.setattr("dorarl.cli._dispatch", broken)
    with pytest.raises(BrokenPipeError):
        main(["--help"])


def test_openmp_threads_wait_passively_unless_the_environment_says(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert main(["--help"]) == 0
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert main(["--help"]) == 0
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_the_entry_point_loads_no_torch_before_it_sets_the_wait_policy():
    code = "import sys, dorarl.cli; assert 'torch' not in sys.modules, 'torch loaded'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
