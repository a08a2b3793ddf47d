"""Start-up checks of the fast paths on the engine's own device: a kernel that does not
compile there, or computes wrong values, or a graph that does not capture, is found before
the first request, so the engine can run the torch path instead of dying at its first step.

- `check_triton_attention`: one mixed step of the Triton kernels (decode rows, one long
  enough to split into two partitions, and a prefill chunk over cached keys) on a tiny
  one-layer pool of the model's head shape, block size and dtype (the specializations the
  engine will run, compiled here once), against attention.py on a copy of the same pool.
- `check_graph_replay`: the smallest bucket's captured graph replayed against its eager
  forward over the same static inputs.
Each raises `PreflightFailed` whose message is the failure in one line.
"""

from __future__ import annotations

import torch

from dorarl.engine.attention import PagedAttention, SeqRows, StepPlan, plan_decode, plan_prefill
from dorarl.engine.config import DECODE_PARTITION_TOKENS
from dorarl.engine.kv_cache import KVCache, KVShape

# Elementwise tolerance, relative to 1 + |reference|: a few roundings of the 16-bit
# dtypes (the torch path rounds its probabilities to them), far below what a wrong key,
# a missing rescale or garbage gives on the unit-scale values checked here.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 6e-2, torch.float16: 1e-2}


class PreflightFailed(RuntimeError):
    """A fast path failed its start-up check; the message says how, in one line."""


def check_triton_attention(
    num_kv_heads: int, head_dim: int, queries_per_kv: int, block_size: int,
    device: torch.device, dtype: torch.dtype,
) -> None:  # fmt: skip
    """The Triton step equals attention.py's on the same pool, within `TOLERANCE`."""
    from dorarl.engine.triton_attention import TritonPagedAttention, plan_paged_step

    contexts = [1, block_size + 3, DECODE_PARTITION_TOKENS + block_size + 1]
    prefill = SeqRows([], block_size + 5, 7)  # continues a cached context
    rows, blocks = _rows(contexts, prefill, block_size)
    shape = KVShape(1, num_kv_heads, head_dim, block_size)
    gen = torch.Generator().manual_seed(0)
    ours = KVCache(shape, blocks, 0, device, dtype)
    ours.pool.copy_(torch.randn(ours.pool.shape, generator=gen).to(dtype))
    theirs = KVCache(shape, blocks, 0, device, dtype)
    theirs.pool.copy_(ours.pool)
    tokens, heads = len(contexts) + prefill.q_len, num_kv_heads * queries_per_kv
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(device, dtype)
    k, v = (
        torch.randn(tokens, num_kv_heads, head_dim, generator=gen).to(device, dtype) for _ in "kv"
    )
    decode = len(contexts)
    step = plan_paged_step(rows, decode, num_kv_heads, queries_per_kv, block_size, device)
    got = TritonPagedAttention(ours, step)(0, q, k, v)
    args = (num_kv_heads, queries_per_kv, block_size, device)
    plan = StepPlan(
        step.write_rows,
        plan_decode(rows[:decode], *args),
        [plan_prefill(decode, rows[decode], *args)],
    )
    want = PagedAttention(theirs, plan)(0, q, k, v)
    _compare("Triton attention", got, want, TOLERANCE[dtype])


def _rows(contexts: list[int], prefill: SeqRows, block_size: int) -> tuple[list[SeqRows], int]:
    """Decode rows of these contexts and the prefill chunk, over blocks handed out from the
    top down (tables that are not the identity); and how many blocks they take."""
    sizes = [-(-c // block_size) for c in contexts]
    sizes.append(-(-(prefill.start + prefill.q_len) // block_size))
    total = sum(sizes)
    order, at, tables = list(range(total - 1, -1, -1)), 0, []
    for n in sizes:
        tables.append(order[at : at + n])
        at += n
    rows = [SeqRows(t, c - 1, 1) for t, c in zip(tables, contexts, strict=False)]
    return rows + [SeqRows(tables[-1], prefill.start, prefill.q_len)], total


def check_graph_replay(graphs) -> None:  # noqa: ANN001 (decode_graphs.DecodeGraphs: needs triton)
    """A captured graph's logits equal its eager forward's over the same inputs (one row
    writing and reading the scratch block, which no sequence owns)."""
    if not graphs.graphs:
        return  # nothing captured: `run` is the eager forward itself
    row = SeqRows([graphs.scratch_block], 0, 1)
    replayed = graphs.run([1], [row]).clone()
    eager = graphs.eager(1)
    _compare("CUDA graph replay", replayed, eager, TOLERANCE[graphs.cache.dtype])


def _compare(what: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    got, want = got.float(), want.float()
    if not torch.isfinite(got).all():
        raise PreflightFailed(f"{what} gave non-finite values")
    worst = ((got - want).abs() / (1 + want.abs())).max().item()
    if not worst <= tol:
        raise PreflightFailed(
            f"{what} differs from the reference by {worst:.3g} (relative to 1 + |value|; "
            f"tolerance {tol:g})"
        )
