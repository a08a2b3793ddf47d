"""scripts/bench_moe_experts.py: one row per model and kernel, timed with the benches' clock."""

from __future__ import annotations

import json

from scripts_dir import load_script


def test_the_script_times_each_model_and_kernel_and_gives_the_load_either_side(
    tmp_path, single_thread
):  # the script pins one thread; the fixture gives the worker its own back
    script = load_script("bench_moe_experts")
    out = tmp_path / "moe.json"
    argv = ["--experts", "4", "--batches", "1,2", "--steps", "2", "--out", str(out)]
    assert script.main(argv) == 0
    doc = json.loads(out.read_text())
    assert [(r["experts"], r["kernel"]) for r in doc["rows"]] == [
        (0, "onednn"), (4, "onednn"), (4, "torch"),
    ]  # fmt: skip
    assert all(r["1"] > 0 and r["2"] > 0 for r in doc["rows"])
    assert len(doc["load_average_start"]) == len(doc["load_average"]) == 3
