"""The driver's books: requests complete once, groups are trained complete, a stop
dispatches nothing more and keeps what was sampled; checked on the simulator's real executor where one is needed."""

import pytest

from dorarl.controller import ControllerConfig, Dispatch, ProtocolError, Start
from dorarl.data import Sample
from dorarl.data.lengths import LengthDist
from dorarl.driver import GroupAssembly, RequestSpec, RequestTable
from dorarl.sim import SimRuntime


def _spec(group, index, **kw):
    return RequestSpec(
        f"{group}:{index}", group, index, prompt_index=group, version=0, seed=7, **kw
    )


def _sample(group, index):
    return Sample(group, index, prompt_id=group, prompt_ids=[1], response_ids=[2, 3])


def test_a_request_completes_once_and_moving_ones_stay_on_their_source():
    table = RequestTable(instances=2)
    table.start(_spec(0, 0), 0)
    table.start(_spec(0, 1), 0)
    table.moving("0:1")
    assert table.held(0) == 2 and [s.request_id for s in table.on(0)] == ["0:0"]
    table.place("0:1", 1)  # landed
    assert (table.held(0), table.held(1)) == (1, 1)
    assert table.finish("0:1").sample_index == 1
    assert table.finish("0:1") is None  # a second report is refused
    table.park("0:0")
    assert table.held(0) == 0 and table.live("0:0") and table.on(0) == []


def test_a_group_is_taken_complete_in_index_order_and_never_twice():
    groups = GroupAssembly(group_size=2)
    groups.open(5, prompt_index=3, version=1, targets=[None, None])
    groups.add(_sample(5, 1))
    with pytest.raises(ProtocolError, match="group 5 has 1/2 samples"):
        groups.take(5)
    with pytest.raises(ProtocolError, match="5:1 reported twice"):
        groups.add(_sample(5, 1))
    groups.add(_sample(5, 0))
    group = groups.take(5)
    assert [s.sample_index for s in group.samples] == [0, 1] and group.version == 1
    with pytest.raises(ProtocolError, match="group 5 has 0/2"):
        groups.take(5)


def _sim():
    config = ControllerConfig(mode="dora", K=1, rbs=2, tbs=1, group_size=2, instances=2,
                              slots=4, steps=2)  # fmt: skip
    return SimRuntime(config, lengths=LengthDist(median=8, max_len=32, prompt_len=4), seed=1)


def test_the_driver_refuses_a_second_report_of_a_request():
    sim = _sim()
    driver = sim.driver
    driver.deliver(Start(0.0))
    spec = next(s for i in range(2) for s in driver.requests.on(i))
    sample = Sample(spec.group_id, spec.sample_index, spec.prompt_index, [0], [0, 0, 0])
    assert driver.sample_done(0, sample)
    assert not driver.sample_done(1, sample)  # the same request from elsewhere: refused
    assert driver.controller.counts()["completed"] == 0  # the group still lacks a sample


def test_a_stopping_driver_dispatches_nothing_and_the_targets_are_the_groups_own():
    sim = _sim()
    driver = sim.driver
    driver.should_stop = lambda: True
    driver.check_stop()  # the controller hears Stop first: it dispatches nothing after it
    driver.deliver(Start(0.0))
    assert len(driver.requests) == 0 and driver.controller.counts()["dispatched"] == 0
    assert driver.finished and driver.stopped  # nothing in flight: stopped at once
    sim = _sim()
    driver = sim.driver
    driver.execute(Dispatch(0, 0, 0, 0, (0,)))
    driver.execute(Dispatch(0, 0, 0, 1, (1,)))  # the rest of the group, elsewhere
    targets = sim.driver.lengths.group_lengths(1, 0, 2)
    assert [driver.requests.spec(f"0:{i}").target_len for i in (0, 1)] == targets
    assert driver.requests.held(0) == driver.requests.held(1) == 1
