"""Shared by the Triton kernel tests: interpreter set-up, a random pool, a float64 reference.

Without a GPU the kernels run in Triton's interpreter on CPU tensors. TRITON_INTERPRET is
read when a function is decorated, triton's own library included, and torch._dynamo
imports triton early, so tests/conftest.py sets it before anything is imported (it changes
nothing else: Triton cannot run on a machine without a GPU otherwise).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

triton = pytest.importorskip("triton", reason="dorarl[gpu] (triton) is not installed")
if not torch.cuda.is_available():
    assert os.environ.get("TRITON_INTERPRET") == "1", (
        "no GPU: set TRITON_INTERPRET=1 before triton is imported (tests/conftest.py does)"
    )

from dorarl.engine.attention import SeqRows  # noqa: E402
from dorarl.engine.kv_cache import KVCache, KVShape  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Unit roundoff of each dtype: the exact result rounded once to it is off by at most this
# relative amount, so a correct kernel (float32 inside, one rounding out) stays within a few.
UNIT = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@dataclass
class Pool:
    cache: KVCache
    tables: list[list[int]]  # each sequence's blocks in logical order, physically shuffled


def random_pool(
    ctx: list[int], kv_heads: int, dim: int, block_size: int, dtype: torch.dtype, seed: int = 0
) -> Pool:
    """One-layer pool with random K/V; each sequence gets enough blocks, scattered at random."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-c // block_size) for c in ctx]
    num_blocks = sum(need) + 3
    cache = KVCache(KVShape(1, kv_heads, dim, block_size), num_blocks, 0, DEVICE, dtype)
    cache.pool.copy_(torch.randn(cache.pool.shape, generator=gen).to(dtype))
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(order[at : at + n])
        at += n
    return Pool(cache, tables)


def logical_kv(cache: KVCache, table: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values `[n, kv_heads, dim]` of a sequence's first n positions, in float64."""
    bs = cache.shape.block_size
    blocks = torch.tensor([table[p // bs] for p in range(n)], device=cache.device)
    slots = torch.arange(n, device=cache.device) % bs
    k = cache.pool[0, 0, blocks, :, slots]
    v = cache.pool[1, 0, blocks, :, slots]
    return k.double(), v.double()


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 causal attention of q `[t, heads, dim]` at positions first_pos.. over k/v
    `[n, kv_heads, dim]`, and the same weights applied to |v| (the scale of its roundings)."""
    t, heads, dim = q.shape
    group = heads // k.shape[1]
    kk = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, n, dim]
    vv = v.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ kk.transpose(1, 2) / dim**0.5  # [heads, t, n]
    pos = first_pos + torch.arange(t, device=q.device)
    hidden = torch.arange(k.shape[0], device=q.device)[None, :] > pos[:, None]
    scores = scores.masked_fill(hidden, float("-inf"))
    probs = scores.softmax(-1)
    return (probs @ vv).transpose(0, 1), (probs @ vv.abs()).transpose(0, 1)  # [t, heads, dim]


def assert_close_to_reference(out: torch.Tensor, ref: tuple[torch.Tensor, torch.Tensor], what: str):
    """Elementwise: two roundings of the output plus two of each probability weighing v.

    A correct kernel computes in float32 and rounds its output once to the dtype (at most
    one unit of `UNIT` relative, truncating or not); prefill also rounds the probabilities
    to the dtype before P @ V, adding at most UNIT * sum(p * |v|). Twice that bound, plus
    float32 accumulation noise (1e-6 absolute on O(1) values), leaves no room for a missing
    or extra key, which moves an output by about p * |v - out|.
    """
    exact, scale = ref
    err = (out.double() - exact).abs()
    tol = 2 * UNIT[out.dtype] * (exact.abs() + scale) + 1e-6
    worst = (err / tol).max().item()
    assert worst <= 1.0, f"{what}: error {err.max().item():.2e}, {worst:.2f} x tolerance"
    return worst


def rows_of(pool: Pool, starts: list[int], q_lens: list[int]) -> list[SeqRows]:
    return [SeqRows(t, s, n) for t, s, n in zip(pool.tables, starts, q_lens, strict=True)]
