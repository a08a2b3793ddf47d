"""`SimulateConfig`: the settings of `dorarl simulate` (schedule, cost model, workload and its
rewards, output)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dorarl.controller import ControllerConfig
from dorarl.data.lengths import LengthDist
from dorarl.sim.cost import CostModel
from dorarl.sim.rewards import RewardModel


@dataclass(kw_only=True)
class SimulateConfig:
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    cost: CostModel = field(default_factory=CostModel)
    lengths: LengthDist = field(default_factory=LengthDist)
    rewards: RewardModel = field(default_factory=RewardModel)
    seed: int = field(default=0, metadata={"help": "workload seed (lengths, rewards)"})
    trace: bool = field(default=True, metadata={"help": "write trace.json (large at scale)"})
    trajectories: bool = field(default=True, metadata={"help": "write trajectories.jsonl"})
    warmup_steps: int = field(
        default=1, metadata={"help": "steps left out of sim.json figures (pipeline fill)"}
    )
