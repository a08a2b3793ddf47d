"""`dorarl bench peers --seeds`: the seeds list, both sides' mean and spread over the seeds,
and the record's rows (one per side and seed, then the means)."""

import argparse
import math
import sys
import time

import psutil
import pytest

from dorarl.bench.peers_record import COLUMNS
from dorarl.bench.peers_seeds import (
    SeedFailed,
    parse_seeds,
    run_one,
    seed_command,
    seeds_record,
    summarize,
)
from dorarl.cli import main as cli_main


def _side(wall: float, curve: dict[str, float]) -> dict:
    return {"process_wall_s": wall + 10, "run_wall_s": wall, "s_per_step": wall / 30,
            "tokens_per_s": 1000 / wall, "held_out": curve}  # fmt: skip


def _result(seed: int, dorarl_wall: float, trl_wall: float, dorarl_last: float, trl_last: float):
    settings = {"model": "m", "task": "arith", "steps": 30, "group_size": 8, "tbs": 8,
                "mode": "dora", "K": 1, "lr": 2e-5, "eps_low": 0.2, "eps_high": 0.28,
                "kl_coef": 0.0, "temperature": 1.0, "max_new_tokens": 64, "eval_prompts": 100,
                "allocator": "tcmalloc", "trl_precision": "bf16", "dorarl_autocast": "none",
                "seed": seed}  # fmt: skip
    machine = {"cpu": "cpu", "cores": 2, "load": [1.0, 1.0, 1.0]}
    return {
        "settings": settings,
        "dorarl": _side(dorarl_wall, {"0": 0.2, "30": dorarl_last}),
        "trl": _side(trl_wall, {"0": 0.2, "30": trl_last}),
        "trl_runs": {"bf16": _side(trl_wall, {"0": 0.2, "30": trl_last})},
        "prompts": {"same_prompt_ids": True},
        "machine_before": machine,
        "machine_after": machine,
        "unmatched": ["one thing"],
    }


BY_SEED = {0: _result(0, 400, 800, 0.84, 0.75), 1: _result(1, 300, 900, 0.70, 0.72)}


def test_the_summary_is_each_sides_mean_and_spread_and_the_ratio_per_seed():
    summary = summarize(BY_SEED)
    assert summary["seeds"] == [0, 1]
    assert summary["trl_over_dorarl_per_seed"] == pytest.approx([2.0, 3.0])
    assert summary["trl_over_dorarl"]["mean"] == pytest.approx(2.5)
    assert summary["trl_over_dorarl"]["sd"] == pytest.approx(math.sqrt(0.5))
    assert summary["trl_over_dorarl_of_means"] == pytest.approx(850 / 350)
    assert summary["dorarl"]["run_wall_s"] == pytest.approx(
        {"mean": 350, "min": 300, "max": 400, "sd": math.sqrt(5000)}
    )
    assert summary["dorarl"]["last_held_out"]["mean"] == pytest.approx(0.77)
    assert summary["trl"]["held_out_gain"]["mean"] == pytest.approx(0.535)
    assert summary["held_out_lead"]["min"] == pytest.approx(-0.02)
    assert summary["held_out_lead"]["max"] == pytest.approx(0.09)


def test_one_seed_has_no_spread():
    summary = summarize({3: BY_SEED[0]})
    assert summary["trl_over_dorarl"] == {"mean": 2.0, "min": 2.0, "max": 2.0, "sd": 0.0}


def test_the_record_has_a_row_per_side_and_seed_then_the_means():
    record = seeds_record(BY_SEED, summarize(BY_SEED), "dorarl bench peers --seeds 0,1")
    names = [row[0] for row in record["rows"]]
    assert len(names) == 6 and names[0].endswith("seed 0") and names[3].endswith("seed 1")
    assert names[-2:] == ["dorarl, mean of 2", "TRL, mean of 2"]
    assert record["rows"][-2][2] == pytest.approx(350)
    assert record["rows"][-1][-1] == "0: 0.20 / 30: 0.73"
    assert all(len(row) == len(COLUMNS) for row in record["rows"])
    assert record["bench"] == "peers" and record["title"].endswith("2 seeds")
    assert "2.00x, 3.00x" in record["notes"][0] and "Not matched: one thing" in record["notes"]
    assert "Prompt ids equal in dispatch order on every seed: True." in record["notes"]


@pytest.mark.parametrize("text", ["", "0,0", "a,1", "-1", "1.5"])
def test_a_bad_seeds_list_is_refused(text):
    with pytest.raises(ValueError, match="--seeds"):
        parse_seeds(text)


def test_seeds_keep_their_order():
    assert parse_seeds("2, 0,1") == [2, 0, 1]


def test_a_bad_seeds_list_exits_2_on_one_line(capsys):
    pytest.importorskip("trl")
    argv = ["bench", "peers", "--model", "m", "--out", "o", "--seeds", "0,x"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("--seeds:")


def test_a_seed_runs_the_one_seed_bench_with_its_seed_last(tmp_path):
    args = argparse.Namespace(model="M", config="C.yaml", trl_precision="bf16",
                              overrides=["seed=7", "steps=3"])  # fmt: skip
    cmd = seed_command(args, tmp_path / "seed-2", 2)
    assert cmd[1:5] == ["-m", "dorarl", "bench", "peers"] and "--seeds" not in cmd
    assert cmd[cmd.index("--out") + 1] == str(tmp_path / "seed-2")
    assert cmd[-3:] == ["seed=7", "steps=3", "seed=2"]  # the last key=value wins


def test_a_seed_that_fails_or_runs_too_long_is_named_and_its_group_stopped(tmp_path):
    with pytest.raises(SeedFailed, match="seed 1: the bench exited 3"):
        run_one([sys.executable, "-c", "raise SystemExit(3)"], 30, "seed 1")
    pid_file = tmp_path / "grandchild"
    # the child starts a grandchild in its group, then both sleep past the time allowed
    script = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    )
    with pytest.raises(SeedFailed, match="ran past --seed-timeout-s=2"):
        run_one([sys.executable, "-c", script], 2, "seed 0")
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while psutil.pid_exists(grandchild) and psutil.Process(grandchild).status() != "zombie":
        assert time.monotonic() < deadline, "the seed's process group outlived its time"
        time.sleep(0.1)
