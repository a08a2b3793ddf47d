import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dorarl.controller.commands import TRAINER
from dorarl.controller.migration import Candidate, choose_releases, plan_migrations
from dorarl.controller.partition import capacity_floor, kv_fit, packing_limit, plan_partition
from dorarl.controller.weights import choose_weight_source

# ---- partition plan ----------------------------------------------------------------------


def test_partition_is_proportional_to_workload_when_unconstrained():
    target = plan_partition(
        {4: 30, 5: 90}, floors={4: 1, 5: 1}, caps={4: 8}, newest=5, num_instances=8
    )
    assert target == {4: 2, 5: 6}


def test_partition_respects_floors_so_no_version_with_work_drops_to_zero():
    # one straggler of v3 still needs an instance even though its share rounds to zero
    target = plan_partition({3: 1, 5: 500}, floors={3: 1}, caps={3: 4}, newest=5, num_instances=4)
    assert target == {3: 1, 5: 3}


def test_legacy_versions_never_grow_and_spare_seats_go_to_the_newest():
    target = plan_partition(
        {3: 100, 4: 5}, floors={3: 2, 4: 1}, caps={3: 2, 4: 3}, newest=5, num_instances=6
    )
    assert target[3] == 2 and target[4] <= 3
    assert target[5] == 6 - target[3] - target[4] >= 1


def test_versions_without_work_lose_all_instances():
    target = plan_partition({5: 10}, floors={}, caps={2: 3, 4: 1}, newest=5, num_instances=4)
    assert target == {5: 4}


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(1, 32),
    slots=st.integers(1, 16),
    running=st.lists(st.integers(0, 60), min_size=1, max_size=4),
    demand=st.integers(0, 200),
)
def test_partition_invariants(n, slots, running, demand):
    newest = len(running)
    floors = {v: capacity_floor(r, slots) for v, r in enumerate(running) if r}
    if sum(floors.values()) > n:
        return  # not a reachable state: running requests always fit their instances
    workload = {v: r for v, r in enumerate(running) if r}
    if demand:
        workload[newest] = demand
    caps = {v: max(floors.get(v, 0), n // 2) for v in range(newest)}
    target = plan_partition(workload, floors, caps, newest, n)
    assert sum(target.values()) == n
    for v, floor in floors.items():
        assert target.get(v, 0) >= floor
    for v, cap in caps.items():
        assert target.get(v, 0) <= cap
    assert all(target.get(v, 0) == 0 for v in range(newest) if v not in workload)


# ---- migration plan ----------------------------------------------------------------------


def test_releases_cheapest_instances_and_only_when_the_rest_can_absorb_them():
    cands = [
        Candidate(0, running=10, free=6, ready=True, pinned=False),
        Candidate(1, running=2, free=14, ready=True, pinned=False),
        Candidate(2, running=3, free=13, ready=True, pinned=False),
    ]
    assert choose_releases(cands, 2) == [1, 2]
    # the rest could not hold 10 more after releasing 1 and 2 -> stop at what fits
    tight = [Candidate(i, running=8, free=0, ready=True, pinned=False) for i in range(3)]
    assert choose_releases(tight, 2) == []


def test_pinned_instances_are_never_released():
    cands = [
        Candidate(0, running=0, free=8, ready=False, pinned=True),
        Candidate(1, running=1, free=7, ready=True, pinned=False),
        Candidate(2, running=5, free=3, ready=True, pinned=True),
    ]
    assert choose_releases(cands, 3) == [1]


def test_migration_plan_places_every_request_and_spreads_by_free_slots():
    plan = plan_migrations({7: ["a", "b", "c"], 3: ["d"]}, free={1: 2, 2: 3})
    placed = {rid: dst for rids, _, dst in plan for rid in rids}
    assert set(placed) == {"a", "b", "c", "d"}
    assert sorted(placed.values()).count(1) <= 2 and sorted(placed.values()).count(2) <= 3
    assert all(src in (3, 7) for _, src, _ in plan)
    with pytest.raises(ValueError, match="no free slot"):
        plan_migrations({0: ["x", "y"]}, free={1: 1})


# ---- weight source -----------------------------------------------------------------------


def test_peer_first_then_trainer_then_wait():
    assert choose_weight_source({4: 0, 2: 1}, trainer_has_version=True, trainer_busy=0) == 4
    assert choose_weight_source({}, trainer_has_version=True, trainer_busy=0) == TRAINER
    # a new version spreads as a tree: wait while the only source is busy
    assert choose_weight_source({}, trainer_has_version=True, trainer_busy=1) is None
    assert choose_weight_source({3: 1}, trainer_has_version=True, trainer_busy=1) is None
    assert choose_weight_source({3: 1}, trainer_has_version=True, trainer_busy=1, fanout=2) == 3


def test_legacy_version_needs_a_peer_and_p2p_off_uses_the_trainer():
    assert choose_weight_source({}, trainer_has_version=False, trainer_busy=0) is None
    assert (
        choose_weight_source({5: 0}, trainer_has_version=True, trainer_busy=3, p2p=False) == TRAINER
    )


def test_kv_fit_scales_the_reported_running_count_to_the_threshold():
    assert kv_fit(running=40, kv_used_frac=0.8, threshold=0.9) == pytest.approx(45.0)


def test_packing_limit_takes_the_tightest_kv_report_and_never_exceeds_slots():
    assert packing_limit(256, []) == 256
    assert packing_limit(256, [None, None]) == 256
    assert packing_limit(256, [70.4, None, 180.0]) == 70
    assert packing_limit(16, [300.0]) == 16
    assert packing_limit(16, [0.3]) == 1  # one request that overflows still needs its instance
