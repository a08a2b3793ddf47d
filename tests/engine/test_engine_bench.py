"""`dorarl bench engine`: the workload, the report, and an end-to-end micro run."""

import json
from dataclasses import replace

import pytest
from rich.console import Console

from dorarl.bench import engine as bench

MICRO = replace(
    bench.QUICK,
    num_requests=10,
    max_batch=4,
    median_len=4,
    migration_contexts=(32, 64),
    step_context=16,
    step_repeats=3,
    hidden=32,
    layers=2,
    heads=4,
    kv_heads=2,
    intermediate=64,
    vocab=256,
    prompt_len=8,
    prefill_chunk=32,
)


@pytest.mark.parametrize("spec", [bench.FULL, bench.QUICK], ids=["full", "quick"])
def test_workload_is_long_tailed_and_reproducible(spec):
    work = bench.make_workload(spec)
    stats = bench.length_stats(work.lengths)
    assert len(work.lengths) == spec.num_requests
    assert stats["p99_over_median"] >= 10
    assert stats["median"] == spec.median_len
    assert bench.make_workload(spec).lengths == work.lengths
    assert all(len(p) == spec.prompt_len for p in work.prompts)


def test_micro_run_reports_every_contender_and_bar():
    report = bench.run(MICRO, Console(quiet=True))
    json.dumps(report)  # engine.json must serialise
    assert report["hf_continuous_error"] is None, report["hf_continuous_error"]
    assert set(report["tokens_per_s"]) == {"engine", "hf_static", "hf_continuous", "floor"}
    assert all(v > 0 for v in report["tokens_per_s"].values())
    assert all(v > 0 for v in report["tokens_per_cpu_s"].values())
    assert report["details"]["engine"]["tokens"] == report["workload"]["total_tokens"]
    assert report["details"]["hf_static"]["decoded_tokens"] >= report["workload"]["total_tokens"]
    assert set(report["migration_ms"]) == set(report["reprefill_ms"]) == {"32", "64"}
    assert {"engine", "floor"} <= set(report["step_ms_full_batch"])
    assert set(report["bars"]) == set(bench.BARS)
    assert report["bars"]["reprefill_vs_migration_4096"]["pass"] is None  # 4096 not measured here


def test_bars_compare_in_the_right_direction():
    report = {
        "tokens_per_s": {
            "engine": 300.0,
            "hf_static": 100.0,
            "hf_continuous": 250.0,
            "floor": 400.0,
        },
        "tokens_per_cpu_s": {
            "engine": 300.0,
            "hf_static": 100.0,
            "hf_continuous": 150.0,
            "floor": 400.0,
        },
        "step_ms_full_batch": {
            "engine": 12.0,
            "floor": 10.0,
            "cpu_ms": {"engine": 14.0, "floor": 10.0},
        },
        "migration_ms": {"4096": 10.0},
        "reprefill_ms": {"4096": 50.0},
    }
    bars = bench.compute_bars(report)
    assert bars["engine_vs_hf_static"]["pass"] is True
    assert bars["engine_vs_hf_continuous"]["pass"] is False
    assert bars["engine_vs_hf_continuous"]["pass_cpu"] is True
    assert bars["step_vs_floor"]["pass"] is True
    assert bars["step_vs_floor"]["pass_cpu"] is False
    assert bars["reprefill_vs_migration_4096"]["pass"] is False


@pytest.mark.slow
def test_cli_quick_writes_engine_json(tmp_path):
    from dorarl.cli import main

    assert main(["bench", "engine", "--out", str(tmp_path), "--quick", "--skip-hf"]) == 0
    report = json.loads((tmp_path / "engine.json").read_text())
    assert report["quick"] is True and report["tokens_per_s"]["engine"] > 0
