"""Triton paged attention over the engine's KV pool: decode (GQA, split-K) and chunked prefill.

Both kernels read K/V in place through block tables from the pool of `kv_cache.py`
(`[2, layers, blocks, kv_heads, block_size, head_dim]`; one layer's K is the view
`pool[0, layer]`, `[blocks, kv_heads, block_size, head_dim]`). A program's loop reads a
tile of 64 keys per step, each key's block looked up in the table, so any power-of-two
block size >= 16 works; head_dim 64 or 128 (any power of two >= 16); any GQA ratio: the
query heads sharing a kv head are packed into the rows of one tile, so each K/V tile is
loaded once per kv head. Softmax is online, in float32, with exp2.

- Decode (`paged_decode`): one program per (sequence, kv head, partition of
  `partition_tokens` keys). With one partition it writes the result; with more (long
  contexts) it writes per-partition (max, sum, weighted sum), each row's partitions packed
  one after another (`SplitLayout`: a buffer sized by the rows' own contexts, not by the
  widest table), and a second kernel combines them in partition order. The partition size
  is fixed, never chosen from the batch, so a sequence's output is a function of its own
  logical K/V alone: it does not depend on its companions, on the batch's widest table, or
  on which physical blocks hold its keys (a migrated request continues bit for bit on any
  engine using these kernels, whatever its block size: the loops walk key tiles of a fixed
  size, the block is only a lookup).
- Prefill (`paged_prefill`): one program per (tile of `BLOCK_M` packed (token, head) rows of
  one chunk, kv head). A chunk's queries attend causally to all keys of their sequence up to
  their own position, read from the pool: the caller writes the chunk's new K/V into their
  slots first (`KVCache.write`, an `index_copy_`), so cached and new keys are one path.
- `TritonPagedAttention` is the engine's attention backend built from them (same call as
  `attention.PagedAttention`): write new K/V, decode rows, then prefill rows.

Precision: scores are float32 sums of exact products; the decode kernel keeps the
probabilities in float32 for P @ V (it is bandwidth-bound, so this is free); prefill casts
them to the input dtype for P @ V when that is 16-bit, as FlashAttention does (compute-bound).
float32 inputs use IEEE dots (no TF32).

Wiring (`device_runner.DeviceRunner`, `engine.attention=triton`, cuda's default):
    plan = plan_paged_step(rows, num_decode, kv_heads, q_per_kv, block_size, device)
    attention = TritonPagedAttention(cache, plan)      # rows: the runner's SeqRows list
    logits = model.forward(input_ids, positions, attention, sample_rows)
`plan_paged_step` uploads every index tensor of the step in one host-to-device copy.
Importing this module needs triton; on a machine without a GPU set TRITON_INTERPRET=1
before importing it (the tests do) and the kernels run on CPU tensors.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import triton
import triton.language as tl

from dorarl.engine.config import DECODE_PARTITION_TOKENS
from dorarl.engine.kv_cache import KVCache

LOG2E = 1.4426950408889634
PARTITION_TOKENS = DECODE_PARTITION_TOKENS  # fixed, so results never depend on the batch
DECODE_KEYS = 64  # keys a decode program reads per step of its loop (whatever the block size)
PREFILL_BLOCK_M = 64  # packed (token, head) query rows per prefill program
PREFILL_BLOCK_N = 64  # keys per step of a prefill program's loop


class StepRows(Protocol):
    """One sequence's part of a step (`attention.SeqRows` is one): table, cached, new tokens."""

    table: list[int]
    start: int
    q_len: int


