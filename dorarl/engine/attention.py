"""Paged attention over the KV pool for one step's flattened tokens.

Rows of a step are grouped: decode rows (one query each) sorted by context length and cut
into a few length buckets, then one group per prefill chunk. Per layer and group, one
`index_select` gathers the group's blocks into `[batch, kv_heads, ctx, dim]` and one SDPA
call attends; the query heads sharing a kv head ride in SDPA's query-length axis, so GQA
needs no key repetition. Invariant: a query at position p sees exactly keys 0..p of its own
sequence (padding and later keys are masked), so neighbours never change its result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dorarl.engine.kv_cache import KVCache


@dataclass
class AttnGroup:
    start: int  # first token row of the group in the step
    batch: int
    q_len: int
    tiles: torch.Tensor  # [batch * kv_heads * blocks] tile ids, ordered (seq, head, block)
    mask: torch.Tensor | None  # [batch, 1, q_len * group_size or 1, keys], True = attend

    @property
    def rows(self) -> int:
        return self.batch * self.q_len


@dataclass
class GroupInput:
    """One group's sequences as plain data: their block tables, first positions, q length."""

    tables: list[list[int]]
    starts: list[int]  # position of each sequence's first new token (= tokens already cached)
    q_len: int


def build_group(
    start: int,
    item: GroupInput,
    kv_heads: int,
    q_per_kv: int,
    block_size: int,
    device: torch.device,
) -> AttnGroup:
    batch, q_len = len(item.tables), item.q_len
    ctx = [s + q_len for s in item.starts]
    num_blocks = -(-max(ctx) // block_size)
    padded = [t[:num_blocks] + [0] * (num_blocks - len(t[:num_blocks])) for t in item.tables]
    table = torch.tensor(padded, dtype=torch.long, device=device)
    heads = torch.arange(kv_heads, device=device)
    tiles = (table[:, None, :] * kv_heads + heads[None, :, None]).reshape(-1)
    return AttnGroup(
        start, batch, q_len, tiles, _mask(item, num_blocks * block_size, q_per_kv, device)
    )


def _mask(
    item: GroupInput, num_keys: int, q_per_kv: int, device: torch.device
) -> torch.Tensor | None:
    if item.q_len == 1 and all(s + 1 == num_keys for s in item.starts):
        return None  # every key is the row's own context: no padding, no future
    starts = torch.tensor(item.starts, dtype=torch.long, device=device)
    # Query row r of a sequence is token r // q_per_kv (query heads of one kv head are adjacent);
    # a decode row's heads share one mask row, which SDPA broadcasts.
    rows = q_per_kv if item.q_len > 1 else 1
    offsets = torch.arange(item.q_len, device=device).repeat_interleave(rows)
    last_key = starts[:, None] + offsets[None, :]
    keys = torch.arange(num_keys, device=device)
    return (keys[None, None, :] <= last_key[:, :, None]).unsqueeze(1)


def bucket_by_length(ctx_lens: list[int], min_fill: float = 0.6) -> list[tuple[int, int]]:
    """Cut lengths sorted descending into [lo, hi) buckets whose shortest member is at least
    min_fill of the longest: padding waste stays bounded with a handful of groups."""
    buckets, lo = [], 0
    for i in range(1, len(ctx_lens) + 1):
        if i == len(ctx_lens) or ctx_lens[i] < min_fill * ctx_lens[lo]:
            buckets.append((lo, i))
            lo = i
    return buckets


class PagedAttention:
    """Attention backend of the engine: writes new keys to the pool, attends over it."""

    def __init__(self, cache: KVCache, write_rows: torch.Tensor, groups: list[AttnGroup]) -> None:
        self.cache = cache
        self.write_rows = write_rows
        self.groups = groups

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q `[tokens, heads, dim]`, k and v `[tokens, kv_heads, dim]` -> `[tokens, heads * dim]`."""
        self.cache.write(layer, k, v, self.write_rows)
        outs = [self._attend(layer, q, g) for g in self.groups]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _attend(self, layer: int, q: torch.Tensor, g: AttnGroup) -> torch.Tensor:
        tokens, heads, dim = q.shape
        kv_heads = self.cache.shape.num_kv_heads
        per_kv = heads // kv_heads
        qg = q[g.start : g.start + g.rows].view(g.batch, g.q_len, kv_heads, per_kv, dim)
        qg = qg.transpose(1, 2).reshape(g.batch, kv_heads, g.q_len * per_kv, dim)
        keys, values = self.cache.gather(layer, g.tiles, g.batch)
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=g.mask)
        out = out.view(g.batch, kv_heads, g.q_len, per_kv, dim).transpose(1, 2)
        return out.reshape(g.rows, heads * dim)
