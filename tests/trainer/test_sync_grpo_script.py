"""End to end: the sync GRPO script (engine + trainer) improves the shipped base model."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_few_sync_grpo_steps_raise_held_out_accuracy(tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "sync_grpo.py"),
        "--out",
        str(out),
        "--steps",
        "12",
        "--prompts",
        "8",
        "--eval-prompts",
        "150",
        "--eval-every",
        "100",
        "--threads",
        "1",
    ]
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=600, capture_output=True)
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "curve.jsonl").read_text().splitlines()]
    assert (out / "curve.png").stat().st_size > 0
    assert [r["step"] for r in rows] == list(range(13))
    assert all(r.get("staleness_max", 0) == 0 for r in rows[1:])  # synchronous
    assert summary["end_accuracy"] >= summary["start_accuracy"] + 0.2, summary
