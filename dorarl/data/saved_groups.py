"""Complete groups as JSON and back, exactly (floats round-trip, routes as base64): what a
stopped run's checkpoint keeps of the groups it sampled and did not train on yet."""

from __future__ import annotations

import base64
from dataclasses import asdict, dataclass
from typing import Any

from dorarl.data.samples import Group, Sample, SegmentStart, Turn


@dataclass(frozen=True)
class SavedGroup:
    """A complete group and the controller's prompt index it was dispatched with."""

    group: Group
    prompt_index: int


def group_to_json(saved: SavedGroup) -> dict[str, Any]:
    group = saved.group
    return {
        "group_id": group.group_id,
        "prompt_index": saved.prompt_index,
        "prompt_id": group.prompt_id,
        "version": group.version,
        "samples": [_sample_to_json(s) for s in group.samples],
    }


def group_from_json(data: dict[str, Any]) -> SavedGroup:
    samples = [_sample_from_json(s) for s in data["samples"]]
    group = Group(int(data["group_id"]), data["prompt_id"], int(data["version"]), samples)
    return SavedGroup(group, int(data["prompt_index"]))


SEQUENCES = ("prompt_ids", "response_ids", "logprobs", "versions", "observed")


def _sample_to_json(sample: Sample) -> dict[str, Any]:
    fields = asdict(sample)
    # any sequence type a runtime filled them with (a lazy one, an array): plain lists
    fields |= {name: list(getattr(sample, name)) for name in SEQUENCES}
    fields["routes"] = base64.b64encode(sample.routes).decode("ascii")
    return fields


def _sample_from_json(data: dict[str, Any]) -> Sample:
    fields = dict(data)
    fields["routes"] = base64.b64decode(fields.get("routes", ""))
    fields["turns"] = [Turn(**t) for t in fields.get("turns", [])]
    fields["segments"] = [SegmentStart(**s) for s in fields.get("segments", [])]
    return Sample(**fields)
