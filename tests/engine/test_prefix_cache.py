"""The block manager's sharing under random interleavings (torch-free, no model).

Two schedulers are driven as `Engine` drives them (the copies it performs, the rows each
step writes), with a shadow of what every block row holds: the version that computed it
and the tokens up to it. Whatever the order of adds (groups of one prompt, prompts sharing
a system prefix), steps, finishes, offloads, migrations, aborts, version changes and the
evictions a small pool forces, no block a table reads is free, none leaks, no step writes a
block another table reads, and every row a sequence of version v reads is its own prefix's,
computed under v.
"""

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from dorarl.engine.block_manager import BlockManager, blocks_for, prompt_keys
from dorarl.engine.config import SamplingParams
from dorarl.engine.prefix_cache import PrefixCache
from dorarl.engine.scheduler import Batch, Scheduler
from dorarl.engine.sequence import KVPlace, Sequence

BS = 4
SYSTEM = list(range(10, 22))  # three blocks every prompt may start with


class Machine:
    """One engine's scheduler, and what each block row holds: (version, tokens up to it)."""

    def __init__(self, blocks: BlockManager, chunk: int, max_seqs: int, threshold: float) -> None:
        self.sched = Scheduler(blocks, max_seqs, chunk, threshold, prefix_cache=True, version=0)
        self.rows: dict[int, list] = {}
        self.host_rows: dict[int, list] = {}
        self.detached: dict[str, list] = {}
        self.seqs: dict[str, Sequence] = {}
        self.done: list[Sequence] = []

    @property
    def version(self) -> int:
        return self.sched.cache.version

    def add(self, seq: Sequence) -> None:
        self.seqs[seq.request_id] = seq
        self.sched.add(seq)

    def step(self) -> None:
        batch = self.sched.schedule()
        assert not (batch.empty and self.sched.num_unfinished), "scheduler stalled"
        self._move(batch)
        for seq, n in batch.items:
            for pos in range(seq.num_computed, seq.num_computed + n):
                block = seq.block_table[pos // BS]
                pool = self.sched.blocks.device
                assert pool.refs(block) == 1, f"a step writes block {block}, which others read"
                key = pool.key_of(block)
                assert key is None or key.tokens < BS, "a step writes a cached full block"
                self._write(block, pos, (self.version, tuple(seq.token_ids[: pos + 1])))
        self.sched.computed(batch)
        for seq, _ in batch.items:
            if seq.num_computed == seq.num_tokens:
                seq.append(_token(seq), 0.0, self.version, max_model_len=10_000)
                if seq.finished:
                    self.sched.finish(seq)
                    self.done.append(self.seqs.pop(seq.request_id))

    def _move(self, batch: Batch) -> None:
        for off in batch.offloads:
            for d, h in zip(off.device_blocks, off.host_blocks, strict=True):
                self.host_rows[h] = list(self.rows[d])
        for res in batch.restores:
            if res.source is KVPlace.HOST:
                for h, d in zip(res.host_blocks[res.skip :], res.device_blocks, strict=False):
                    self.rows[d] = list(self.host_rows[h])
            else:
                kv = self.detached.pop(res.seq.request_id)
                for pos in range(res.skip * BS, res.seq.num_computed):
                    self._write(res.device_blocks[pos // BS - res.skip], pos, kv[pos])
        for c in batch.copies:
            self.rows[c.dst] = list(self.rows[c.src])
        self.sched.copied(batch)

    def _write(self, block: int, pos: int, row: tuple) -> None:
        self.rows.setdefault(block, [None] * BS)[pos % BS] = row

    def offload(self, seq: Sequence) -> None:
        batch = Batch()
        if self.sched.offload(seq, batch):
            self._move(batch)

    def export(self, seq: Sequence) -> list:
        """The rows of its KV (what `Engine.export_request` carries); it leaves."""
        if seq.kv_place is KVPlace.DEVICE:
            table, rows = seq.block_table, self.rows
        elif seq.kv_place is KVPlace.HOST:
            table, rows = seq.host_table, self.host_rows
        else:
            table, rows = [], {}
        kv = self.detached.pop(seq.request_id, None) or [
            rows[table[p // BS]][p % BS] for p in range(seq.num_computed)
        ]
        self.sched.remove(seq)
        del self.seqs[seq.request_id]
        return kv

    def import_(self, seq: Sequence, kv: list, version: int) -> None:
        """Its KV comes along when the versions agree (`import_request`), else it starts
        again from its tokens (`resume_request`)."""
        moved = copy.copy(seq)
        moved.block_table, moved.host_table, moved.num_cached, moved.keys = [], [], 0, None
        if version == self.version and seq.num_computed:
            moved.kv_place = KVPlace.DETACHED  # mixed KV stays mixed (`kv_mixed`)
            moved.kv_version = version if seq.kv_version == version else None
            self.detached[seq.request_id] = kv
        else:
            moved.kv_place, moved.kv_version, moved.num_computed = KVPlace.NONE, None, 0
        self.add(moved)

    def check(self) -> None:
        pool, host = self.sched.blocks.device, self.sched.blocks.host
        holders: dict[int, list[Sequence]] = {}
        host_owner: set[int] = set()
        for seq in self.seqs.values():
            for block in seq.block_table:
                holders.setdefault(block, []).append(seq)
            assert not host_owner & set(seq.host_table), "a host block in two tables"
            host_owner |= set(seq.host_table)
            self._check_rows(seq)
        for block in range(pool.num_total):
            assert pool.refs(block) == len(holders.get(block, [])), f"block {block} miscounted"
            key = pool.key_of(block)
            assert key is None or key.version == self.version, "a block of an old version"
            versions = {s.kv_version for s in holders.get(block, [])}
            assert len(versions) <= 1, f"block {block} read under versions {versions}"
        assert pool.num_used == len(holders) and host.num_used == len(host_owner)
        assert pool.num_free + pool.num_used == pool.num_total

    def _check_rows(self, seq: Sequence) -> None:
        if seq.kv_place is KVPlace.DEVICE:
            table, rows = seq.block_table, self.rows
        elif seq.kv_place is KVPlace.HOST:
            table, rows = seq.host_table, self.host_rows
        else:
            return
        assert len(table) >= blocks_for(seq.num_computed, BS)
        for pos in range(seq.num_computed):
            version, tokens = rows[table[pos // BS]][pos % BS]
            assert tokens == tuple(seq.token_ids[: pos + 1]), f"{seq.request_id} reads others' KV"
            if seq.kv_version is not None:
                assert version == seq.kv_version, f"{seq.request_id} reads KV of v{version}"


def _token(seq: Sequence) -> int:
    return (seq.seed * 7 + seq.num_output) % 3


prompt_st = st.builds(
    lambda head, tail: SYSTEM[:head] + tail,
    st.sampled_from([0, 6, 8, 12]),
    st.lists(st.integers(0, 3), min_size=1, max_size=9),
)
add_st = st.tuples(
    st.just("add"), st.integers(0, 1), prompt_st, st.integers(1, 4), st.integers(1, 16)
)
step_st = st.tuples(st.just("step"), st.integers(0, 1), st.integers(1, 12))
op_st = st.one_of(
    add_st,
    step_st,
    add_st,
    step_st,
    st.tuples(
        st.sampled_from(["offload", "migrate", "abort"]), st.integers(0, 1), st.integers(0, 20)
    ),
    st.tuples(st.just("version"), st.integers(0, 1)),
)


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(op_st, min_size=4, max_size=40),
    num_blocks=st.integers(10, 20),
    host_blocks=st.integers(0, 16),
    chunk=st.integers(1, 16),
    max_seqs=st.integers(1, 6),
    threshold=st.sampled_from([0.5, 0.9, 1.0]),
)
def test_random_interleavings_keep_every_block_counted_and_version_exact(
    ops, num_blocks, host_blocks, chunk, max_seqs, threshold
):
    machines = [
        Machine(BlockManager(num_blocks, host_blocks, BS), chunk, max_seqs, threshold)
        for _ in range(2)
    ]
    added = 0
    for op in ops:
        m, other = machines[op[1]], machines[1 - op[1]]
        if op[0] == "add":
            _, _, prompt, size, out = op
            for _ in range(size):  # at most 21 + 16 tokens: 10 blocks hold any request alone
                seed, added = added, added + 1
                m.add(
                    Sequence(f"r{seed}", prompt, SamplingParams(target_len=out), seed, frozenset())
                )
        elif op[0] == "step":
            for _ in range(op[2]):
                if m.sched.num_unfinished:
                    m.step()
                    m.check()
        elif op[0] == "version":
            m.sched.new_version(m.version + 1)
        elif m.seqs:
            seq = list(m.seqs.values())[op[2] % len(m.seqs)]
            if op[0] == "offload":
                m.offload(seq)
            elif op[0] == "migrate":
                other.import_(seq, m.export(seq), m.version)
            else:
                m.export(seq)
        m.check()
    for m in machines:
        for _ in range(5_000):
            if not m.sched.num_unfinished:
                break
            m.step()
            m.check()
        assert not m.seqs, "requests left unfinished"
        pool = m.sched.blocks.device
        assert pool.num_used == 0 and m.sched.blocks.host.num_used == 0
        pool.drop_cache()
        assert pool.num_free == pool.num_total and not pool.num_cached


def test_a_key_chains_the_version_and_every_token_before_it():
    a = prompt_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], BS, version=0)
    assert len(a.full) == 2 and a.tail is not None and a.tail.tokens == 1
    b = prompt_keys([1, 2, 3, 4, 5, 6, 7, 8], BS, version=0)
    assert b.full == a.full and b.tail is None
    assert prompt_keys([0, 2, 3, 4, 5, 6, 7, 8], BS, 0).full[1] != a.full[1]  # chained
    ones = [1] * 8
    other = prompt_keys(ones, BS, version=1).full
    assert all(x != y for x, y in zip(other, prompt_keys(ones, BS, 0).full, strict=True))


def test_a_follower_waits_for_the_block_its_leader_computes():
    """G samples added at once: one prefills, the others wait, then copy its last block."""
    sched = Scheduler(BlockManager(40, 0, BS), 8, 16, 1.0, prefix_cache=True)
    prompt = list(range(30))  # 7 full blocks and 2 tokens
    seqs = [
        Sequence(f"s{i}", prompt, SamplingParams(target_len=2), i, frozenset()) for i in range(4)
    ]
    for seq in seqs:
        sched.add(seq)
    first = sched.schedule()
    assert [s.request_id for s, _ in first.prefill] == ["s0"]  # chunk 16 of 30
    sched.computed(first)
    second = sched.schedule()
    assert [s.request_id for s, _ in second.prefill] == ["s0"]  # still its blocks to come
    sched.computed(second)
    third = sched.schedule()
    rows = [(s.request_id, n) for s, n in third.prefill]
    assert rows == [("s1", 1), ("s2", 1), ("s3", 1)] and third.saved_tokens == 3 * 29
    assert [c.src for c in third.copies] == [seqs[0].block_table[7]] * 3
    assert all(s.block_table[:7] == seqs[0].block_table[:7] for s in seqs[1:])
    assert isinstance(sched.cache, PrefixCache) and sched.blocks.device.refs(0) == 4
