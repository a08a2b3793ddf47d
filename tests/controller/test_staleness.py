from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from dorarl.controller.staleness import (
    batch_ready,
    capacity,
    headroom,
    select_batch,
    staleness,
    training_need,
    window,
)


def test_window_has_at_most_k_plus_one_versions_ending_at_newest():
    assert list(window(5, 2)) == [3, 4, 5]
    assert list(window(1, 3)) == [0, 1]
    assert list(window(4, 0)) == [4]


def test_capacity_counts_the_steps_that_can_still_take_a_version():
    # trainer about to update v=3 with K=2: version 1 can only go into step 3
    assert capacity(1, k=2, t=3, tbs=8) == 8
    assert capacity(3, k=2, t=3, tbs=8) == 24
    assert capacity(0, k=2, t=3, tbs=8) == 0
    assert staleness(train_version=3, behavior_version=1) == 2


def test_headroom_is_areal_rule_on_every_prefix():
    # t=2, K=1, TBS=4: out(<=1) may reach 4, out(<=2) may reach 8
    out = {1: 3, 2: 2}
    assert headroom(out, version=2, newest=2, k=1, t=2, tbs=4) == 3
    # adding under version 1 raises both prefixes: room = min(4-3, 8-5) = 1
    assert headroom(out, version=1, newest=2, k=1, t=2, tbs=4) == 1


def test_busy_trainer_with_k0_admits_nothing():
    # sync: while step 3 runs (t=4), version 3 has zero capacity
    assert headroom({}, version=3, newest=3, k=0, t=4, tbs=8) == 0
    assert headroom({}, version=4, newest=4, k=0, t=4, tbs=8) == 8


def test_training_need_forces_the_oldest_version_in_full():
    out = {3: 5, 4: 8, 5: 8}  # t=5, K=2: version 3 must all go into step 5
    need = training_need(out, k=2, t=5, tbs=8)
    assert need[3] == 5
    assert batch_ready(out, {3: 4, 4: 8, 5: 8}, k=2, t=5, tbs=8) is False
    assert batch_ready(out, {3: 5, 5: 3}, k=2, t=5, tbs=8) is True


def test_need_on_a_newer_prefix_blocks_until_enough_old_groups_are_done():
    # K=2, t=5: after the step, out(<=4) must fit (4 + 2 - 6 + 1) x 8 = 8, and it is 12,
    # so the step needs 4 groups of v<=4 even though version 3 (t-K) has none left
    out = {4: 12, 5: 4}
    assert training_need(out, k=2, t=5, tbs=8) == {4: 4}
    assert not batch_ready(out, {4: 3, 5: 4}, k=2, t=5, tbs=8)
    assert batch_ready(out, {4: 4, 5: 4}, k=2, t=5, tbs=8)


def test_select_batch_is_oldest_version_first_then_completion_order():
    queues = {5: deque([50, 51]), 3: deque([30, 31, 32]), 4: deque([40])}
    assert select_batch(queues, 4) == [30, 31, 32, 40]


@settings(max_examples=300, deadline=None)
@given(
    k=st.integers(0, 4),
    tbs=st.integers(1, 5),
    ops=st.lists(st.integers(0, 99), max_size=300),
    filter_share=st.sampled_from([0, 0, 1, 2, 4]),  # in fifths of the completions
)
def test_admission_and_selection_keep_eq1_under_any_interleaving(k, tbs, ops, filter_share):
    """Drive the pure rules with random dispatch/complete/filter/train choices: INV and Eq. 1
    hold for every trained group, each group ends trained or filtered (never both), and an
    idle trainer whose outstanding groups are all complete can always form a step."""
    t, newest = 0, 0
    out: dict[int, list[int]] = {}  # version -> outstanding group ids
    done: dict[int, deque] = {}
    running: list[tuple[int, int]] = []
    trained: set[int] = set()
    filtered: set[int] = set()
    next_id = 0
    for op in ops:
        counts = {v: len(g) for v, g in out.items() if g}
        if op < 40:  # dispatch under a random window version
            v = newest - (op % (k + 1))
            if v >= 0 and headroom(counts, v, newest, k, t, tbs) > 0:
                out.setdefault(v, []).append(next_id)
                running.append((v, next_id))
                next_id += 1
        elif op < 80 and running:  # complete a random running group; maybe filter it
            v, gid = running.pop(op % len(running))
            if op % 5 < filter_share:
                out[v].remove(gid)  # it leaves the outstanding count, never queued
                filtered.add(gid)
            else:
                done.setdefault(v, deque()).append(gid)
        elif newest == t:  # trainer idle: train if the rules allow
            dcounts = {v: len(q) for v, q in done.items() if q}
            ready = batch_ready(counts, dcounts, k, t, tbs)
            # no deadlock: with nothing running, TBS complete groups always make a step
            assert ready or running or sum(dcounts.values()) < tbs
            if ready:
                for gid in select_batch(done, tbs):
                    v = next(v for v, q in done.items() if q and q[0] == gid)
                    done[v].popleft()
                    out[v].remove(gid)
                    assert 0 <= staleness(t, v) <= k
                    trained.add(gid)
                t += 1
        else:  # training finishes: publish
            newest = t
        below = 0
        for w in range(0, newest + 1):
            below += len(out.get(w, []))
            assert below <= capacity(w, k, t, tbs)
    assert not trained & filtered
    outstanding = {gid for groups in out.values() for gid in groups}
    assert trained | filtered | outstanding == set(range(next_id))
    assert len(trained) + len(filtered) + len(outstanding) == next_id
