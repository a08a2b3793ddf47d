"""The paged KV pools (device and host) and the copies between them and snapshots.

Pool layout: `[2 (k, v), num_layers, num_blocks, num_kv_heads, block_size, head_dim]`, so one
block of one kv head is a contiguous `[block_size, head_dim]` tile and a range of blocks is
a plain view `[blocks, kv_heads, block_size, head_dim]` (decode attention reads it in place);
gathering one sequence's tiles with `index_select` yields `[1, kv_heads, ctx, dim]` keys. Snapshot layout (engine-independent): `[2, num_layers, num_kv_heads, num_tokens,
head_dim]` on the CPU, so a request can move between engines of different block sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int


class KVCache:
    def __init__(
        self,
        shape: KVShape,
        num_blocks: int,
        host_blocks: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.shape = shape
        s = shape
        dims = (2, s.num_layers, num_blocks, s.num_kv_heads, s.block_size, s.head_dim)
        self.pool = torch.zeros(dims, device=device, dtype=dtype)
        pin = device.type == "cuda"
        host_dims = (2, s.num_layers, host_blocks, s.num_kv_heads, s.block_size, s.head_dim)
        self.host = torch.zeros(host_dims, dtype=dtype, pin_memory=pin)
        # Flat per-layer views: rows of head_dim for writes, tiles of a block for gathers.
        self.rows = self.pool.view(2, s.num_layers, -1, s.head_dim)
        self.tiles = self.pool.view(2, s.num_layers, -1, s.block_size, s.head_dim)
        # Each layer's views made once, not on every step of every layer.
        self._layer_rows = [self.rows[:, i] for i in range(s.num_layers)]
        self._layer_kv = [(self.pool[0, i], self.pool[1, i]) for i in range(s.num_layers)]

    @property
    def device(self) -> torch.device:
        return self.pool.device

    @property
    def dtype(self) -> torch.dtype:
        return self.pool.dtype

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> None:
        """Store new tokens' k, v ([tokens, kv_heads, dim]) at flat row ids ([tokens * kv_heads])."""
        kv = torch.stack((k, v)).view(2, -1, self.shape.head_dim)
        self._layer_rows[layer].index_copy_(1, rows, kv)  # k and v in one copy

    def block_range(self, layer: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of pool blocks [lo, hi) as views `[blocks, kv_heads, block_size, dim]`."""
        keys, values = self._layer_kv[layer]
        return keys[lo:hi], values[lo:hi]

    def gather(
        self, layer: int, tiles: torch.Tensor, batch: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[batch, kv_heads, ctx, dim]` for tile ids ordered (seq, head, block)."""
        s = self.shape
        k = self.tiles[0, layer].index_select(0, tiles)
        v = self.tiles[1, layer].index_select(0, tiles)
        return (
            k.view(batch, s.num_kv_heads, -1, s.head_dim),
            v.view(batch, s.num_kv_heads, -1, s.head_dim),
        )

    # --- whole-request copies ------------------------------------------------------
    def offload(self, device_blocks: list[int], host_blocks: list[int]) -> None:
        src = torch.tensor(device_blocks, device=self.device)
        dst = torch.tensor(host_blocks)
        self.host.index_copy_(2, dst, self.pool.index_select(2, src).to("cpu"))

    def restore(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        src = torch.tensor(host_blocks)
        dst = torch.tensor(device_blocks, device=self.device)
        blocks = self.host.index_select(2, src).to(self.device)
        self.pool.index_copy_(2, dst, blocks)

    def export(self, device_blocks: list[int], num_tokens: int) -> torch.Tensor:
        """A request's KV as a CPU snapshot tensor `[2, layers, kv_heads, num_tokens, dim]`."""
        return self._to_tokens(self.pool.index_select(2, self._index(device_blocks)), num_tokens)

    def export_host(self, host_blocks: list[int], num_tokens: int) -> torch.Tensor:
        return self._to_tokens(self.host.index_select(2, torch.tensor(host_blocks)), num_tokens)

    def load(self, kv: torch.Tensor, device_blocks: list[int]) -> None:
        """Copy a snapshot tensor into device blocks (the inverse of `export`)."""
        s = self.shape
        num_tokens = kv.shape[3]
        pad = len(device_blocks) * s.block_size - num_tokens
        kv = kv.to(self.device, self.dtype)
        if pad:
            kv = torch.nn.functional.pad(kv, (0, 0, 0, pad))
        tiles = kv.view(
            2, s.num_layers, s.num_kv_heads, len(device_blocks), s.block_size, s.head_dim
        )
        self.pool.index_copy_(2, self._index(device_blocks), tiles.transpose(2, 3))

    def _index(self, blocks: list[int]) -> torch.Tensor:
        return torch.tensor(blocks, dtype=torch.long, device=self.device)

    def _to_tokens(self, blocks: torch.Tensor, num_tokens: int) -> torch.Tensor:
        s = self.shape
        n = blocks.shape[2]
        tokens = blocks.transpose(2, 3).reshape(
            2, s.num_layers, s.num_kv_heads, n * s.block_size, -1
        )
        return tokens[:, :, :, :num_tokens].to("cpu").contiguous()
