"""Block bookkeeping for the paged KV pools (device and host) and the prefix cache; torch-free.

A `BlockPool` hands out block ids of a fixed-size pool and counts the tables that hold each
one. The device pool is also the prefix cache: a block whose KV is a run of prompt tokens
computed under one policy version is keyed by `BlockKey` (the version and a digest of its
tokens chained with its predecessor's), so any sequence of that version whose tokens start
the same way reads the block instead of computing it again. A cached block nobody holds
stays where it is, idle, until an allocation finds no free block (the least recently
released goes first) or its version leaves the engine (`drop_cache`).
Invariants: every id is free, idle (cached, held by none) or held by `refs` >= 1 tables;
only a full prompt block is held by more than one table (a prompt's last, partial block is
copied, never shared), and no table writes a block another table holds; a block keyed
under version v is only ever handed to a sequence whose KV is of v. A double free or a
foreign id is a bug and trips an assertion. The lowest free ids go out first, so the blocks
in use stay packed at the low end of the pool (decode attention reads the range that holds
them in place). The tensors behind the ids live in `kv_cache.py`.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict
from dataclasses import dataclass


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class BlockKey:
    """What a cached block holds: `tokens` prompt tokens' KV under `version`, after the
    prefix its digest chains in."""

    version: int
    tokens: int  # block_size for a full block, fewer for a prompt's last, partial block
    digest: bytes


def chain_key(parent: BlockKey | None, tokens: list[int], version: int) -> BlockKey:
    """The key of a block holding `tokens` after the prefix `parent` ends (None: the first)."""
    h = hashlib.sha256(parent.digest if parent is not None else b"dorarl-kv")
    h.update(version.to_bytes(8, "little", signed=True))
    h.update(array("q", tokens).tobytes())
    return BlockKey(version, len(tokens), h.digest())


@dataclass(frozen=True)
class PromptKeys:
    """A prompt's block keys under one version: its full blocks, and its partial last one."""

    version: int
    full: list[BlockKey]
    tail: BlockKey | None  # None when the prompt fills its last block


def prompt_keys(prompt: list[int], block_size: int, version: int) -> PromptKeys:
    full: list[BlockKey] = []
    parent = None
    for start in range(0, len(prompt) - block_size + 1, block_size):
        parent = chain_key(parent, prompt[start : start + block_size], version)
        full.append(parent)
    rest = prompt[len(full) * block_size :]
    tail = chain_key(parent, rest, version) if rest else None
    return PromptKeys(version, full, tail)


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_total = num_blocks
        self._free: list[int] = list(range(num_blocks))  # a min-heap
        self._refs: dict[int, int] = {}  # held blocks: how many tables hold each
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached, held by none: LRU first
        self._cached: dict[BlockKey, int] = {}
        self._key: dict[int, BlockKey] = {}

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free ones and idle cached ones."""
        return len(self._free) + len(self._idle)

    @property
    def num_used(self) -> int:
        """Blocks some table holds (idle cached blocks are not in use)."""
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        """Blocks the prefix cache keys, held or idle."""
        return len(self._key)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def refs(self, block: int) -> int:
        return self._refs.get(block, 0)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """n blocks for one table: free ones first, then idle cached ones, oldest first."""
        assert n <= self.num_free, f"allocate {n} blocks with {self.num_free} free"
        blocks = [self._take() for _ in range(n)]
        for block in blocks:
            self._refs[block] = 1
        return blocks

    def _take(self) -> int:
        if self._free:
            return heapq.heappop(self._free)
        block, _ = self._idle.popitem(last=False)
        del self._cached[self._key.pop(block)]
        return block

    def share(self, block: int) -> None:
        """One more table holds a cached block (an idle one is in use again)."""
        assert block in self._key, f"share of block {block}, which the cache does not hold"
        self._idle.pop(block, None)
        self._refs[block] = self._refs.get(block, 0) + 1

    def free(self, blocks: list[int]) -> None:
        """Each of `blocks` loses one holder; a cached one nobody holds then waits, idle."""
        for block in blocks:
            assert block in self._refs, f"free of block {block} that is not in use"
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            del self._refs[block]
            if block in self._key:
                self._idle[block] = None
            else:
                heapq.heappush(self._free, block)

    # --- the prefix cache ----------------------------------------------------------------
    def lookup(self, key: BlockKey) -> int | None:
        return self._cached.get(key)

    def key_of(self, block: int) -> BlockKey | None:
        return self._key.get(block)

    def cache(self, block: int, key: BlockKey) -> bool:
        """Key a held block whose KV is `key`'s; False when another block has it already
        (two sequences computed the same prefix: this one stays its table's alone)."""
        assert block in self._refs, f"cache of block {block} that is not in use"
        if key in self._cached or block in self._key:
            return False
        self._cached[key] = block
        self._key[block] = key
        return True

    def drop_cache(self) -> int:
        """Forget every cached block (the weights they were computed under leave): idle ones
        are free again, held ones stay their tables' until released. Returns the idle blocks
        freed."""
        freed = len(self._idle)
        for block in self._idle:
            heapq.heappush(self._free, block)
        self._idle.clear()
        self._cached.clear()
        self._key.clear()
        return freed


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
