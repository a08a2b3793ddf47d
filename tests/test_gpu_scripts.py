"""The GPU check scripts fit the lent machine: each is one device command whose stage caps
add up to at most 480 s (a command may run 600 s, the machine is lent 15 minutes in all,
start-up included), every command in them runs under a cap, and a cap really stops a stage."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
CHECKS = ("gpu_check_1.sh", "gpu_check_2.sh", "gpu_check_vllm.sh")
LIMIT_S = 480
STAGE = re.compile(r"^stage (\d+) ")
TIMEOUT = re.compile(r"\btimeout (?:-\S+ )*(\d+)\b")  # a cap given outside a stage
RUNS = re.compile(r"\b(python3?|pytest|dorarl|nvidia-smi|torchrun|ray)\b")


def logical_lines(path: Path) -> list[str]:
    """The script's commands, continuation lines joined, comments and blanks dropped."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    return [s for line in text.splitlines() if (s := line.strip()) and not s.startswith("#")]


def stage_caps(path: Path) -> list[int]:
    """Every time cap of the script: its stages', and any bare `timeout N`."""
    caps = []
    for line in logical_lines(path):
        stage = STAGE.match(line)
        caps += [int(stage.group(1))] if stage else [int(n) for n in TIMEOUT.findall(line)]
    return caps


@pytest.mark.parametrize("script", CHECKS)
def test_a_checks_stage_caps_fit_one_device_command(script):
    caps = stage_caps(SCRIPTS / script)
    assert caps, f"{script}: no stages"
    assert sum(caps) <= LIMIT_S, f"{script}: stage caps sum to {sum(caps)} s > {LIMIT_S} s"


@pytest.mark.parametrize("script", CHECKS)
def test_every_command_of_a_check_runs_in_a_capped_stage(script):
    path = SCRIPTS / script
    unbounded = [
        line for line in logical_lines(path) if RUNS.search(line) and not STAGE.match(line)
    ]
    assert unbounded == [], f"{script}: commands outside a stage (no time cap): {unbounded}"
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0


def test_a_stage_is_stopped_at_its_cap_and_recorded(tmp_path):
    script = (
        f"source {SCRIPTS / 'gpu_check_lib.sh'}\n"
        'stage 1 "sleeps past its cap" sleep 30\n'
        'stage 5 "quick" echo figure\n'
        "finish\n"
    )
    env = {"OUT": str(tmp_path / "out"), "GPU_CHECK_WORK": str(tmp_path / "work")}
    done = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, env={**env, "PATH": "/usr/bin:/bin"},
        timeout=30,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    stages = (tmp_path / "out" / "stages.txt").read_text().splitlines()
    assert "exit 124" in stages[0] and "exit 0" in stages[1]
    assert "figure" in (tmp_path / "out" / "log.txt").read_text()
    assert (tmp_path / "out" / "details.tgz").is_file()