# Triton's interpreter gets bfloat16 dots wrong; there 16-bit tiles meet in float32 dots
# instead, which is the same arithmetic (products of 16-bit numbers are exact in float32).
_UPCAST_DOTS = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dot(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _attend_block(
    q, m, den, acc, k_tile, v_tile, visible, scale,
    PREC: tl.constexpr, P_LOWP: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """One online-softmax step of rows q [M, D] over a key tile [N, D]: the running max (m),
    sum of exp (den) and weighted value sum (acc), in float32 and base 2."""
    s = _dot(q, tl.trans(k_tile), PREC, UPCAST) * scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    den = den * alpha + tl.sum(p, 1)
    if P_LOWP:
        pv = _dot(p.to(v_tile.dtype), v_tile, PREC, UPCAST)
    else:
        pv = tl.dot(p, v_tile.to(tl.float32), input_precision="ieee")
    return m_new, den, acc * alpha[:, None] + pv


@triton.jit
def _load_kv(
    k_ptr, v_ptr, table_ptr, kpos, limit, kvh, stride_kb, stride_kh, stride_kt,
    BS: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    """K and V tiles [keys, D] of key positions kpos through one sequence's block table;
    positions >= limit are not read (zeros) and reported in `valid`."""
    valid = kpos < limit
    block = tl.load(table_ptr + kpos // BS, mask=valid, other=0).to(tl.int64)
    rows = block * stride_kb + kvh * stride_kh + (kpos % BS) * stride_kt
    at = rows[:, None] + tl.arange(0, D)[None, :]
    k_tile = tl.load(k_ptr + at, mask=valid[:, None], other=0.0)
    v_tile = tl.load(v_ptr + at, mask=valid[:, None], other=0.0)
    return k_tile, v_tile, valid


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, part_start_ptr,
    part_m_ptr, part_den_ptr, part_acc_ptr,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kt, stride_tb, stride_ob, stride_oh,
    scale,
    G: tl.constexpr, M: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, KEYS: tl.constexpr,
    PART: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    seq, kvh, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(lens_ptr + seq)
    first = part * PART
    end = tl.minimum(first + PART, ctx)
    rows = tl.arange(0, M)
    dims = tl.arange(0, D)
    row_ok = rows < G
    heads = kvh * G + rows
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    m = tl.full([M], float("-inf"), tl.float32)
    den = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D], tl.float32)
    table = tables_ptr + seq * stride_tb
    for start in range(first, end, KEYS):
        kpos = start + tl.arange(0, KEYS)
        k_tile, v_tile, valid = _load_kv(
            k_ptr, v_ptr, table, kpos, ctx, kvh, stride_kb, stride_kh, stride_kt, BS, D
        )
        m, den, acc = _attend_block(
            q, m, den, acc, k_tile, v_tile, valid[None, :], scale, PREC, False, UPCAST
        )
    if SPLIT:
        if first < end:  # a row's partitions are packed from its start: (partition, kv head)
            at = (tl.load(part_start_ptr + seq) + part) * tl.num_programs(1) + kvh
            tl.store(part_m_ptr + at * M + rows, m)
            tl.store(part_den_ptr + at * M + rows, den)
            tl.store(part_acc_ptr + (at * M + rows[:, None]) * D + dims[None, :], acc)
    else:
        out = acc / tl.where(den > 0, den, 1.0)[:, None]  # den == 0 only on padded rows (ctx 0)
        tl.store(
            out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None],
        )


@triton.jit
def _combine_kernel(
    lens_ptr, out_ptr, part_start_ptr, part_m_ptr, part_den_ptr, part_acc_ptr,
    stride_ob, stride_oh,
    G: tl.constexpr, M: tl.constexpr, D: tl.constexpr, PART: tl.constexpr,
):  # fmt: skip
    """Merge a sequence's partitions in partition order (only its own, however wide the grid)."""
    seq, kvh = tl.program_id(0), tl.program_id(1)
    own_parts = tl.cdiv(tl.load(lens_ptr + seq), PART)
    first = tl.load(part_start_ptr + seq)
    rows = tl.arange(0, M)
    dims = tl.arange(0, D)
    m = tl.full([M], float("-inf"), tl.float32)
    den = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D], tl.float32)
    for part in range(0, own_parts):
        at = (first + part) * tl.num_programs(1) + kvh
        m_p = tl.load(part_m_ptr + at * M + rows)
        m_new = tl.maximum(m, m_p)
        alpha, beta = tl.exp2(m - m_new), tl.exp2(m_p - m_new)
        den = den * alpha + tl.load(part_den_ptr + at * M + rows) * beta
        acc_p = tl.load(part_acc_ptr + (at * M + rows[:, None]) * D + dims[None, :])
        acc = acc * alpha[:, None] + acc_p * beta[:, None]
        m = m_new
    out = acc / tl.where(den > 0, den, 1.0)[:, None]
    heads = kvh * G + rows
    tl.store(
        out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=(rows < G)[:, None],
    )


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, tile_chunk_ptr, tile_row_ptr,
    q_start_ptr, q_len_ptr, cached_ptr,
    stride_qt, stride_qh, stride_kb, stride_kh, stride_kt, stride_tb, stride_ot, stride_oh,
    scale,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr,
    D: tl.constexpr, PREC: tl.constexpr, P_LOWP: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    work, kvh = tl.program_id(0), tl.program_id(1)
    chunk = tl.load(tile_chunk_ptr + work)
    row0 = tl.load(tile_row_ptr + work)
    q_start = tl.load(q_start_ptr + chunk)
    q_len = tl.load(q_len_ptr + chunk)
    cached = tl.load(cached_ptr + chunk)
    rows = row0 + tl.arange(0, BLOCK_M)
    tok = rows // G
    valid = tok < q_len
    heads = kvh * G + rows % G
    pos = tl.where(valid, cached + tok, 0)  # invalid rows see key 0 only: finite, never stored
    dims = tl.arange(0, D)
    q = tl.load(
        q_ptr + (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=valid[:, None],
        other=0.0,
    )
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    end = cached + tl.minimum((row0 + BLOCK_M - 1) // G, q_len - 1) + 1  # keys the tile sees
    table = tables_ptr + chunk * stride_tb
    for start in range(0, end, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        k_tile, v_tile, _ = _load_kv(
            k_ptr, v_ptr, table, kpos, end, kvh, stride_kb, stride_kh, stride_kt, BS, D
        )
        visible = kpos[None, :] <= pos[:, None]
        m, den, acc = _attend_block(
            q, m, den, acc, k_tile, v_tile, visible, scale, PREC, P_LOWP, UPCAST
        )
    out = acc / den[:, None]
    tl.store(
        out_ptr + (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=valid[:, None],
    )


def _precision(dtype: torch.dtype) -> str:
    """float32 dots in IEEE float32, never TF32 (16-bit dots ignore the setting)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_layer_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, q: torch.Tensor) -> None:
    block_size, dim = k_cache.shape[2], k_cache.shape[3]
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    assert block_size >= 16 and block_size & (block_size - 1) == 0, block_size
    assert dim >= 16 and dim & (dim - 1) == 0 and q.shape[-1] == dim, dim
    assert q.stride(-1) == 1 and q.dtype == k_cache.dtype
    assert q.shape[1] % k_cache.shape[1] == 0, "query heads must be a multiple of kv heads"


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor | None = None,
    partition_tokens: int = PARTITION_TOKENS,
    keys_per_tile: int = DECODE_KEYS,
    split: SplitLayout | None = None,
) -> torch.Tensor:
    """One new query per sequence over its cached keys (its own key written already).

    q `[batch, heads, dim]`; k_cache, v_cache one layer's pool views `[blocks, kv_heads,
    block_size, dim]`; tables `[batch, width]` block ids (entries past a row's context are
    never read); context_lens `[batch]` keys per row (0: a padded row, output 0). Returns
    `[batch, heads, dim]` (into `out` when given). No host sync: the grid comes from shapes.
    `split` packs the partials of long contexts (`SplitLayout`); None gives every row room
    for the widest table's partitions.
    """
    _check_layer_cache(k_cache, v_cache, q)
    batch, heads, dim = q.shape
    kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    rows = max(16, triton.next_power_of_2(group))
    assert partition_tokens % keys_per_tile == 0 and keys_per_tile >= 16, "tile sizes"
    num_parts = triton.cdiv(tables.shape[1] * block_size, partition_tokens)
    out = torch.empty_like(q) if out is None else out
    is_split = num_parts > 1
    starts = part_m = part_den = part_acc = out  # not touched when not split
    if is_split:
        if split is None:
            split = SplitLayout(torch.arange(batch, device=q.device) * num_parts, batch * num_parts)
        starts = split.starts
        part_m, part_den, part_acc = split_buffers(split.parts, kv_heads, rows, dim, q.device)
    scale = LOG2E / math.sqrt(dim)
    _decode_kernel[(batch, kv_heads, num_parts)](
        q, k_cache, v_cache, tables, context_lens, out, starts, part_m, part_den, part_acc,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        tables.stride(0), out.stride(0), out.stride(1), scale,
        G=group, M=rows, BS=block_size, D=dim, KEYS=keys_per_tile, PART=partition_tokens,
        SPLIT=is_split, PREC=_precision(q.dtype),
        UPCAST=_UPCAST_DOTS,
    )  # fmt: skip
    if is_split:
        _combine_kernel[(batch, kv_heads)](
            context_lens, out, starts, part_m, part_den, part_acc, out.stride(0), out.stride(1),
            G=group, M=rows, D=dim, PART=partition_tokens,
        )  # fmt: skip
    return out


@dataclass
class SplitLayout:
    """Where each decode row's split-K partials go: its partitions one after another from
    `starts[row]`, in a buffer of `parts` partitions (the rows' total, or a bound on it: a
    graph's buffer must serve every step it replays)."""

    starts: torch.Tensor  # [batch] int64, on the device
    parts: int


def split_buffers(
    parts: int, kv_heads: int, rows: int, dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The partials of `parts` partitions, `(partition, kv head)`-major: max, sum, values."""
    part_m = torch.empty(parts, kv_heads, rows, device=device)
    return part_m, torch.empty_like(part_m), torch.empty(parts, kv_heads, rows, dim, device=device)


def packed_partitions(
    contexts: Sequence[int], partition_tokens: int = PARTITION_TOKENS
) -> tuple[list[int], int]:
    """Each row's first partition in a packed split layout (its own follow), and the total."""
    starts, at = [], 0
    for ctx in contexts:
        starts.append(at)
        at += -(-ctx // partition_tokens)
    return starts, at


@dataclass
class PrefillWork:
    """The prefill chunks of a step and the programs that cover them (device tensors)."""

    tables: torch.Tensor  # [chunks, width] block ids of each chunk's sequence
    q_start: torch.Tensor  # [chunks] first row of the chunk in the step's q
    q_len: torch.Tensor  # [chunks] new tokens of the chunk
    cached: torch.Tensor  # [chunks] tokens of the sequence before the chunk
    tile_chunk: torch.Tensor  # [tiles] chunk of each program
    tile_row: torch.Tensor  # [tiles] first packed (token, head) row of each program


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    work: PrefillWork,
    out: torch.Tensor,
    block_m: int = PREFILL_BLOCK_M,
    block_n: int = PREFILL_BLOCK_N,
) -> torch.Tensor:
    """Causal attention of each chunk's queries (rows of q `[tokens, heads, dim]`) over its
    sequence's keys in the pool, the chunk's own already written; results into `out` rows."""
    _check_layer_cache(k_cache, v_cache, q)
    heads, dim = q.shape[1], q.shape[2]
    kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    _prefill_kernel[(work.tile_chunk.shape[0], kv_heads)](
        q, k_cache, v_cache, out, work.tables, work.tile_chunk, work.tile_row,
        work.q_start, work.q_len, work.cached,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        work.tables.stride(0), out.stride(0), out.stride(1), LOG2E / math.sqrt(dim),
        G=heads // kv_heads, BLOCK_M=block_m, BLOCK_N=block_n, BS=block_size, D=dim,
        PREC=_precision(q.dtype), P_LOWP=q.dtype != torch.float32, UPCAST=_UPCAST_DOTS,
    )  # fmt: skip
    return out


@dataclass
class PagedStep:
    """Everything one step's attention reads, on the device, shared by every layer."""

    write_rows: torch.Tensor  # [tokens * kv_heads] flat pool row of each new (token, kv head)
    num_decode: int
    decode_tables: torch.Tensor  # [num_decode, width]
    decode_lens: torch.Tensor  # [num_decode]
    prefill: PrefillWork | None
    decode_split: SplitLayout | None = None  # packed partials (None: room for the widest)


def plan_paged_step(
    rows: Sequence[StepRows],
    num_decode: int,
    kv_heads: int,
    q_per_kv: int,
    block_size: int,
    device: torch.device,
    block_m: int = PREFILL_BLOCK_M,
) -> PagedStep:
    """The step's tensors from per-sequence rows (decode rows first, then prefill chunks)."""
    host = _HostStep(rows, num_decode, kv_heads, q_per_kv, block_size, block_m)
    flat = torch.tensor(host.flat(), dtype=torch.long)
    if torch.device(device).type == "cuda":
        flat = flat.pin_memory()
    dev = flat.to(device, non_blocking=True)
    parts = dict(zip(host.names, dev.split(host.sizes), strict=True))
    decode_tables = _as_rows(parts["decode_tables"], num_decode)
    prefill = None
    if len(rows) > num_decode:
        prefill = PrefillWork(
            tables=_as_rows(parts["prefill_tables"], len(rows) - num_decode),
            **{k: parts[k] for k in ("q_start", "q_len", "cached", "tile_chunk", "tile_row")},
        )
    split = SplitLayout(parts["decode_part_starts"], host.decode_parts)
    return PagedStep(
        parts["write_rows"], num_decode, decode_tables, parts["decode_lens"], prefill, split
    )


def _as_rows(flat: torch.Tensor, rows: int) -> torch.Tensor:
    return flat.view(rows, flat.numel() // max(rows, 1))


class _HostStep:
    """The step's index arrays as Python lists, flattened for one upload."""

    def __init__(
        self,
        rows: Sequence[StepRows],
        num_decode: int,
        kv_heads: int,
        q_per_kv: int,
        block_size: int,
        block_m: int,
    ) -> None:
        self.arrays: dict[str, list[int]] = {"write_rows": _write_rows(rows, kv_heads, block_size)}
        decode, prefill = rows[:num_decode], rows[num_decode:]
        self.arrays["decode_tables"] = _padded_tables(decode, block_size)
        self.arrays["decode_lens"] = [r.start + 1 for r in decode]
        starts, self.decode_parts = packed_partitions(self.arrays["decode_lens"])
        self.arrays["decode_part_starts"] = starts
        if prefill:
            self.arrays["prefill_tables"] = _padded_tables(prefill, block_size)
            self.arrays["q_start"] = _chunk_starts(prefill, num_decode)
            self.arrays["q_len"] = [r.q_len for r in prefill]
            self.arrays["cached"] = [r.start for r in prefill]
            chunk, row = _tiles(prefill, q_per_kv, block_m)
            self.arrays["tile_chunk"], self.arrays["tile_row"] = chunk, row
        self.names = list(self.arrays)
        self.sizes = [len(a) for a in self.arrays.values()]

    def flat(self) -> list[int]:
        return [x for a in self.arrays.values() for x in a]


def _write_rows(rows: Sequence[StepRows], kv_heads: int, block_size: int) -> list[int]:
    """Flat pool row (`KVCache.rows` order) of each new token's k/v per kv head."""
    out = []
    for r in rows:
        for pos in range(r.start, r.start + r.q_len):
            tile = r.table[pos // block_size] * kv_heads
            out.extend((tile + h) * block_size + pos % block_size for h in range(kv_heads))
    return out


def _padded_tables(rows: Sequence[StepRows], block_size: int) -> list[int]:
    """Row-major `[rows, width]` tables cut to the blocks each row reads, padded with 0."""
    used = [-(-(r.start + r.q_len) // block_size) for r in rows]
    width = max(used, default=0)
    return [b for r, n in zip(rows, used, strict=True) for b in r.table[:n] + [0] * (width - n)]


def _chunk_starts(prefill: Sequence[StepRows], first_row: int) -> list[int]:
    starts, row = [], first_row
    for r in prefill:
        starts.append(row)
        row += r.q_len
    return starts


def _tiles(prefill: Sequence[StepRows], q_per_kv: int, block_m: int) -> tuple[list[int], list[int]]:
    chunk, row = [], []
    for i, r in enumerate(prefill):
        for first in range(0, r.q_len * q_per_kv, block_m):
            chunk.append(i)
            row.append(first)
    return chunk, row


class TritonPagedAttention:
    """The engine's attention backend on the Triton kernels (same call as `PagedAttention`)."""

    def __init__(self, cache: KVCache, step: PagedStep) -> None:
        self.cache = cache
        self.step = step

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q `[tokens, heads, dim]`, k and v `[tokens, kv_heads, dim]` -> `[tokens, heads * dim]`."""
        s = self.step
        self.cache.write(layer, k, v, s.write_rows)
        k_cache, v_cache = self.cache.pool[0, layer], self.cache.pool[1, layer]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if s.num_decode:
            d = s.num_decode
            paged_decode(
                q[:d], k_cache, v_cache, s.decode_tables, s.decode_lens, out=out[:d],
                split=s.decode_split,
            )  # fmt: skip
        if s.prefill is not None:
            paged_prefill(q, k_cache, v_cache, s.prefill, out)
        return out.view(q.shape[0], -1)
