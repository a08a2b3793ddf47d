"""The paged KV pools (device and host) and the copies between them and snapshots.

Pool layout: `[2 (k, v), num_layers, num_blocks, num_kv_heads, block_size, head_dim]`, so one
block of one kv head is a contiguous `[block_size, head_dim]` tile and a range of blocks is
a plain view `[blocks, kv_heads, block_size, head_dim]` (decode attention reads it in place);
gathering one sequence's tiles with `index_select` yields `[1, kv_heads, ctx, dim]` keys. Snapshot layout (engine-independent): `[2, num_layers, num_kv_heads, num_tokens,
head_dim]` on the CPU, so a request can move between engines of different block sizes.
On cuda, copies to and from host memory use pinned buffers and non-blocking copies.
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

    def blocks(self, layer: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of pool blocks `ids`, gathered: `[len(ids), kv_heads, block_size, dim]`."""
        keys, values = self._layer_kv[layer]
        return keys.index_select(0, ids), values.index_select(0, ids)

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
    # On cuda every copy between the pool and host memory goes through pinned memory and
    # is queued non-blocking (torch's caching host allocator keeps a pinned buffer alive
    # until the copies queued on it are done); a copy the host reads next waits once.
    @property
    def _on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def offload(self, device_blocks: list[int], host_blocks: list[int]) -> None:
        src = torch.tensor(device_blocks, device=self.device)
        dst = torch.tensor(host_blocks)
        self.host.index_copy_(2, dst, self.host_copy(self.pool.index_select(2, src)))

    def restore(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        src = torch.tensor(host_blocks)
        dst = torch.tensor(device_blocks, device=self.device)
        self.pool.index_copy_(2, dst, self._to_device(self._host_select(src)))

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Pool blocks `src` into blocks `dst`, every layer (copy on write of a shared prefix)."""
        self.pool.index_copy_(2, self._index(dst), self.pool.index_select(2, self._index(src)))

    def export(
        self, device_blocks: list[int], num_tokens: int, to_host: bool = True
    ) -> torch.Tensor:
        """A request's KV as a snapshot tensor `[2, layers, kv_heads, num_tokens, dim]`: on
        the CPU (pinned on cuda), or with `to_host=False` on this device (a transfer device to
        device: dorarl.runtime.transfer.kv_transfer)."""
        blocks = self.pool.index_select(2, self._index(device_blocks))
        tokens = self._to_tokens(blocks, num_tokens)
        return self.host_copy(tokens) if to_host else tokens

    def export_host(self, host_blocks: list[int], num_tokens: int) -> torch.Tensor:
        return self._to_tokens(self.host.index_select(2, torch.tensor(host_blocks)), num_tokens)

    def load(self, kv: torch.Tensor, device_blocks: list[int]) -> None:
        """Copy a snapshot tensor into device blocks (the inverse of `export`)."""
        s = self.shape
        num_tokens = kv.shape[3]
        pad = len(device_blocks) * s.block_size - num_tokens
        kv = self._to_device(kv).to(self.dtype)
        if pad:
            kv = torch.nn.functional.pad(kv, (0, 0, 0, pad))
        tiles = kv.view(
            2, s.num_layers, s.num_kv_heads, len(device_blocks), s.block_size, s.head_dim
        )
        self.pool.index_copy_(2, self._index(device_blocks), tiles.transpose(2, 3))

    def _index(self, blocks: list[int]) -> torch.Tensor:
        return torch.tensor(blocks, dtype=torch.long, device=self.device)

    def _to_tokens(self, blocks: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Blocks `[2, layers, n, kv_heads, block, dim]` as tokens, contiguous, where they are."""
        s = self.shape
        n = blocks.shape[2]
        tokens = blocks.transpose(2, 3).reshape(
            2, s.num_layers, s.num_kv_heads, n * s.block_size, -1
        )
        return tokens[:, :, :, :num_tokens].contiguous()

    def _host_select(self, host_index: torch.Tensor) -> torch.Tensor:
        """Host pool blocks gathered into a new tensor (pinned on cuda)."""
        if not self._on_cuda:
            return self.host.index_select(2, host_index)
        s = self.host.shape
        out = torch.empty((*s[:2], len(host_index), *s[3:]), dtype=self.dtype, pin_memory=True)
        return torch.index_select(self.host, 2, host_index, out=out)

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor in host memory (from the device: pinned, the copy queued, then one wait)."""
        if tensor.device.type == "cpu" or not self._on_cuda:
            return tensor.to("cpu")
        pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        pinned.copy_(tensor, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return pinned

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor on this device; from pinned memory the copy is queued, not waited for."""
        if tensor.device.type == self.device.type or not self._on_cuda:
            return tensor.to(self.device)
        return tensor.to(self.device, non_blocking=tensor.is_pinned())
