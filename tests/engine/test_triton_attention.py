"""Triton paged attention against a float64 reference and the engine's CPU path.

On a machine without a GPU the kernels run in Triton's interpreter (triton_testlib); with
one, the same tests run them on cuda. Cases are small: the interpreter is slow.
"""

from __future__ import annotations

import pytest
import torch
from triton_testlib import (
    DEVICE,
    DTYPES,
    assert_close_to_reference,
    logical_kv,
    random_pool,
    reference,
    rows_of,
)

from dorarl.engine.attention import PagedAttention, StepPlan, plan_decode, plan_prefill
from dorarl.engine.kv_cache import KVCache
from dorarl.engine.triton_attention import (
    SplitLayout,
    TritonPagedAttention,
    packed_partitions,
    paged_decode,
    plan_paged_step,
)


def _decode_inputs(pool, ctx, heads, seed=1):
    gen = torch.Generator().manual_seed(seed)
    dim = pool.cache.shape.head_dim
    q = torch.randn(len(ctx), heads, dim, generator=gen).to(DEVICE, pool.cache.dtype)
    step = plan_paged_step(
        rows_of(pool, [c - 1 for c in ctx], [1] * len(ctx)),
        len(ctx),
        pool.cache.shape.num_kv_heads,
        heads // pool.cache.shape.num_kv_heads,
        pool.cache.shape.block_size,
        DEVICE,
    )
    return q, step


def _decode(pool, q, step, **kw):
    k, v = pool.cache.pool[0, 0], pool.cache.pool[1, 0]
    return paged_decode(q, k, v, step.decode_tables, step.decode_lens, **kw)


def _check_decode(pool, q, out, ctx):
    for i, c in enumerate(ctx):
        k, v = logical_kv(pool.cache, pool.tables[i], c)
        ref = reference(q[i : i + 1], k, v, c - 1)
        assert_close_to_reference(out[i : i + 1], ref, f"row {i} (context {c})")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "block_size, kv_heads, group, dim",
    [(16, 2, 7, 64), (32, 1, 1, 128), (64, 2, 4, 64)],
    ids=["bs16-gqa7-d64", "bs32-mha-d128", "bs64-gqa4-d64"],
)
def test_decode_matches_the_reference_over_ragged_contexts(dtype, block_size, kv_heads, group, dim):
    ctx = [1, 15, 16, 17, 70, 3 * block_size + 5]
    pool = random_pool(ctx, kv_heads, dim, block_size, dtype)
    q, step = _decode_inputs(pool, ctx, kv_heads * group)
    _check_decode(pool, q, _decode(pool, q, step), ctx)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_decode_combines_partitions_and_matches_one_partition_bitwise(dtype):
    ctx = [5, 31, 32, 33, 95, 130]
    pool = random_pool(ctx, 2, 64, 16, dtype)
    q, step = _decode_inputs(pool, ctx, 6)
    split = _decode(pool, q, step, partition_tokens=32, keys_per_tile=16)  # up to 5 parts
    _check_decode(pool, q, split, ctx)
    whole = _decode(pool, q, step, partition_tokens=1024, keys_per_tile=16)
    short = [i for i, c in enumerate(ctx) if c <= 32]  # one partition either way
    assert torch.equal(split[short], whole[short])


def test_packed_partials_give_the_same_bits_in_a_buffer_of_the_rows_own_partitions():
    """Rows' partitions one after another: 1 + 1 + 1 + 2 + 3 + 5 = 13, not 6 rows x 5."""
    ctx = [5, 31, 32, 33, 95, 130]
    pool = random_pool(ctx, 2, 64, 16, torch.bfloat16)
    q, step = _decode_inputs(pool, ctx, 6)
    starts, parts = packed_partitions(ctx, partition_tokens=32)
    assert parts == 13
    layout = SplitLayout(torch.tensor(starts, device=DEVICE), parts)
    packed = _decode(pool, q, step, partition_tokens=32, keys_per_tile=16, split=layout)
    dense = _decode(pool, q, step, partition_tokens=32, keys_per_tile=16)
    assert torch.equal(packed, dense)


def test_a_rows_output_ignores_companions_and_physical_placement():
    ctx = [40, 200, 9]
    pool = random_pool(ctx, 2, 64, 16, torch.bfloat16, seed=3)
    q, step = _decode_inputs(pool, ctx, 4)
    together = _decode(pool, q, step, partition_tokens=64)
    alone_pool = random_pool([40], 2, 64, 16, torch.bfloat16, seed=4)
    # The same logical K/V of row 0 in other physical blocks of another pool.
    for src, dst in zip(pool.tables[0], alone_pool.tables[0], strict=True):
        alone_pool.cache.pool[:, :, dst] = pool.cache.pool[:, :, src]
    alone_q, alone_step = _decode_inputs(alone_pool, [40], 4)
    alone = _decode(alone_pool, q[:1], alone_step, partition_tokens=64)
    assert torch.equal(together[0], alone[0])


