"""The prefix cache's policy: which cached blocks a sequence reads or copies, which of its
own it keys, and who waits for whom; torch-free. Blocks and keys live in block_manager.py.

A sequence whose KV starts empty reads every cached full block of the engine's version that
its prompt begins with, up to its last token (it computes at least that one, for its
logits). The block after them, when the cache holds it (a full block holding that last
token, or the prompt's partial last block another sequence of the same prompt computed),
is copied into a block of its own (copy on write) and only the rows past it are computed.
A sequence that comes back with its own KV (from the host pool or another engine) reads
the cached blocks its prompt begins with and restores only the rest. After each step a
sequence keys its newly computed full prompt blocks and, once its prompt is done, its
partial last one. A sequence whose first missing block a running sequence is computing
waits for it (`pending`): a group's G samples, added at once, prefill their prompt once.
Only a sequence whose `kv_version` is the engine's version shares or keys blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dorarl.engine.block_manager import BlockKey, BlockPool, PromptKeys, prompt_keys
from dorarl.engine.sequence import Sequence


@dataclass
class Hit:
    """What the cache holds of a sequence's tokens when it is placed on the device."""

    shared: list[int] = field(default_factory=list)  # cached full blocks its table reads
    copy_from: int | None = None  # a cached block whose rows it copies into its next block
    computed: int = 0  # tokens whose KV it holds once placed (no KV: what the cache gave)
    missed: BlockKey | None = None  # the first block it looked for and did not find

    def blocks(self) -> list[int]:
        """The cached blocks it takes hold of (the copy source only until the copy ran)."""
        return self.shared if self.copy_from is None else [*self.shared, self.copy_from]


class PrefixCache:
    def __init__(self, pool: BlockPool, block_size: int, enabled: bool, version: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enabled = enabled
        self.version = version

    def usable(self, seq: Sequence) -> bool:
        return self.enabled and seq.kv_version == self.version

    def keys(self, seq: Sequence) -> PromptKeys:
        if seq.keys is None or seq.keys.version != self.version:
            seq.keys = prompt_keys(seq.prompt_ids, self.block_size, self.version)
        return seq.keys

    # --- placing a sequence -----------------------------------------------------------------
    def lookup(self, seq: Sequence) -> Hit:
        """For a sequence with no KV, about to start under this engine's version."""
        if not self.enabled:
            return Hit()
        keys, bs = self.keys(seq), self.block_size
        limit = seq.num_tokens - 1  # it computes its last token itself
        shared = self._leading(keys.full[: limit // bs])
        done = len(shared) * bs
        nxt = keys.full[len(shared)] if len(shared) < len(keys.full) else keys.tail
        if nxt is None:
            return Hit(shared, computed=done)
        block = self.pool.lookup(nxt)  # None when the run above stopped at a miss
        if block is None:
            return Hit(shared, computed=done, missed=nxt)
        rows = min(nxt.tokens, limit - done)
        return Hit(shared, block, done + rows) if rows > 0 else Hit(shared, computed=done)

    def resident(self, seq: Sequence) -> Hit:
        """For a sequence that brings its own KV: the cached blocks it can read instead."""
        if not self.usable(seq):
            return Hit(computed=seq.num_computed)
        full = self.keys(seq).full[: seq.num_computed // self.block_size]
        return Hit(self._leading(full), computed=seq.num_computed)

    def _leading(self, keys: list[BlockKey]) -> list[int]:
        blocks = []
        for key in keys:
            block = self.pool.lookup(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def pending(self, seqs: list[Sequence]) -> set[BlockKey]:
        """The prompt blocks `seqs` (running) are yet to compute under this version."""
        keys: set[BlockKey] = set()
        for seq in seqs:
            self.add_pending(seq, keys)
        return keys

    def add_pending(self, seq: Sequence, keys: set[BlockKey]) -> None:
        if self.usable(seq) and seq.num_computed < seq.num_prompt:
            prompt = self.keys(seq)
            keys.update(prompt.full[seq.num_computed // self.block_size :])
            if prompt.tail is not None:
                keys.add(prompt.tail)

    # --- after a step --------------------------------------------------------------------------
    def register(self, seq: Sequence) -> None:
        """Key the prompt blocks `seq` has finished computing (another block may hold the
        same key already: this one then stays private)."""
        if not self.usable(seq):
            return
        keys = self.keys(seq)
        full = min(seq.num_computed, seq.num_prompt) // self.block_size
        for i in range(seq.num_cached, full):
            self.pool.cache(seq.block_table[i], keys.full[i])
        seq.num_cached = max(seq.num_cached, full)
        done = seq.num_computed >= seq.num_prompt
        if keys.tail is not None and done and seq.num_cached == len(keys.full):
            self.pool.cache(seq.block_table[seq.num_cached], keys.tail)
            seq.num_cached += 1
