"""Where an engine loads a version from: never a replacement still taking its instance's
versions back (it holds its start-up weights until then), but the trainer's copy or a
settled peer; a replacement that is the only copy is waited for, within the transport's
bound."""

import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import ray

from dorarl.controller import TRAINER
from dorarl.runtime.engines import EngineFleet

pytestmark = pytest.mark.usefixtures("shared_ray")


@ray.remote(num_cpus=0)
def _pause(seconds: float) -> None:
    time.sleep(seconds)


@dataclass
class _Controller:
    hosting: dict[int, list[int]] = field(default_factory=dict)  # version -> its hosts

    def hosts(self, version: int) -> list[int]:
        return self.hosting.get(version, [])


@dataclass
class _Weights:
    kept: set[int]  # the versions the trainer still serves
    spec: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(timeout_s=30.0))

    def has(self, version: int) -> bool:
        return version in self.kept


def _fleet(controller: _Controller, weights: _Weights) -> EngineFleet:
    driver = SimpleNamespace(controller=controller, now=time.monotonic, recorder=None)
    fleet = EngineFleet(driver, [None] * 3, None, weights, None, None)
    fleet.alive = lambda iid: True  # the stubs stand for live actors
    return fleet


def test_a_restoring_replacement_is_no_source_while_another_copy_lives():
    fleet = _fleet(_Controller({21: [1, 2]}), _Weights(kept=set()))
    stuck = _pause.remote(60)
    fleet._restoring[1] = [stuck]
    try:
        assert fleet.restoring(1)
        assert fleet.holder(21, avoid=0) == 2
        fleet.weights.kept.add(21)
        assert fleet.holder(21, avoid=0) == TRAINER
    finally:
        ray.cancel(stuck, force=True)


@ray.remote(num_cpus=0)
def _refuse() -> None:
    raise RuntimeError("WeightsRefused: fingerprint mismatch")


def test_a_replacement_whose_restore_failed_is_no_source():
    """Its load ended, in failure: it still holds its start-up weights (it is replaced in
    turn by recovery), so neither a peer load nor the bounded wait takes it."""
    fleet = _fleet(_Controller({21: [1, 2]}), _Weights(kept=set()))
    fleet._restoring[1] = [ray.put(None), _refuse.remote()]
    assert fleet.restoring(1)
    assert fleet.holder(21, avoid=0) == 2
    fleet.driver.controller.hosting[21] = [1]
    with pytest.raises(RuntimeError, match="no live copy of version 21"):
        fleet.holder(21, avoid=0)
    assert fleet.restoring(1)


def test_a_replacement_that_is_the_only_copy_serves_once_it_has_it_back():
    fleet = _fleet(_Controller({21: [1]}), _Weights(kept=set()))
    fleet._restoring[1] = [ray.put(None), _pause.remote(0.5)]
    assert fleet.holder(21, avoid=0) == 1
    assert not fleet.restoring(1) and 1 not in fleet._restoring


def test_waiting_for_a_replacement_is_bounded():
    weights = _Weights(kept=set(), spec=SimpleNamespace(timeout_s=0.3))
    fleet = _fleet(_Controller({21: [1]}), weights)
    stuck = _pause.remote(60)
    fleet._restoring[1] = [stuck]
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="no live copy of version 21 to load on instance 0"):
            fleet.holder(21, avoid=0)
    finally:
        ray.cancel(stuck, force=True)
    assert time.monotonic() - start < 10


def test_a_load_the_controller_sends_to_a_restoring_replacement_comes_from_the_trainer():
    fleet = _fleet(_Controller({21: [1]}), _Weights(kept={21}))
    carried, submitted = [], []
    fleet._carry = lambda iid, version, source: carried.append((iid, version, source))
    fleet.calls = SimpleNamespace(submit=submitted.append)
    stuck = _pause.remote(60)
    fleet._restoring[1] = [stuck]
    try:
        fleet.load(0, 21, source=1)
    finally:
        ray.cancel(stuck, force=True)
    assert carried == [(0, 21, TRAINER)] and submitted[0].source == TRAINER
    fleet._restoring.clear()
    fleet.load(2, 21, source=1)  # settled: the controller's choice stands
    assert carried[-1] == (2, 21, 1)
