"""Simulation runtime: virtual clock, cost-model instances and trainer, driving the real controller.

Imports neither torch nor Ray. `SimRuntime(config, cost, lengths, seed, out_dir).run()`
returns a `RunResult` and writes the same files as the Ray runtime.
"""

from dorarl.sim.cost import PRESETS, CostModel, kv_bytes_per_token, local
from dorarl.sim.lengths import LengthDist
from dorarl.sim.runtime import Deadlock, ProtocolError, RunResult, SimRuntime

__all__ = [
    "PRESETS",
    "CostModel",
    "Deadlock",
    "LengthDist",
    "ProtocolError",
    "RunResult",
    "SimRuntime",
    "kv_bytes_per_token",
    "local",
]
