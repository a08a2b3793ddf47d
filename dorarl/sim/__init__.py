"""The simulator: a virtual clock and cost-model instances and trainer executing the driver's
commands, so the real controller runs at cluster scale without hardware.

Imports neither torch nor Ray. `SimRuntime(config, cost, lengths, seed, out_dir).run()`
returns a `RunResult` and writes the same files as the Ray runtime. The `dorarl simulate`
application (presets, validation, what-if grids) is `dorarl.simulate`.
"""

from dorarl.sim.cost import PRESETS, CostModel, kv_bytes_per_token, local
from dorarl.sim.episodes import EpisodeModel
from dorarl.sim.rewards import RewardModel
from dorarl.sim.runtime import Deadlock, ProtocolError, RunResult, SimRuntime

__all__ = [
    "PRESETS",
    "CostModel",
    "Deadlock",
    "EpisodeModel",
    "ProtocolError",
    "RewardModel",
    "RunResult",
    "SimRuntime",
    "kv_bytes_per_token",
    "local",
]