def test_a_rows_output_is_the_same_bits_on_another_block_size():
    """Loops walk key tiles of a fixed size, so the block size is only a lookup."""
    ctx = [200]
    small = random_pool(ctx, 2, 64, 16, torch.bfloat16, seed=5)
    large = random_pool(ctx, 2, 64, 64, torch.bfloat16, seed=6)
    keys, values = logical_kv(small.cache, small.tables[0], ctx[0])
    pos = torch.arange(ctx[0], device=DEVICE)
    blocks = torch.tensor(large.tables[0], device=DEVICE)[pos // 64]
    large.cache.pool[0, 0, blocks, :, pos % 64] = keys.to(torch.bfloat16)
    large.cache.pool[1, 0, blocks, :, pos % 64] = values.to(torch.bfloat16)
    q, step = _decode_inputs(small, ctx, 4)
    _, large_step = _decode_inputs(large, ctx, 4)
    for part in (64, 512):  # split and not
        a = _decode(small, q, step, partition_tokens=part)
        b = _decode(large, q, large_step, partition_tokens=part)
        assert torch.equal(a, b)


def test_padded_rows_of_context_zero_give_zeros_and_touch_nothing_else():
    ctx = [20, 33]
    pool = random_pool(ctx, 2, 64, 16, torch.float32)
    q, step = _decode_inputs(pool, ctx, 4)
    lens = step.decode_lens.clone()
    lens[1] = 0
    for part in (16, 1024):
        out = paged_decode(
            q, pool.cache.pool[0, 0], pool.cache.pool[1, 0], step.decode_tables, lens,
            partition_tokens=part, keys_per_tile=16,
        )  # fmt: skip
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        _check_decode(pool, q[:1], out[:1], ctx[:1])


def _mixed_step(dtype, block_size=16, kv_heads=2, group=3, dim=64, seed=0):
    """Two decode rows, a first prefill chunk and a continued one, with random new q/k/v."""
    starts, q_lens = [24, 40, 0, 21], [1, 1, 37, 30]
    ends = [s + n for s, n in zip(starts, q_lens, strict=True)]
    pool = random_pool(ends, kv_heads, dim, block_size, dtype, seed=seed)
    rows = rows_of(pool, starts, q_lens)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens, heads = sum(q_lens), kv_heads * group
    q, k, v = (
        torch.randn(tokens, n, dim, generator=gen).to(DEVICE, dtype)
        for n in (heads, kv_heads, kv_heads)
    )
    return pool, rows, q, k, v


def _run_triton(pool, rows, q, k, v, num_decode=2):
    s = pool.cache.shape
    group = q.shape[1] // s.num_kv_heads
    step = plan_paged_step(rows, num_decode, s.num_kv_heads, group, s.block_size, DEVICE)
    return TritonPagedAttention(pool.cache, step)(0, q, k, v).view(q.shape)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_step_writes_new_kv_in_place_and_attends_causally(dtype):
    pool, rows, q, k, v = _mixed_step(dtype)
    out = _run_triton(pool, rows, q, k, v)
    at = 0
    for r in rows:
        new = slice(at, at + r.q_len)
        keys, values = logical_kv(pool.cache, r.table, r.start + r.q_len)
        assert torch.equal(keys[r.start :], k[new].double())  # written into their slots
        assert torch.equal(values[r.start :], v[new].double())
        ref = reference(q[new], keys, values, r.start)
        assert_close_to_reference(out[new], ref, f"chunk at {r.start}+{r.q_len}")
        at += r.q_len


def test_prefill_tiles_split_a_chunk_and_support_other_shapes():
    # 37 tokens x 7 heads = 259 packed rows: five tiles of 64, the last one mostly padding.
    pool, rows, q, k, v = _mixed_step(torch.bfloat16, block_size=32, kv_heads=1, group=7, dim=128)
    out = _run_triton(pool, rows, q, k, v, num_decode=0)
    r, first = rows[2], sum(x.q_len for x in rows[:2])
    keys, values = logical_kv(pool.cache, r.table, r.q_len)
    ref = reference(q[first : first + r.q_len], keys, values, 0)
    assert_close_to_reference(out[first : first + r.q_len], ref, "37-token chunk")


def test_matches_the_engines_cpu_attention_path():
    """Same step, same pool: the engine's own backend, run on the CPU (its home)."""
    pool, rows, q, k, v = _mixed_step(torch.float32, seed=5)
    s = pool.cache.shape
    cpu_cache = KVCache(s, pool.cache.pool.shape[2], 0, torch.device("cpu"), torch.float32)
    cpu_cache.pool.copy_(pool.cache.pool)
    ours = _run_triton(pool, rows, q, k, v).cpu()
    group = q.shape[1] // s.num_kv_heads
    args = (s.num_kv_heads, group, s.block_size, torch.device("cpu"))
    first = [2 + sum(r.q_len for r in rows[2:i]) for i in range(2, len(rows))]
    plan = StepPlan(
        plan_paged_step(rows, 2, *args).write_rows,
        plan_decode(rows[:2], *args),
        [plan_prefill(at, r, *args) for at, r in zip(first, rows[2:], strict=True)],
    )
    theirs = PagedAttention(cpu_cache, plan)(0, q.cpu(), k.cpu(), v.cpu()).view(q.shape)
    torch.testing.assert_close(ours, theirs, atol=2e-6, rtol=0)


@pytest.mark.cuda
def test_planning_and_attending_never_wait_for_the_device():
    pool, rows, q, k, v = _mixed_step(torch.bfloat16)
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call raises
    try:
        out = _run_triton(pool, rows, q, k, v)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out).all()
