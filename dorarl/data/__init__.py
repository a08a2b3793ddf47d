"""Plain data that crosses part boundaries: samples and groups, and workload lengths.

Torch-free: the controller, the simulator and the Ray runtime pass these around.
`samples` holds what the engines produce and the trainer consumes; `lengths` the
long-tailed response-length distributions benchmarks and the simulator draw from.
"""

from dorarl.data.samples import Group, NewSegment, Sample, SegmentStart, Turn

__all__ = ["Group", "NewSegment", "Sample", "SegmentStart", "Turn"]
