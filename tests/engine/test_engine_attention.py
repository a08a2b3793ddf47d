"""Paged attention against a dense reference: ragged contexts, scattered blocks, GQA ratios."""

import random

import pytest
import torch
import torch.nn.functional as F

from dorarl.engine.attention import (
    PagedAttention,
    SeqRows,
    StepPlan,
    plan_decode,
    plan_prefill,
)
from dorarl.engine.kv_cache import KVCache, KVShape


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


@pytest.mark.parametrize("block_size,heads,kv_heads", [(4, 4, 2), (16, 9, 3), (8, 6, 6)])
def test_paged_attention_equals_dense_reference(block_size, heads, kv_heads):
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
    plan = StepPlan(torch.cat(write_rows), plan_decode(rows[:5], *args), prefill)
    got = PagedAttention(cache, plan)(0, q, k, v)
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
