"""Paged attention over the KV pool for one step's flattened tokens, reading K/V in place.

A step's attention is planned once (`plan_step`, shared by every layer) from plain
per-sequence data, the same a GPU paged kernel takes: block tables, cached lengths, query
lengths. Rows are decode rows first, then one chunk per prefill row.
- Decode rows are attended block-parallel over the pool's contiguous block range that holds
  them, as a view (no copy of the context): each block's keys meet its owner's queries in one
  batched matmul, the softmax max is a per-sequence scatter max and the sums of exp and of
  weighted values are reduced per sequence. Blocks of the range that belong to no decode
  row are masked. The allocator hands out low block ids first, so the range stays tight.
  Where decode rows share prefix blocks (the prefix cache), each row's blocks are gathered
  instead, one entry per (row, block), and the same per-entry arithmetic runs on them.
  Cross-block sums run in each sequence's logical block order, never the physical one: the
  small per-block partials (sum of exp, weighted value sum) are permuted into logical order
  and added by a fixed pairwise tree, so a sequence's output is a function of its logical K/V
  alone, bit for bit (a migrated request lands in other blocks and must continue exactly).
- With the fused CPU kernel (cpu_kernels.py, `engine.attention=cpp`) a layer's decode rows
  take one call instead: per row and kv head it walks the block table in logical order and
  runs scores, softmax and weighted values in a fixed order over that row's keys alone, so
  the same invariant holds (its rounding differs from the tensor path's by float32 noise).
- A prefill chunk gathers its sequence's blocks once per layer (its own new keys were
  written first) and attends in query tiles of `PREFILL_TILE` positions aligned to the
  sequence's start: tile t holds positions [tT, (t+1)T) and attends over keys [0, (t+1)T),
  one `scaled_dot_product_attention` of fixed shapes whatever the chunk (rows outside the
  chunk are zeros, keys past the sequence's end masked). So a prompt token's K/V and output
  do not depend on how its prompt was chunked, nor on where a chunk began: a sequence that
  reads a prefix another sequence computed (the prefix cache, block_manager.py) computes
  the rest bit for bit as if it had computed the prefix itself.
The query heads sharing a kv head ride in the query axis (GQA needs no key repetition).
Invariant: a query at position p sees exactly keys 0..p of its own sequence, and its result
does not depend, even by rounding, on which physical blocks hold them, on its neighbours, or
(prefill) on its chunk's bounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dorarl.engine.cpu_kernels import DecodeKernel
from dorarl.engine.kv_cache import KVCache

# Query positions per prefill tile: a tile's shapes (and so its rounding) are a function of
# its index alone, whatever chunk it is computed in.
PREFILL_TILE = 64


@dataclass
class SeqRows:
    """One sequence's part of a step: its block table, tokens already cached, new tokens."""

    table: list[int]
    start: int
    q_len: int


@dataclass
class BlockRange:
    """The tensor path's view of a step's decode rows: one entry per block a row reads.

    Where each block is read by one row, the entries are the pool block range [lo, hi) that
    holds them, read in place (blocks of no decode row in it are masked); where rows share
    prefix blocks, each (row, block) pair is an entry, gathered (`gather`)."""

    lo: int  # pool block range [lo, hi) holding every decode row's context (no gather)
    hi: int
    owner: torch.Tensor  # [entries] decode row of each entry (0 for foreign blocks: masked)
    owner_index: torch.Tensor  # owner expanded to [entries, kv_heads, q_per_kv], for scatter
    mask: torch.Tensor  # [entries, 1, 1, block_size] additive: 0 attends, -inf does not
    # Each decode row's entries in logical order, as indices into the per-entry partials;
    # padded to a power of two with `entries` (an all-zero partial) for the tree sum.
    logical: torch.Tensor  # [batch * pow2 width]
    width: int  # the power-of-two width
    full: bool = False  # every row holds `width` blocks: no entry points at the zero partial
    gather: torch.Tensor | None = None  # [entries] pool block of each entry, when gathered

    @property
    def entries(self) -> int:
        return self.hi - self.lo if self.gather is None else len(self.gather)


