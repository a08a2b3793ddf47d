"""A complete group survives its checkpoint's JSON exactly: tokens, behaviour log-probs,
versions, turns, segments and routes."""

import json
import math

from dorarl.data import Group, Sample, SavedGroup, SegmentStart, Turn
from dorarl.data.saved_groups import group_from_json, group_to_json


def test_a_saved_group_round_trips_through_json_exactly():
    sample = Sample(
        7, 1, prompt_id="p3", prompt_ids=[1, 2], response_ids=[5, 6, 9],
        logprobs=[-0.1234567890123456, -math.pi, -1e-300], versions=[2, 2, 3],
        finish_reason="stop", reward=0.5, migrations=1, observed=[False, True, False],
        turns=[Turn(1, 1, "stop", tool_calls=1), Turn(1, 0, "length")],
        routes=bytes(range(256)), segments=[SegmentStart(1, 1)],
    )  # fmt: skip
    saved = SavedGroup(Group(7, "p3", 2, [Sample(7, 0, "p3", [1, 2]), sample]), prompt_index=41)
    back = group_from_json(json.loads(json.dumps(group_to_json(saved))))
    assert back == saved
