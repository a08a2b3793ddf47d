"""Stopping is a first-class operation and the printed command finishes the run: SIGINT to
`dorarl train` (as a terminal's Ctrl-C: to the whole process group) stops after the step and
the requests in flight with a checkpoint (keeping the groups not trained on), summary.json
and the resume command; a second SIGINT aborts at once; the printed command then finishes
the run in its folder with one consistent history, no group lost."""

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dorarl.cli import main as cli_main

SMALL = ["instances=1", "tbs=2", "rbs=4", "group_size=2", "engine.max_num_seqs=4",
         "eval.max_prompts=4", "eval.every=0", "progress=false", "mode=dora", "K=1"]  # fmt: skip
STEPS = 8  # room after a late first stop: the resumed run must still have steps to abort in


def _lines(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _interrupt(
    args: list[str], out: Path, after_rows: int, times: int, after_line: str = ""
) -> tuple[int, str, int]:
    """Run `dorarl train ARGS` in its own process group; once metrics.jsonl has `after_rows`
    rows and the run has printed a line holding `after_line`, send SIGINT `times` times to
    the group, each once the run has taken the one before (two close together would reach
    Python's handler once); returns (exit code, stdout + stderr, the rows metrics.jsonl had
    just before the first SIGINT)."""
    cmd = [sys.executable, "-m", "dorarl.cli", "train", *args]
    env = os.environ | {"PYTHONUNBUFFERED": "1"}  # each line as the run prints it
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env=env,
    )  # fmt: skip
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 600

    def waiting() -> bool:
        told = any(after_line in line for line in list(lines))
        return (len(_lines(out / "metrics.jsonl")) < after_rows or not told) and proc.poll() is None

    while waiting():
        assert time.monotonic() < deadline, "no training step logged in 600 s"
        time.sleep(0.05)
    rows_at_signal = len(_lines(out / "metrics.jsonl"))
    for sent in range(times):
        os.killpg(proc.pid, signal.SIGINT)
        while sent + 1 < times and not any("stopping after" in line for line in lines):
            assert proc.poll() is None, "".join(lines)
            time.sleep(0.01)
    proc.wait(timeout=600)
    reader.join(timeout=10)
    _group_gone(proc.pid, within_s=2.0)  # Ray's own processes follow the driver out
    return proc.returncode, "".join(lines), rows_at_signal


