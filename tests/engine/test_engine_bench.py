"""`dorarl bench engine` and `dorarl bench engine-model`: the workload, the report, and an
end-to-end micro run."""

import json
from dataclasses import dataclass, replace

import pytest
import torch
from rich.console import Console

from dorarl.bench import engine as bench
from dorarl.bench import hf_peers
from dorarl.bench.shapes import SHAPES
from dorarl.data.lengths import length_stats

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
TINY_LLAMA = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=128,
)


@pytest.mark.parametrize("spec", [bench.FULL, bench.QUICK], ids=["full", "quick"])
def test_workload_is_long_tailed_and_reproducible(spec):
    work = bench.make_workload(spec)
    stats = length_stats(work.lengths)
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


def test_real_model_bench_compares_engine_hf_and_floor_exactly():
    from transformers import LlamaConfig, LlamaForCausalLM

    from dorarl.bench import engine_model

    config = LlamaConfig(**{**SHAPES["smollm2-135m"], **TINY_LLAMA})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    spec = engine_model.RealSpec(batches=(3, 5), prompt_len=6, new_tokens=4)
    report = engine_model.run_real(model, spec, Console(quiet=True))
    json.dumps(report)
    assert set(report["batches"]) == {"3", "5"}
    for batch, entry in report["batches"].items():
        assert entry["greedy_identical_requests"] == int(batch)  # greedy equals HF's
        assert entry["engine"]["decode_steps"] == spec.new_tokens - 1
        assert entry["floor"]["step"]["ms"] > 0 and entry["hf_static"]["tokens_per_s"] > 0
        # The floor runs the engine's own kernel; the F.linear floor is timed beside it.
        assert entry["floor"]["kernel"] == entry["engine"]["kernel"]
        assert entry["floor_torch"]["kernel"] == "torch" and entry["floor_torch"]["step"]["ms"] > 0
    assert set(report["bars"]) == set(engine_model.REAL_BARS)
    assert report["bars"]["step_vs_matmuls_32"]["pass"] is None  # batch 32 not measured here


def test_continuous_batching_config_tolerates_a_transformers_without_page_size():
    @dataclass
    class Old:  # transformers 5.17 has no page_size
        num_blocks: int | None = None
        max_requests_per_batch: int | None = None

    cb = hf_peers.continuous_batching_config(
        Old, page_size=16, num_blocks=8, max_requests_per_batch=4
    )
    assert cb == Old(num_blocks=8, max_requests_per_batch=4)

    @dataclass
    class New:
        page_size: int = 256
        num_blocks: int | None = None

    assert hf_peers.continuous_batching_config(New, page_size=16, num_blocks=8).page_size == 16


def test_unknown_shape_is_a_one_line_user_error():
    from dorarl.bench import engine_model
    from dorarl.errors import UserInputError

    with pytest.raises(UserInputError, match="--shape"):
        engine_model.load_model(None, "gpt-9")


def test_prefix_cache_workloads_report_prefill_saved_and_the_prediction():
    from dorarl.bench.prefix_cache import PrefixSpec, prefix_report

    spec = PrefixSpec(prompts=2, group_size=8, prompt_len=48, episodes=8, system_len=64,
                      task_len=8, response_len=3, max_num_seqs=16, block_size=8)  # fmt: skip
    report = prefix_report(bench.build_model(MICRO), spec, Console(quiet=True))
    json.dumps(report)
    group, system = report["group"], report["system"]
    assert group["identical"] and system["identical"]
    assert group["off"]["prefill_tokens"] == 2 * 8 * 48
    assert group["on"]["prefill_tokens"] == 2 * (48 + 7)  # the prompt, then a token a sample
    assert system["on"]["prefill_tokens"] == 64 + 8 * 8  # the system prompt once
    assert group["on"]["response_tokens"] == group["off"]["response_tokens"] == 16 * 3
    assert group["predicted_speedup_cpu_s"] > 1 and 0 < group["prefill_share_cpu_s"] <= 1.5
    assert set(report["bars"]) == {
        "group_prefill_reduction", "system_prefill_reduction",
        "group_speedup_vs_predicted", "system_speedup_vs_predicted",
    }  # fmt: skip
    assert report["bars"]["group_prefill_reduction"]["value"] == 768 / 110


def test_bench_prefix_cache_writes_its_json_and_table(tmp_path, monkeypatch, capsys):
    from dorarl.bench import prefix_cache

    micro = prefix_cache.PrefixSpec(prompts=1, group_size=4, prompt_len=24, episodes=4,
                                    system_len=32, task_len=4, response_len=2, max_num_seqs=8,
                                    block_size=8)  # fmt: skip
    monkeypatch.setattr(prefix_cache, "QUICK", micro)
    monkeypatch.setattr(bench, "FULL", MICRO)  # the tiny model at the micro shape
    assert prefix_cache.main(["--out", str(tmp_path), "--quick"]) == 0
    report = json.loads((tmp_path / "prefix_cache.json").read_text())
    assert report["tiny"]["group"]["on"]["prefill_tokens"] == 24 + 3
    assert len(report["load_average"]) == len(report["load_average_start"]) == 3
    assert "prefix cache, tiny" in capsys.readouterr().out


def test_bench_prefix_cache_skip_tiny_needs_a_model(tmp_path):
    from dorarl.bench import prefix_cache
    from dorarl.errors import UserInputError

    with pytest.raises(UserInputError, match="--skip-tiny"):
        prefix_cache.main(["--out", str(tmp_path), "--skip-tiny"])
