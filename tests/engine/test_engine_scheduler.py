"""The torch-free scheduler and block manager under random workloads (no model involved)."""

import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from dorarl.engine.block_manager import BlockManager, BlockPool, blocks_for
from dorarl.engine.config import SamplingParams
from dorarl.engine.scheduler import Batch, Scheduler
from dorarl.engine.sequence import KVPlace, Sequence


def test_block_pool_hands_out_each_block_once():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free == 1 and not pool.can_allocate(2)
    pool.free(a[:2])
    b = pool.allocate(3)
    assert not set(b) & set(a[2:]) and pool.num_used == 4


def test_torch_free_modules_do_not_import_torch():
    code = (
        "import sys; import dorarl.engine.scheduler, dorarl.engine.block_manager, dorarl.engine.outputs; "
        "from dorarl.engine import SamplingParams, EngineStats; assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _check_invariants(sched: Scheduler, seqs: list[Sequence], max_num_seqs: int) -> None:
    owners: dict[tuple[str, int], str] = {}
    for seq in seqs:
        for kind, table in (("device", seq.block_table), ("host", seq.host_table)):
            for block in table:
                assert (kind, block) not in owners, f"{kind} block {block} shared"
                owners[(kind, block)] = seq.request_id
    blocks = sched.blocks
    assert sum(k == "device" for k, _ in owners) == blocks.device.num_used
    assert sum(k == "host" for k, _ in owners) == blocks.host.num_used
    assert len(sched.running) <= max_num_seqs
    for seq in sched.running:
        assert seq.kv_place is KVPlace.DEVICE
        assert len(seq.block_table) >= blocks_for(seq.num_computed, blocks.block_size)
    for seq in sched.waiting():
        assert not seq.block_table
        if seq.kv_place is KVPlace.HOST:
            assert len(seq.host_table) == blocks_for(seq.num_computed, blocks.block_size)


def _apply(batch: Batch, sched: Scheduler) -> list[Sequence]:
    """What the engine does after the forward pass, with a fake token."""
    done = []
    for seq, n in batch.items:
        assert len(seq.block_table) * sched.blocks.block_size >= seq.num_computed + n
        seq.num_computed += n
        if seq.num_computed == seq.num_tokens:
            seq.append(7, 0.0, 0, max_model_len=10_000)
            if seq.finished:
                sched.finish(seq)
                done.append(seq)
    return done


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 30)), min_size=1, max_size=12),
    num_blocks=st.integers(18, 40),
    host_blocks=st.integers(0, 30),
    max_num_seqs=st.integers(1, 6),
    chunk=st.integers(1, 24),
    threshold=st.floats(0.3, 1.0),
)
def test_random_workloads_finish_with_consistent_blocks(
    lengths, num_blocks, host_blocks, max_num_seqs, chunk, threshold
):
    block_size = 4  # 18 blocks hold the longest request (40 + 30 tokens)
    sched = Scheduler(
        BlockManager(num_blocks, host_blocks, block_size), max_num_seqs, chunk, threshold
    )
    seqs = [
        Sequence(
            f"r{i}", [1] * prompt, SamplingParams(target_len=out), seed=i, stop_ids=frozenset()
        )
        for i, (prompt, out) in enumerate(lengths)
    ]
    for seq in seqs:
        sched.add(seq)
    finished: list[Sequence] = []
    for _ in range(5_000):
        if not sched.num_unfinished:
            break
        batch = sched.schedule()
        assert not batch.empty, "scheduler stalled"
        _check_invariants(sched, seqs, max_num_seqs)
        finished += _apply(batch, sched)
    assert sorted(s.request_id for s in finished) == sorted(s.request_id for s in seqs)
    assert all(s.num_output == s.params.target_len for s in seqs)
    assert sched.blocks.device.num_used == 0 and sched.blocks.host.num_used == 0
