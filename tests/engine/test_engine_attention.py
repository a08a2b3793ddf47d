"""Paged attention against a dense reference: ragged contexts, scattered blocks, GQA ratios."""

import random

import pytest
import torch
import torch.nn.functional as F
from engine_testlib import prompts, run_alone, seeded, tiny_model

from dorarl.engine.attention import (
    PagedAttention,
    SeqRows,
    StepPlan,
    plan_decode,
    plan_prefill,
)
from dorarl.engine.cpu_kernels import load_kernels
from dorarl.engine.kv_cache import KVCache, KVShape

# Decode rows on the tensor path and, where it builds, on the fused CPU kernel.
DECODE_KERNELS = [
    pytest.param(None, id="tensor"),
    pytest.param(
        "fused",
        id="fused",
        marks=pytest.mark.skipif(load_kernels() is None, reason="the kernel did not build here"),
    ),
]


def _kernel(name):
    return load_kernels().decode if name == "fused" else None


def _reference(pool_k, pool_v, table, length, q, block_size):
    """Dense attention of queries q `[n, heads, dim]` at the last n of `length` positions."""
    rows = [table[p // block_size] * block_size + p % block_size for p in range(length)]
    keys = pool_k.transpose(1, 2).reshape(-1, *pool_k.shape[1:2], pool_k.shape[-1])[rows]
    values = pool_v.transpose(1, 2).reshape(-1, *pool_v.shape[1:2], pool_v.shape[-1])[rows]
    n, heads = q.shape[0], q.shape[1]
    repeat = heads // keys.shape[1]
    keys, values = keys.repeat_interleave(repeat, 1), values.repeat_interleave(repeat, 1)
    causal = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=causal
    )
    return out.transpose(0, 1).reshape(n, -1)


@pytest.mark.parametrize("kernel", DECODE_KERNELS)
@pytest.mark.parametrize("block_size,heads,kv_heads", [(4, 4, 2), (16, 9, 3), (8, 6, 6)])
def test_paged_attention_equals_dense_reference(block_size, heads, kv_heads, kernel):
    rng = random.Random(block_size + heads)
    torch.manual_seed(0)
    dim, num_blocks = 16, 96
    cache = KVCache(
        KVShape(1, kv_heads, dim, block_size), num_blocks, 0, torch.device("cpu"), torch.float32
    )
    cache.pool.normal_()
    # (cached tokens, new tokens): decode rows first, then prefill chunks (fresh and continuing).
    seqs = [(rng.randrange(1, 40), 1) for _ in range(5)] + [(0, 7), (13, 5), (0, 1)]
    free = list(range(num_blocks))
    rng.shuffle(free)  # scattered tables, foreign blocks in between
    rows, write_rows = [], []
    for start, n in seqs:
        table = [free.pop() for _ in range(-(-(start + n) // block_size))]
        rows.append(SeqRows(table, start, n))
        for p in range(start, start + n):
            tile = table[p // block_size] * kv_heads + torch.arange(kv_heads)
            write_rows.append(tile * block_size + p % block_size)
    tokens = sum(n for _, n in seqs)
    q, k, v = (
        torch.randn(tokens, heads, dim),
        torch.randn(tokens, kv_heads, dim),
        torch.randn(tokens, kv_heads, dim),
    )
    args = (kv_heads, heads // kv_heads, block_size, torch.device("cpu"))
    prefill, row = [], 5
    for item in rows[5:]:
        prefill.append(plan_prefill(row, item, *args))
        row += item.q_len
    decode = plan_decode(rows[:5], *args, block_range=kernel is None)
    plan = StepPlan(torch.cat(write_rows), decode, prefill)
    got = PagedAttention(cache, plan, _kernel(kernel))(0, q, k, v)
    row = 0
    for item in rows:
        want = _reference(
            cache.pool[0, 0],
            cache.pool[1, 0],
            item.table,
            item.start + item.q_len,
            q[row : row + item.q_len],
            block_size,
        )
        torch.testing.assert_close(got[row : row + item.q_len], want, atol=2e-6, rtol=1e-5)
        row += item.q_len


def _place(cache, table, keys, values, block_size):
    """Write a sequence's logical K/V `[positions, kv_heads, dim]` into the blocks of `table`."""
    kv_heads = keys.shape[1]
    rows = [
        (table[p // block_size] * kv_heads + torch.arange(kv_heads)) * block_size + p % block_size
        for p in range(keys.shape[0])
    ]
    cache.write(0, keys, values, torch.cat(rows))


def _attend_in_layout(contents, tables, decode, prefill_row, block_size, heads, num_blocks, kernel):
    """Attention outputs of one step whose sequences (K/V/q `contents`) sit in blocks `tables`.

    Sequences listed in `decode` are decode rows (the last position is the new token), in that
    batch order; `prefill_row` names one sequence run as a continuing chunk of its last 5 tokens.
    """
    kv_heads, dim = contents[0][0].shape[1:]
    cache = KVCache(
        KVShape(1, kv_heads, dim, block_size), num_blocks, 0, torch.device("cpu"), torch.float32
    )
    cache.pool.normal_()  # stale data in unused slots must not matter
    qs, ks, vs, seqs = [], [], [], []
    for i in [*decode, prefill_row]:
        keys, values, q = contents[i]
        new = 1 if i != prefill_row else 5
        _place(cache, tables[i], keys[:-new], values[:-new], block_size)
        seqs.append(SeqRows(tables[i], keys.shape[0] - new, new))
        qs.append(q[-new:])
        ks.append(keys[-new:])
        vs.append(values[-new:])
    write_rows = []
    for s in seqs:
        for p in range(s.start, s.start + s.q_len):
            tile = s.table[p // block_size] * kv_heads + torch.arange(kv_heads)
            write_rows.append(tile * block_size + p % block_size)
    args = (kv_heads, heads // kv_heads, block_size, torch.device("cpu"))
    plan = StepPlan(
        torch.cat(write_rows),
        plan_decode(seqs[: len(decode)], *args, block_range=kernel is None),
        [plan_prefill(len(decode), seqs[-1], *args)],
    )
    attention = PagedAttention(cache, plan, _kernel(kernel))
    out = attention(0, torch.cat(qs), torch.cat(ks), torch.cat(vs))
    rows = {i: out[r : r + 1] for r, i in enumerate(decode)}
    rows[prefill_row] = out[len(decode) :]
    return rows


@pytest.mark.parametrize("kernel", DECODE_KERNELS)
@pytest.mark.parametrize("block_size,heads,kv_heads", [(4, 4, 2), (16, 9, 3)])
def test_attention_is_bit_identical_whatever_blocks_a_sequence_holds(
    block_size, heads, kv_heads, kernel
):
    """A migrated request lands in other physical blocks, with other batch companions; its
    attention must not change by a single bit, or greedy/seeded continuations may diverge."""
    torch.manual_seed(1)
    dim, num_blocks = 16, 200
    lengths = [150, 9, 61, 130, 33, 77, 100]  # sequence 0 is the one that moves
    contents = [
        (
            torch.randn(n, kv_heads, dim) * 3,
            torch.randn(n, kv_heads, dim),
            torch.randn(n, heads, dim) * 3,
        )
        for n in lengths
    ]
    need = [-(-n // block_size) for n in lengths]
    # Layout A: blocks handed out in ascending order, sequence 0's first.
    ids = iter(range(num_blocks))
    tables_a = [[next(ids) for _ in range(b)] for b in need]
    # Layout B: every block shuffled, so a sequence's blocks are out of order and interleaved.
    free = list(range(num_blocks))
    random.Random(7).shuffle(free)
    tables_b = [[free.pop() for _ in range(b)] for b in need]
    a = _attend_in_layout(contents, tables_a, [0, 1, 2], 6, block_size, heads, num_blocks, kernel)
    b = _attend_in_layout(
        contents, tables_b, [3, 2, 4, 0, 5], 6, block_size, heads, num_blocks, kernel
    )
    a_moved = _attend_in_layout(
        contents, tables_b, [0, 3, 1], 6, block_size, heads, num_blocks, kernel
    )
    assert torch.equal(a[0], b[0])
    assert torch.equal(a[0], a_moved[0])
    assert torch.equal(a[2], b[2])
    assert torch.equal(a[6], b[6])  # continuing prefill chunk


def test_prefill_is_bit_identical_whatever_the_chunk_bounds():
    """A prompt token's K/V and log-probs do not depend on where the chunks of its prompt
    began or ended (nor on its last token running alone), so a request can continue on
    prompt blocks another request computed (the prefix cache) bit for bit."""
    model = tiny_model("llama", seed=1)
    prompt = prompts([150], seed=3)[0]  # past two prefill tiles, so chunks straddle them
    params = seeded(6, seed=5)
    outs = [run_alone(model, prompt, params, prefill_chunk_size=c) for c in (7, 64, 149, 256)]
    for out in outs[1:]:
        assert out.output_ids == outs[0].output_ids
        assert out.logprobs == outs[0].logprobs
