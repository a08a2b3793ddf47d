"""A stopped run keeps what it sampled, on the simulator's real executor: the stop drains
the requests in flight, the checkpoint's position carries the complete groups (through
JSON), and the resumed run trains each of them once, within the staleness bound, so the
two runs' books add up with nothing dropped."""

import json

from dorarl.controller import ControllerConfig, Train
from dorarl.data import group_from_json
from dorarl.data.lengths import LengthDist
from dorarl.sim import SimRuntime

BASE = dict(mode="dora", K=2, rbs=6, tbs=2, group_size=2, instances=2, slots=8, steps=6)


def _sim(trained: list[int], **resume) -> SimRuntime:
    def observe(controller, event, commands):
        trained.extend(gid for c in commands if isinstance(c, Train) for gid in c.group_ids)

    config = ControllerConfig(**(BASE | resume))
    lengths = LengthDist(median=8, max_len=32, prompt_len=4)
    return SimRuntime(config, lengths=lengths, seed=1, observer=observe)


def test_a_stopped_then_resumed_run_trains_every_sampled_group_once():
    trained: list[int] = []
    first = _sim(trained)
    first.driver.should_stop = lambda: first.controller.version >= 2
    one = first.run().summary
    assert first.driver.stopped and first.controller.version == 3  # the step in flight ended
    assert one["in_flight_at_end"] == 0 and one["dropped_total"] == 0  # drained, not dropped
    position = json.loads(json.dumps(first.driver.resume_state()))  # as the checkpoint keeps it
    carried = [group_from_json(g) for g in position.pop("carried_groups")]
    assert len(carried) == one["queued_at_end"] > 0
    assert {g.group.group_id for g in carried}.isdisjoint(trained)

    second = _sim(
        trained, initial_version=position["version"], first_group=position["first_group"],
        first_prompt=position["first_prompt"], resume_prompts=position["resume_prompts"],
    )  # fmt: skip
    second.driver.carried = carried
    two = second.run().summary
    assert two["carried_in"] == len(carried) and two["dropped_total"] == 0
    assert {g.group.group_id for g in carried} <= set(trained)
    assert len(trained) == len(set(trained))  # each group trained once
    assert set(two["staleness"]) <= {"0", "1", "2"}  # within K, the carried ones too
    ends = two["queued_at_end"] + two["in_flight_at_end"]
    assert one["dispatched"] + two["dispatched"] == len(trained) + ends
    assert one["consumed"] + two["consumed"] == len(trained)
    assert second.controller.violations() == []
