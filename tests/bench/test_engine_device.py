"""`dorarl bench engine-device`: every section runs end to end on the CPU at a tiny size
(the cuda run is scripts/gpu_check_1.sh), bars and the CPU bench's keys come out filled."""

import os
from dataclasses import replace

import pytest
from rich.console import Console

from dorarl.bench import engine_device as ed
from dorarl.errors import UserInputError

TINY = replace(
    ed.QUICK, num_requests=6, max_batch=4, prompt_len=8, median_len=4, step_batches=(2, 4),
    step_repeats=2, step_context=16, migration_contexts=(32, 64), hf_continuous=False,
)  # fmt: skip


def test_device_bench_on_cpu_fills_every_section(single_thread):
    seen = []
    bench = ed.run_device_bench(
        "tiny", ed.resolve_device("cpu"), TINY, Console(quiet=True), seen.append
    )
    assert len(seen) == 3  # after each section, for a run cut short
    tail = bench["long_tail"]
    assert tail["engine"]["tokens"] == tail["hf_static"]["tokens"] == tail["total_tokens"]
    assert tail["engine_setup"]["fast_path_fallbacks"] == []  # what the engine ran, recorded
    assert set(bench["steps"]["ms"]) == {"2", "4"}
    for row in bench["steps"]["ms"].values():
        assert row["engine"] > 0 and row["hf_static_cache"] > 0 and 0 < row["floor"] < row["engine"]
    assert set(bench["migration"]["migration_ms"]) == {"32", "64"}
    keys = ed.todays_keys(bench)
    assert keys["step_ms_full_batch"]["batch"] == 4 and keys["reprefill_ms"]["64"] > 0
    bars = bench["bars"]  # no batch 64 here: its two bars have no value
    assert bars["step_ms_64"]["value"] is None and bars["step_vs_hf_fastest_64"]["pass"] is None
    assert bars["long_tail_vs_hf_static"]["value"] > 0
    assert bars["reprefill_vs_migration_64"]["value"] > 0
    ed.print_device_report(bench, Console(quiet=True))


def test_step_bytes_counts_weights_once_and_the_kv():
    model = ed.random_llama("tiny")
    c = model.config
    kv = 8 * 100 * c.num_hidden_layers * 2 * c.num_key_value_heads * (c.hidden_size // 4)
    weights = sum(p.numel() for p in model.parameters())  # tied: the head is the embedding
    assert ed.step_bytes(model, 8, 100, model.dtype) == 4 * (weights + kv)


@pytest.mark.parametrize("item", ["linear_kernel=torch", "attention", "engine.foo=1"])
def test_engine_set_refuses_other_keys(item):
    with pytest.raises(UserInputError, match="^--engine-set"):
        ed.parse_engine_set([item])
    assert ed.parse_engine_set(["engine.cuda_graphs=off"]) == (("cuda_graphs", "off"),)


def test_device_bench_runs_the_moe_family_on_cpu(single_thread):
    bench = ed.run_device_bench("tiny-moe", ed.resolve_device("cpu"), TINY, Console(quiet=True))
    tail = bench["long_tail"]
    assert tail["engine"]["tokens"] == tail["hf_static"]["tokens"] == tail["total_tokens"]
    assert all(row["engine"] > 0 for row in bench["steps"]["ms"].values())
    assert bench["migration"]["migration_ms"]["64"] > 0


def test_the_moe_shape_is_qwen3_30b_a3b():
    from dorarl.bench.shapes import shape_config
    from dorarl.engine.model_spec import spec_from_hf

    spec = spec_from_hf(shape_config("qwen3-30b-a3b"))
    assert spec.model_type == "qwen3_moe" and 30.5e9 < spec.num_parameters() < 30.6e9
    assert (spec.moe.num_experts, spec.moe.top_k, spec.moe.expert_size) == (128, 8, 768)
    assert len(spec.moe.sparse_layers) == 48 and spec.moe.norm_topk
    if os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") < 122e9:
        with pytest.raises(UserInputError, match="--shape qwen3-30b-a3b: 122.1 GB of weights"):
            ed.random_llama("qwen3-30b-a3b")  # float32 on the host: refused, not killed