def _group_gone(group: int, within_s: float) -> None:
    """Nothing of the run is left in its process group `within_s` after the driver ended."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    with pytest.raises(ProcessLookupError):
        os.killpg(group, 0)


@pytest.mark.slow
@pytest.mark.usefixtures("shared_ray")  # the last run is in-process; the others start their own
def test_sigint_stops_the_run_and_the_printed_command_finishes_it(tmp_path):
    out = tmp_path / "run"
    rc, text, _ = _interrupt([*SMALL, f"steps={STEPS}", "--out", str(out)], out, 1, times=1)
    assert rc == 130 and "Traceback" not in text, text
    # off a terminal (progress=false) the start says what it does, with the actors' times
    told = [line for line in text.splitlines() if line.startswith("start ")]
    assert "Ray up in" in told[0] and "actors up in" in told[1], text
    # (one engine: a count before the role is test_startup's case)
    assert all(f"{role} (process " in told[1] for role in ("engine", "trainer", "evaluator"))
    assert "first step done (v0 -> v1" in told[2], text
    assert "; start-up " in told[2] and "imports " in told[2] and "; slowest: " in told[2]
    summary = json.loads((out / "summary.json").read_text())
    phases = ["imports", "checks", "ray", "actors", "first_step"]
    assert list(summary["startup"]["phases_s"]) == phases, summary["startup"]
    stopped = summary["stopped_at_version"]
    assert summary["stopped_by"] == "SIGINT" and 1 <= stopped < STEPS, summary
    state = json.loads(
        (out / "checkpoints" / f"version_{stopped:05d}" / "trainer_state.json").read_text()
    )
    assert state["version"] == state["extra_state"]["version"] == stopped  # with its data
    printed = text.splitlines()[text.splitlines().index("stopped by SIGINT at version "
                                                         f"{stopped}; continue the run with:") + 1]  # fmt: skip
    command = printed.strip()
    assert command == f"dorarl train resume={out}" == summary["resume_command"]

    # the first stop kept what it had sampled: the complete groups it had not trained on
    carried = {g["group_id"] for g in state["extra_state"]["carried_groups"]}
    assert len(carried) == summary["queued_at_end"] and summary["in_flight_at_end"] == 0
    assert summary["dropped_total"] == 0, summary

    # the printed command, interrupted twice: it aborts at once, cleanly. The first SIGINT
    # goes as the run says its actors are up, so it has steps left to stop after (a signal
    # sent once it had logged a step could find it past its last one)
    resumed = shlex.split(command)[2:]
    rc, text, rows = _interrupt(resumed, out, 0, times=2, after_line="actors up in")
    assert rc == 130 and "Traceback" not in text and "dorarl: aborted" in text, text
    # the first SIGINT's checkpoint is saved when the step in flight ends; the second may
    # abort before it (the aborted segment rolls back) or after it (its steps are kept).
    # `rows` steps had ended when the first SIGINT was sent: the driver may be writing one
    # more as it lands, and then stops after the step in flight, so none beyond rows + 2
    kept = max(int(p.name.removeprefix("version_")) for p in (out / "checkpoints").iterdir())
    assert stopped <= kept <= rows + 2, (stopped, kept, rows)

    # and once more, to the end: rows the abort left after the checkpoint move aside
    assert cli_main(shlex.split(command)[1:]) == 0
    metrics = _lines(out / "metrics.jsonl")
    assert [m["version"] for m in metrics] == list(range(STEPS))
    assert [m["new_version"] for m in metrics] == list(range(1, STEPS + 1))
    trajectories = _lines(out / "trajectories.jsonl")
    samples = [(t["group_id"], t["sample_index"]) for t in trajectories]
    assert len(samples) == len(set(samples))  # each trajectory trained once in this history
    trained = [t["train_version"] for t in trajectories]
    assert trained == sorted(trained) and set(trained) == set(range(STEPS))
    assert carried <= {t["group_id"] for t in trajectories}  # trained after the resume
    # summary and trace are the whole run's: the stopped segment, the aborted one if its
    # checkpoint holds (else its steps were all rolled back, its records with them) and the
    # one that finished the run
    summary = json.loads((out / "summary.json").read_text())
    assert summary.get("stopped_by") is None and summary["steps"] == STEPS
    # no group lost: every one dispatched is consumed, filtered, queued or in flight at the
    # end, across the segments (the carried ones dispatched once, in the stopped segment)
    ends = summary["queued_at_end"] + summary["in_flight_at_end"] + summary["dropped_total"]
    assert summary["dispatched"] == summary["consumed"] + summary["filtered"] + ends, summary
    assert summary["dropped_total"] == 0 and summary["carried_in"] >= len(carried), summary
    aborted = [(stopped, kept, "killed")] if kept > stopped else []
    assert [(s["start_version"], s["end_version"], s["ended"]) for s in summary["segments"]] == [
        (0, stopped, "stopped"),
        *aborted,
        (kept, STEPS, "finished"),
    ]
    rolled_back = out / "rolled_back" / "segments"
    assert len(list(rolled_back.iterdir()) if rolled_back.is_dir() else []) == (not aborted)
    trace = json.loads((out / "trace.json").read_text())["traceEvents"]
    steps = [e["name"] for e in trace if e["name"].startswith("train step")]
    assert steps == [f"train step {s} (v{s} -> v{s + 1})" for s in range(STEPS)]
    assert (out / "checkpoints" / f"version_{STEPS:05d}").is_dir()
    assert json.loads((out / "config.json").read_text())["steps"] == STEPS
