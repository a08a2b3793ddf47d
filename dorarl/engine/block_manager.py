"""Block bookkeeping for the paged KV pools (device and host); torch-free.

A `BlockPool` hands out block ids of a fixed-size pool. Invariant: every id is either
free or owned by exactly one sequence table; a double free or a foreign id is a bug and
trips an assertion. The lowest free ids go out first, so the blocks in use stay packed at the
low end of the pool (decode attention reads the range that holds them in place). The
tensors behind the ids live in `kv_cache.py`.
"""

from __future__ import annotations

import heapq


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_total = num_blocks
        self._free: list[int] = list(range(num_blocks))  # a min-heap
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self._free), f"allocate {n} blocks with {len(self._free)} free"
        blocks = [heapq.heappop(self._free) for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            assert block in self._used, f"free of block {block} that is not in use"
            self._used.remove(block)
            heapq.heappush(self._free, block)


class BlockManager:
    """Grows and releases the device and host block tables of sequences."""

    def __init__(self, num_blocks: int, host_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.device = BlockPool(num_blocks)
        self.host = BlockPool(host_blocks)

    def extra_blocks(self, table: list[int], num_tokens: int) -> int:
        """Blocks to add to `table` so that it holds `num_tokens` tokens."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(table))

    def grow(self, table: list[int], num_tokens: int) -> bool:
        """Extend a device table in place to hold num_tokens; False if the pool is short."""
        need = self.extra_blocks(table, num_tokens)
        if not self.device.can_allocate(need):
            return False
        table.extend(self.device.allocate(need))
        return True

    def release_device(self, table: list[int]) -> None:
        self.device.free(table)
        table.clear()

    def release_host(self, table: list[int]) -> None:
        self.host.free(table)
        table.clear()
