"""Continuous-batching scheduler: which sequences run this step, and which KV moves; torch-free.

Each step: (1) relieve KV pressure by offloading the youngest running sequences to host
blocks while device usage is above the threshold; (2) give every running sequence its
next tokens (one for decode, a chunk for prefill), evicting the youngest running
sequence when the device pool is short (offload to host if it has room, else drop the KV
and recompute later); (3) if nothing was evicted, admit waiting sequences (in-progress
ones first, then fresh ones, FCFS) under the slot, block and prefill-token budgets.
A multi-turn sequence whose turn ended is `parked`: it keeps its KV (device or host) but
no slot, and parked device KV is the first offloaded under pressure; when its next
observation arrives it queues as in progress and is readmitted on the blocks it holds.
With the prefix cache on (prefix_cache.py), a sequence is placed on the cached blocks its
prompt begins with and computes only the rest; one whose next block a running sequence is
computing waits for it, and the others behind it are admitted meanwhile. Unreferenced
cached blocks are taken (least recently released first) before any running sequence is
evicted, and the threshold counts only blocks in use.
Invariants: a running sequence's KV is on the device; the scheduler only does
bookkeeping, and the engine performs the returned copies (offloads, then restores, then
copies on write) before the forward pass, so a freed block is never read after it is
reused; a copy's source is held until the engine reports it done (`copied`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from dorarl.engine.block_manager import BlockManager, blocks_for
from dorarl.engine.prefix_cache import Hit, PrefixCache
from dorarl.engine.sequence import KVPlace, Sequence


@dataclass
class Offload:
    seq: Sequence
    device_blocks: list[int]
    host_blocks: list[int]


@dataclass
class Restore:
    seq: Sequence
    source: KVPlace  # HOST or DETACHED
    host_blocks: list[int]  # source blocks when HOST
    device_blocks: list[int]  # destination blocks, for the tokens after the first `skip` blocks
    skip: int = 0  # leading blocks the sequence reads from the prefix cache instead


@dataclass
class BlockCopy:
    """Copy on write: a block's rows into a sequence's own block, before the forward."""

    src: int
    dst: int


@dataclass
class Batch:
    """One step's work. Decode rows run one token each; prefill rows a chunk each."""

    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)
    offloads: list[Offload] = field(default_factory=list)
    restores: list[Restore] = field(default_factory=list)
    copies: list[BlockCopy] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    saved_tokens: int = 0  # prompt tokens whose KV came from the prefix cache at admission

    @property
    def items(self) -> list[tuple[Sequence, int]]:
        """(sequence, tokens this step) in row order: decodes first, then prefill chunks."""
        return [(seq, 1) for seq in self.decode] + self.prefill

    @property
    def empty(self) -> bool:
        return not (self.decode or self.prefill or self.offloads or self.restores)


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        max_num_seqs: int,
        prefill_chunk_size: int,
        offload_threshold: float,
        prefix_cache: bool = False,
        version: int = 0,
    ) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.prefill_chunk_size = prefill_chunk_size
        self.offload_threshold = offload_threshold
        self.cache = PrefixCache(blocks.device, blocks.block_size, prefix_cache, version)
        self.running: list[Sequence] = []
        self.resumed: deque[Sequence] = deque()  # in progress: offloaded, preempted, imported
        self.fresh: deque[Sequence] = deque()
        self.parked: list[Sequence] = []  # multi-turn, waiting for the environment

    # --- queue management -------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a sequence; one with progress (KV, output or earlier segments) goes before
        fresh prompts."""
        has_progress = (
            seq.num_output > 0 or seq.kv_place is not KVPlace.NONE or seq.earlier is not None
        )
        (self.resumed if has_progress else self.fresh).append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the engine and release every block it holds."""
        for queue in (self.running, self.resumed, self.fresh, self.parked):
            if seq in queue:
                queue.remove(seq)
        self.release(seq)

    def release(self, seq: Sequence) -> None:
        self.blocks.release_device(seq.block_table)
        self.blocks.release_host(seq.host_table)

    def new_version(self, version: int) -> int:
        """Weights of `version` replace the current ones: every cached block of the old
        weights leaves the cache (the idle ones are free again), and a sequence that holds
        KV from now on mixes versions, so it shares and keys nothing. Returns the blocks freed."""
        for seq in [*self.running, *self.resumed, *self.fresh, *self.parked]:
            if seq.num_computed or seq.kv_place is not KVPlace.NONE:
                seq.kv_version = None
        self.cache.version = version
        return self.blocks.device.drop_cache()

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.release(seq)
        seq.kv_place = KVPlace.NONE

    def park(self, seq: Sequence) -> None:
        """A turn ended: the sequence leaves its slot and keeps its KV."""
        if seq in self.running:
            self.running.remove(seq)
        seq.waits_env = True
        self.parked.append(seq)

    def unpark(self, seq: Sequence) -> None:
        """Its observation arrived: queue it as in progress (before fresh prompts)."""
        self.parked.remove(seq)
        self.resumed.append(seq)

    def waiting(self) -> list[Sequence]:
        return [*self.resumed, *self.fresh]

    @property
    def num_unfinished(self) -> int:
        return len(self.running) + len(self.resumed) + len(self.fresh)

    # --- one step ---------------------------------------------------------------------
    def schedule(self) -> Batch:
        batch = Batch()
        evicted = self._relieve_pressure(batch)
        evicted |= self._schedule_running(batch)
        if not evicted:
            self._admit(batch)
        return batch

    def offload(self, seq: Sequence, batch: Batch) -> bool:
        """Move a running sequence's KV to host blocks; False if the host pool is short."""
        need = blocks_for(seq.num_computed, self.blocks.block_size)
        on_device = seq in self.running or (seq in self.parked and seq.kv_place is KVPlace.DEVICE)
        if not on_device or not self.blocks.host.can_allocate(need):
            return False
        host = self.blocks.host.allocate(need)
        batch.offloads.append(Offload(seq, list(seq.block_table[:need]), host))
        self.blocks.release_device(seq.block_table)
        seq.num_cached = 0
        seq.host_table = host
        seq.kv_place = KVPlace.HOST
        seq.offloads += 1
        if seq in self.running:
            self._requeue(seq)
        return True

    def _over_threshold(self, extra: int = 0) -> bool:
        pool = self.blocks.device
        return pool.num_used + extra > self.offload_threshold * pool.num_total

    def _relieve_pressure(self, batch: Batch) -> bool:
        # Waiting episodes first: their KV is idle until the environment answers.
        for seq in [s for s in self.parked if s.kv_place is KVPlace.DEVICE]:
            if not self._over_threshold() or not self.offload(seq, batch):
                break
        evicted = False
        while self._over_threshold() and len(self.running) > 1:
            if not self.offload(self.running[-1], batch):
                break
            evicted = True
        return evicted

    def _schedule_running(self, batch: Batch) -> bool:
        budget, evicted, i = self.prefill_chunk_size, False, 0
        while i < len(self.running):
            seq = self.running[i]
            n = self._tokens_to_run(seq, budget)
            if n and not self._make_room(seq, n, batch):
                evicted = True  # seq itself was evicted (it was the youngest)
                break
            evicted |= bool(batch.offloads or batch.preempted)
            if n:
                budget -= self._add_to_batch(batch, seq, n)
            i += 1
        return evicted

    def _make_room(self, seq: Sequence, n: int, batch: Batch) -> bool:
        """Grow seq's table for n more tokens, evicting the youngest; False if seq was evicted."""
        while not self.blocks.grow(seq.block_table, seq.num_computed + n):
            victim = self.running[-1]
            if not self.offload(victim, batch):
                self._preempt(victim, batch)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, batch: Batch) -> None:
        """Drop a running sequence's KV; it re-prefills its tokens when readmitted."""
        self.blocks.release_device(seq.block_table)
        seq.reprefill_tokens += seq.num_computed
        seq.num_computed = seq.num_cached = 0
        seq.kv_place = KVPlace.NONE
        seq.kv_version = None
        batch.preempted.append(seq)
        self._requeue(seq)

    def _requeue(self, seq: Sequence) -> None:
        # The youngest is evicted first and pushed to the front, so the queue keeps age order.
        self.running.remove(seq)
        self.resumed.appendleft(seq)

    def _admit(self, batch: Batch) -> None:
        """In-progress sequences first, then fresh ones, each queue in order; the first that
        does not fit ends admission, one waiting for a block being computed is passed over."""
        budget = self.prefill_chunk_size - sum(n for _, n in batch.prefill)
        pending = self.cache.pending(self.running)
        for queue in (self.resumed, self.fresh):
            for seq in list(queue):
                if len(self.running) >= self.max_num_seqs:
                    return
                hit = self._hit(seq)
                if hit.missed is not None and hit.missed in pending:
                    continue
                n = self._admit_one(seq, hit, budget, batch)
                if n is None:
                    return
                queue.remove(seq)
                self.cache.add_pending(seq, pending)
                budget -= n

    def _hit(self, seq: Sequence) -> Hit:
        if seq.kv_place is KVPlace.NONE:
            return self.cache.lookup(seq)
        if seq.kv_place is KVPlace.DEVICE:  # parked on its own blocks
            return Hit(computed=seq.num_computed)
        return self.cache.resident(seq)

    def _admit_one(self, seq: Sequence, hit: Hit, budget: int, batch: Batch) -> int | None:
        """Place `seq` and add its row; the prefill budget it used, or None if it does not fit."""
        n = self._tokens_to_run(seq, budget, hit.computed)
        held = len(seq.block_table) if seq.kv_place is KVPlace.DEVICE else len(hit.shared)
        need = max(0, blocks_for(hit.computed + n, self.blocks.block_size) - held)
        pool = self.blocks.device
        revived = sum(pool.refs(b) == 0 for b in hit.blocks())  # idle cached blocks it holds
        # Keep one block of growth per running sequence, so admission does not thrash.
        taken = need + revived + len(self.running)
        if n == 0 or (self.running and self._over_threshold(taken)):
            return None
        if not pool.can_allocate(need + revived):
            return None
        self._place_on_device(seq, hit, need, batch)
        self.running.append(seq)
        return self._add_to_batch(batch, seq, n)

    def _place_on_device(self, seq: Sequence, hit: Hit, need: int, batch: Batch) -> None:
        pool = self.blocks.device
        if seq.kv_place is KVPlace.DEVICE:  # parked on its own blocks
            seq.block_table.extend(pool.allocate(need))
            return
        for block in hit.blocks():  # held before allocating, so none of them is taken
            pool.share(block)
        table = hit.shared + pool.allocate(need)
        skip = len(hit.shared)
        if seq.kv_place in (KVPlace.HOST, KVPlace.DETACHED):
            held = blocks_for(seq.num_computed, self.blocks.block_size)
            restore = Restore(seq, seq.kv_place, list(seq.host_table), table[skip:held], skip)
            batch.restores.append(restore)
            self.blocks.release_host(seq.host_table)
        else:
            self._start(seq, hit, table, batch)
        seq.block_table = table
        seq.num_cached = skip
        seq.kv_place = KVPlace.DEVICE

    def _start(self, seq: Sequence, hit: Hit, table: list[int], batch: Batch) -> None:
        """A sequence with no KV starts under this version on what the cache gave it."""
        seq.kv_version = self.cache.version
        seq.num_computed = hit.computed
        batch.saved_tokens += hit.computed
        if hit.copy_from is not None:
            batch.copies.append(BlockCopy(hit.copy_from, table[len(hit.shared)]))

    def copied(self, batch: Batch) -> None:
        """The engine ran the batch's copies: their sources are no longer held for them."""
        self.blocks.device.free([c.src for c in batch.copies])

    def computed(self, batch: Batch) -> None:
        """The batch's rows ran: their tokens have KV now, and finished prompt blocks are
        keyed in the prefix cache."""
        for seq, n in batch.items:
            seq.num_computed += n
            self.cache.register(seq)

    def _tokens_to_run(self, seq: Sequence, budget: int, computed: int | None = None) -> int:
        """1 for a decode; a prefill chunk within the step's token budget otherwise (from
        `computed` tokens, what it will hold once placed)."""
        computed = seq.num_computed if computed is None else computed
        return 1 if seq.samples_next(computed) else min(seq.num_tokens - computed, budget)

    @staticmethod
    def _add_to_batch(batch: Batch, seq: Sequence, n: int) -> int:
        """Add a row; returns the prefill budget it used."""
        if seq.decodes:
            batch.decode.append(seq)
            return 0
        batch.prefill.append((seq, n))
        return n
