"""An engine on a device that reports its memory (cuda; here the CPU given cuda's figures)
sizes its KV pool from its share of it: weights and workspace first, whole blocks, an
explicit num_blocks winning, one line when not even one sequence fits; the decode graphs'
split-K partials are sized from what that pool holds. On the CPU the default pool is what
`HOST_SHARE` of the host memory the process may use holds."""

import dataclasses
import os

import pytest
from engine_testlib import make_engine, prompts, run_all, seeded, tiny_model

import dorarl.engine.engine as engine_module
from dorarl.config import ConfigError
from dorarl.engine import EngineConfig
from dorarl.engine.backends import resolve_backends
from dorarl.engine.memory import HOST_SHARE, plan_kv
from dorarl.engine.model_spec import spec_from_hf

SMALL = dict(
    block_size=16, max_model_len=96, prefill_chunk_size=16, max_num_seqs=8, num_blocks=None
)
POOL = 20  # blocks the share below leaves for KV (the default would be 8 x 6 = 48)


def _memory_for(blocks: int, share: float = 0.5, graphs: bool = False, **cfg) -> int:
    """A device total whose `share` holds the weights, the workspace and `blocks` blocks
    (float32: the engine's dtype on the CPU)."""
    config = EngineConfig(**{**SMALL, **cfg})
    spec = spec_from_hf(tiny_model("qwen2", seed=1).config)
    empty = plan_kv(spec, config, 4, graphs, 0, share)
    used = empty.weight_bytes + empty.workspace.total + blocks * empty.block_bytes
    return int(used / share) + 1


@pytest.fixture
def device_of(monkeypatch):
    """The CPU reporting `total` bytes, all free, as torch.cuda.mem_get_info would (None:
    no figures, as the CPU)."""

    def report(total: int | None) -> None:
        memory = None if total is None else (total, total)
        monkeypatch.setattr(engine_module, "device_memory", lambda device: memory)

    return report


def test_the_pool_is_what_the_memory_share_holds(device_of):
    device_of(_memory_for(POOL))
    model, batch = tiny_model("qwen2", seed=1), prompts([20, 3, 9], seed=2)
    engine = make_engine(model, **SMALL, gpu_memory_share=0.5)
    assert engine.kv_blocks == POOL < engine.config.kv_blocks
    assert engine.stats().kv_blocks_total == POOL and engine.kv.pool.shape[2] == POOL
    assert engine.setup().kv_budget.startswith(f"KV {POOL} blocks of 16 tokens")
    for i, p in enumerate(batch):
        engine.add_request(f"r{i}", p, seeded(6, seed=i))
    got = run_all(engine)
    device_of(None)  # a fresh reference engine sees no device memory
    reference = make_engine(model, **{**SMALL, "num_blocks": POOL})
    for i, p in enumerate(batch):
        reference.add_request(f"r{i}", p, seeded(6, seed=i))
    want = run_all(reference)
    assert {k: v.output_ids for k, v in got.items()} == {k: v.output_ids for k, v in want.items()}


def test_an_explicit_num_blocks_wins(device_of):
    device_of(_memory_for(POOL))
    engine = make_engine(
        tiny_model("qwen2", seed=1), **{**SMALL, "num_blocks": 40}, gpu_memory_share=0.5
    )
    assert engine.kv_blocks == 40


def test_a_share_that_cannot_hold_one_sequence_is_refused_in_one_line(device_of):
    device_of(_memory_for(5))  # one 96-token sequence needs 6 blocks
    with pytest.raises(ConfigError, match=r"^engine.gpu_memory_share: 0.5 of .* cannot hold"):
        make_engine(tiny_model("qwen2", seed=1), **SMALL, gpu_memory_share=0.5)


@pytest.fixture
def host_of(monkeypatch):
    """The host reporting `total` bytes of memory the process may use, all free."""

    def report(total: int) -> None:
        monkeypatch.setattr(engine_module, "host_memory", lambda: (total, total))

    return report


def test_the_default_pool_on_the_cpu_stays_within_the_host_budget(host_of):
    total = _memory_for(POOL, share=HOST_SHARE)
    host_of(total)
    engine = make_engine(tiny_model("qwen2", seed=1), **SMALL)
    assert engine.config.kv_blocks == 48 and engine.kv_blocks == POOL  # 48 would not fit
    plan = engine.kv_plan
    pool_bytes = engine.kv.pool.numel() * engine.kv.pool.element_size()
    assert pool_bytes == POOL * plan.block_bytes
    assert plan.weight_bytes + plan.workspace.total + pool_bytes <= HOST_SHARE * total
    assert " in 0.25 of " in engine.setup().kv_budget


def test_an_explicit_num_blocks_wins_on_the_cpu(host_of):
    host_of(_memory_for(POOL, share=HOST_SHARE))
    engine = make_engine(tiny_model("qwen2", seed=1), **{**SMALL, "num_blocks": 40})
    assert engine.kv_blocks == 40 and engine.kv.pool.shape[2] == 40


def test_a_host_that_cannot_hold_one_sequence_is_refused_in_one_line(host_of):
    host_of(_memory_for(5, share=HOST_SHARE))
    with pytest.raises(ConfigError, match=r"^engine.num_blocks: unset, and on the CPU 0.25 of"):
        make_engine(tiny_model("qwen2", seed=1), **SMALL)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter")
def test_the_graphs_split_partials_are_sized_from_the_pool(device_of, monkeypatch):
    """Tables of 1024 keys split in two partitions; 8 rows of full tables would need 16, a
    pool of 70 blocks (1120 tokens) at most three partitions and one rounding per row."""
    from dorarl.engine import triton_attention

    def forced(config):
        return dataclasses.replace(resolve_backends(config), attention="triton", cuda_graphs=True)

    sizes = []

    def spy(parts, *args):
        sizes.append(parts)
        return buffers(parts, *args)

    buffers = triton_attention.split_buffers
    monkeypatch.setattr(triton_attention, "split_buffers", spy)
    monkeypatch.setattr(engine_module, "resolve_backends", forced)
    cfg, pool = {**SMALL, "max_model_len": 1024}, 70
    device_of(_memory_for(pool, graphs=True, **cfg))
    model, batch = tiny_model("qwen2", seed=1), prompts([20, 3, 9], seed=2)
    engine = make_engine(model, **cfg, gpu_memory_share=0.5)
    assert engine.graphs is not None and engine.kv_blocks == pool < engine.config.kv_blocks
    assert engine.graphs.split_parts == 3 + 8
    for i, p in enumerate(batch):
        engine.add_request(f"r{i}", p, seeded(4, seed=i))
    got = run_all(engine)
    assert sizes and max(sizes) == 3 + 8  # graph steps: the bound; eager ones: their own
    monkeypatch.undo()
    reference = make_engine(model, **{**cfg, "num_blocks": pool})
    for i, p in enumerate(batch):
        reference.add_request(f"r{i}", p, seeded(4, seed=i))
    want = run_all(reference)
    assert {k: v.output_ids for k, v in got.items()} == {k: v.output_ids for k, v in want.items()}