@dataclass
class DecodePlan:
    batch: int
    # What a paged kernel takes (the fused CPU kernel, cpu_kernels.py): padded block tables
    # (-1 pads) and lengths.
    tables: torch.Tensor  # [batch, max blocks]
    context_lens: torch.Tensor  # [batch] keys each decode row attends to
    blocks: BlockRange | None  # the tensor path's view; None where the fused kernel runs


@dataclass
class QueryTile:
    """One prefill tile: `PREFILL_TILE` query positions aligned to the sequence's start."""

    keys: int  # keys it attends over: every position up to the tile's end
    offset: int  # position of its first chunk row within the tile
    rows: slice  # the chunk's token rows (relative to the chunk) that fall in the tile
    mask: torch.Tensor  # [1, 1, PREFILL_TILE * q_per_kv, keys], True = attend


@dataclass
class PrefillPlan:
    row: int  # first token row of the chunk in the step
    q_len: int
    tiles: torch.Tensor  # [kv_heads * blocks] pool tiles (head, block) of the context's keys
    query_tiles: list[QueryTile]


@dataclass
class StepPlan:
    write_rows: torch.Tensor  # flat pool row of each (new token, kv head)
    decode: DecodePlan | None
    prefill: list[PrefillPlan]


def plan_decode(
    seqs: list[SeqRows],
    kv_heads: int,
    q_per_kv: int,
    block_size: int,
    device: torch.device,
    block_range: bool = True,
) -> DecodePlan:
    """The decode rows' plan; `block_range=False` skips the tensor path's view (fused kernel)."""
    ctx = [s.start + 1 for s in seqs]
    num_blocks = [-(-c // block_size) for c in ctx]
    width = max(num_blocks)
    padded = [s.table[:n] + [-1] * (width - n) for s, n in zip(seqs, num_blocks, strict=True)]
    table = torch.tensor(padded, dtype=torch.long)
    blocks = None
    if block_range:
        blocks = _block_range(table, ctx, num_blocks, kv_heads, q_per_kv, block_size, device)
    return DecodePlan(
        batch=len(seqs),
        tables=table.to(device),
        context_lens=torch.tensor(ctx, device=device),
        blocks=blocks,
    )


def _block_range(
    table: torch.Tensor,
    ctx: list[int],
    num_blocks: list[int],
    kv_heads: int,
    q_per_kv: int,
    block_size: int,
    device: torch.device,
) -> BlockRange:
    width = table.shape[1]
    used = table >= 0
    ids = table[used]  # row by row, each row's blocks in logical order
    gather = None
    if len(set(ids.tolist())) == len(ids):  # no block read by two rows: the range in place
        lo, hi = int(ids.min()), int(ids.max()) + 1
        entry, entries = ids - lo, hi - lo
    else:  # rows share prefix blocks: one gathered entry per (row, block)
        lo = hi = 0
        entry, entries = torch.arange(len(ids)), len(ids)
        gather = ids.to(device)
    rows = torch.arange(len(ctx))[:, None].expand_as(table)
    first_key = torch.arange(width)[None, :] * block_size
    valid = (torch.tensor(ctx)[:, None] - first_key).clamp(0, block_size)
    owner = torch.zeros(entries, dtype=torch.long)
    owner[entry] = rows[used]
    keys = torch.zeros(entries, dtype=torch.long)  # keys of its owner each entry holds
    keys[entry] = valid[used]
    mask = torch.zeros(entries, 1, 1, block_size)
    mask.masked_fill_(
        torch.arange(block_size)[None, None, None, :] >= keys[:, None, None, None], -math.inf
    )
    owner = owner.to(device)
    pow2 = 1 << (width - 1).bit_length()
    logical = torch.full((len(ctx), pow2), entries, dtype=torch.long)
    logical[:, :width][used] = entry
    return BlockRange(
        lo=lo,
        hi=hi,
        owner=owner,
        owner_index=owner[:, None, None].expand(entries, kv_heads, q_per_kv),
        mask=mask.to(device),
        logical=logical.view(-1).to(device),
        width=pow2,
        full=all(n == pow2 for n in num_blocks),
        gather=gather,
    )


def plan_prefill(
    row: int, seq: SeqRows, kv_heads: int, q_per_kv: int, block_size: int, device: torch.device
) -> PrefillPlan:
    """The chunk's query tiles, and the pool tiles of every key its last tile spans: the
    table's blocks, then its first block again where the tile runs past the table (keys
    past the sequence's end are masked, so any finite K/V will do)."""
    end = seq.start + seq.q_len
    first, last = seq.start // PREFILL_TILE, -(-end // PREFILL_TILE)
    num_blocks = -(-last * PREFILL_TILE // block_size)
    held = -(-end // block_size)
    blocks = seq.table[:held] + [seq.table[0]] * (num_blocks - held)
    table = torch.tensor(blocks, dtype=torch.long, device=device)
    heads = torch.arange(kv_heads, device=device)
    tiles = (table[None, :] * kv_heads + heads[:, None]).reshape(-1)  # (head, block)
    query_tiles = [_query_tile(t, seq.start, end, q_per_kv, device) for t in range(first, last)]
    return PrefillPlan(row, seq.q_len, tiles, query_tiles)


def _query_tile(t: int, start: int, end: int, q_per_kv: int, device: torch.device) -> QueryTile:
    lo, hi = max(start, t * PREFILL_TILE), min(end, (t + 1) * PREFILL_TILE)
    keys = (t + 1) * PREFILL_TILE
    # Query row r is position tT + r // q_per_kv (query heads of one kv head are adjacent).
    positions = t * PREFILL_TILE + torch.arange(PREFILL_TILE, device=device)
    last_key = positions.repeat_interleave(q_per_kv)
    mask = torch.arange(keys, device=device)[None, :] <= last_key[:, None]
    return QueryTile(keys, lo - t * PREFILL_TILE, slice(lo - start, hi - start), mask[None, None])


class PagedAttention:
    """Attention backend of the engine: writes new keys to the pool, attends over it in place.

    With `decode_kernel` (cpu_kernels.py's fused op) decode rows take one call per layer;
    the plan then has no block-range view (`plan_decode(block_range=False)`)."""

    def __init__(
        self, cache: KVCache, plan: StepPlan, decode_kernel: DecodeKernel | None = None
    ) -> None:
        self.cache = cache
        self.plan = plan
        self.decode_kernel = decode_kernel
        blocks = None if plan.decode is None else plan.decode.blocks
        self._decode_mask = None if blocks is None else self._scores_mask(blocks)

    def _scores_mask(self, r: BlockRange) -> torch.Tensor:
        """The decode mask as the additive input of the scores product, `[blocks * kv_heads,
        1, block_size]`: made once a step, not once a layer."""
        blocks, kv_heads = r.entries, self.cache.shape.num_kv_heads
        mask = r.mask.to(self.cache.dtype)  # baddbmm takes one dtype
        return mask.expand(blocks, kv_heads, 1, -1).reshape(blocks * kv_heads, 1, -1)

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q `[tokens, heads, dim]`, k and v `[tokens, kv_heads, dim]` -> `[tokens, heads * dim]`."""
        self.cache.write(layer, k, v, self.plan.write_rows)
        outs = []
        if self.plan.decode is not None:
            outs.append(self._decode(layer, q, self.plan.decode))
        outs.extend(self._prefill(layer, q, p) for p in self.plan.prefill)
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _decode(self, layer: int, q: torch.Tensor, d: DecodePlan) -> torch.Tensor:
        if self.decode_kernel is not None:
            keys, values = self.cache.block_range(layer, 0, self.cache.pool.shape[2])
            q_rows = q[: d.batch] if q.stride(-1) == 1 else q[: d.batch].contiguous()
            scale = 1.0 / math.sqrt(q.shape[2])
            return self.decode_kernel(q_rows, keys, values, d.tables, d.context_lens, scale)
        assert d.blocks is not None, "plan_decode(block_range=False) needs the fused kernel"
        return self._decode_blocks(layer, q, d.batch, d.blocks)

    def _decode_blocks(
        self, layer: int, q: torch.Tensor, batch: int, d: BlockRange
    ) -> torch.Tensor:
        heads, dim = q.shape[1], q.shape[2]
        kv_heads = self.cache.shape.num_kv_heads
        per_kv = heads // kv_heads
        if d.gather is None:  # [entries, kv_heads, bs, dim]
            keys, values = self.cache.block_range(layer, d.lo, d.hi)
        else:
            keys, values = self.cache.blocks(layer, d.gather)
        blocks, bs = keys.shape[0], keys.shape[2]
        qd = q[:batch].unflatten(1, (kv_heads, per_kv))
        # Each op costs tens of microseconds inside a step, whatever its size, so the scale
        # and the mask ride in the scores product (baddbmm: mask + alpha q k^T). A power-of-two
        # scale (head_dim 16, 64, 256) is exact there; any other is applied to q, as before.
        scale = 1.0 / math.sqrt(dim)
        alpha = scale if math.log2(scale).is_integer() else 1.0
        if alpha != scale:
            qd = qd * scale
        q_blocks = qd.index_select(0, d.owner).view(blocks * kv_heads, per_kv, dim)
        k_blocks = keys.reshape(blocks * kv_heads, bs, dim).transpose(1, 2)
        scores = torch.baddbmm(self._decode_mask, q_blocks, k_blocks, alpha=alpha)
        scores = scores.view(blocks, kv_heads, per_kv, bs)
        # Every decode row owns a block, so each entry of row_max gets a value.
        row_max = torch.empty((batch, kv_heads, per_kv), dtype=q.dtype, device=q.device)
        row_max.scatter_reduce_(0, d.owner_index, scores.amax(-1), "amax", include_self=False)
        probs = scores.sub_(row_max.index_select(0, d.owner).unsqueeze(-1)).exp_()
        # Per-entry partials (weighted value sum | sum of exp), plus one zero partial (index
        # `entries`) that pads the logical tables where a row holds fewer than `width` blocks:
        # one tree sum serves both.
        partials = torch.cat((torch.matmul(probs, values), probs.sum(-1, keepdim=True)), -1)
        if not d.full:
            partials = F.pad(partials, (0, 0, 0, 0, 0, 0, 0, 1))
        total = _logical_tree_sum(partials, d.logical, batch, d.width)
        return torch.div(total[..., :dim], total[..., dim:]).view(batch, heads * dim)

    def _prefill(self, layer: int, q: torch.Tensor, p: PrefillPlan) -> torch.Tensor:
        heads, dim = q.shape[1], q.shape[2]
        kv_heads = self.cache.shape.num_kv_heads
        per_kv = heads // kv_heads
        chunk = q[p.row : p.row + p.q_len].view(p.q_len, kv_heads, per_kv, dim)
        keys, values = self.cache.gather(layer, p.tiles, 1)  # [1, kv_heads, keys, dim]
        outs = []
        for tile in p.query_tiles:
            rows = chunk[tile.rows]
            n = rows.shape[0]
            if n < PREFILL_TILE:  # a tile the chunk only partly covers: zero rows around it
                padded = rows.new_zeros(PREFILL_TILE, kv_heads, per_kv, dim)
                rows = padded.index_copy_(0, torch.arange(n, device=q.device) + tile.offset, rows)
            qt = rows.permute(1, 0, 2, 3).reshape(1, kv_heads, PREFILL_TILE * per_kv, dim)
            out = F.scaled_dot_product_attention(
                qt, keys[:, :, : tile.keys], values[:, :, : tile.keys], attn_mask=tile.mask
            )
            out = out.view(kv_heads, PREFILL_TILE, per_kv, dim)[:, tile.offset : tile.offset + n]
            outs.append(out.permute(1, 0, 2, 3).reshape(n, heads * dim))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


def _logical_tree_sum(
    partials: torch.Tensor, logical: torch.Tensor, batch: int, width: int
) -> torch.Tensor:
    """Sum each row's per-block partials in logical block order by a fixed pairwise tree.

    Padding to a power of two with exact zeros leaves the tree over a row's real blocks
    unchanged (x + 0 == x), so the result does not depend on the batch's widest row either.
    """
    acc = partials.index_select(0, logical).view(batch, width, *partials.shape[1:])
    while width > 1:
        width //= 2
        acc = acc[:, :width] + acc[:, width:]
    return acc[:, 0]
