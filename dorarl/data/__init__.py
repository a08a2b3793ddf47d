"""Plain data that crosses part boundaries: samples and groups, and workload lengths.

Torch-free: the controller, the simulator and the Ray runtime pass these around.
`samples` holds what the engines produce and the trainer consumes; `lengths` the
long-tailed response-length distributions benchmarks and the simulator draw from;
`saved_groups` the JSON form of complete groups a stopped run's checkpoint keeps.
"""

from dorarl.data.samples import Group, NewSegment, Sample, SegmentStart, Turn
from dorarl.data.saved_groups import SavedGroup, group_from_json, group_to_json

__all__ = [
    "Group",
    "NewSegment",
    "Sample",
    "SavedGroup",
    "SegmentStart",
    "Turn",
    "group_from_json",
    "group_to_json",
]
