"""A tiny KV pool under many requests: offload, preemption and reuse never corrupt KV."""

import pytest
import torch
from engine_testlib import make_engine, prompts, run_all, run_alone, seeded, tiny_model

from dorarl.engine import SamplingParams


def _workload(n: int) -> list[tuple[list[int], SamplingParams]]:
    lengths = [3 + (7 * i) % 23 for i in range(n)]
    return [
        (p, seeded(6 + (5 * i) % 29, seed=i, top_k=0 if i % 2 else 40))
        for i, p in enumerate(prompts(lengths, seed=21))
    ]


@pytest.mark.parametrize(
    "pool, expect",
    [
        (dict(num_blocks=16, host_blocks=0), {"preemptions"}),
        (dict(num_blocks=16, host_blocks=64, offload_threshold=0.75), {"offloads"}),
        (dict(num_blocks=16, host_blocks=6, offload_threshold=0.9), {"offloads", "preemptions"}),
    ],
    ids=["recompute", "offload", "offload+recompute"],
)
def test_full_pool_results_equal_each_request_alone(pool, expect):
    model = tiny_model("qwen2", seed=1)
    work = _workload(14)
    engine = make_engine(
        model, max_num_seqs=6, block_size=4, max_model_len=64, prefill_chunk_size=16, **pool
    )
    for i, (p, params) in enumerate(work):
        engine.add_request(f"r{i}", p, params)
    outs = run_all(engine)
    stats = engine.stats()
    for counter in expect:
        assert getattr(stats, counter) > 0, f"no {counter}: the pool was never under pressure"
    assert stats.restores == stats.offloads
    for i, (p, params) in enumerate(work):
        want = run_alone(model, p, params, max_model_len=64)
        got = outs[f"r{i}"]
        assert got.output_ids == want.output_ids, f"request {i}"
        torch.testing.assert_close(
            torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0
        )
    assert (stats.kv_blocks_used, stats.host_blocks_used) == (0, 0)
    assert engine.stats().kv_blocks_free == pool["num_blocks"]


def test_offload_threshold_moves_kv_to_host_and_back():
    model = tiny_model("llama", seed=1)
    engine = make_engine(
        model,
        max_num_seqs=8,
        num_blocks=24,
        block_size=4,
        max_model_len=64,
        host_blocks=64,
        offload_threshold=0.5,
    )
    for i, p in enumerate(prompts([10] * 6, seed=22)):
        engine.add_request(f"r{i}", p, seeded(20, seed=i))
    peak_offloaded = 0
    while engine.has_unfinished():
        engine.step()
        stats = engine.stats()
        peak_offloaded = max(peak_offloaded, stats.offloaded)
        assert stats.kv_blocks_used + stats.kv_blocks_free == stats.kv_blocks_total
    assert peak_offloaded > 0
    assert engine.stats().restores == engine.stats().offloads > 0
