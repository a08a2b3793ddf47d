"""`ControllerConfig`: the rollout/training schedule shared by every runtime.

Simple bounds are declared on the fields (`metadata` ge, gt, le, lt: dorarl.config.fields);
`validate()` checks them and the knobs' relations, raising `ConfigError("key: reason")`.
Modes fix some knobs (sync: K=0 and RBS=TBS; one_step_off: K=1 and RBS=TBS);
`effective_K` and `rollout_batch` give the values in force, and `ignored_settings()` names
the knobs a mode overrides.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal, get_args

from dorarl.config import ConfigError, check_fields

Mode = Literal["sync", "one_step_off", "partial_rollout", "dora"]
MODES: tuple[str, ...] = get_args(Mode)


@dataclass(kw_only=True)
class OrchestratorConfig:
    """The load-balancing orchestrator's knobs (dora): `dorarl train` and `dorarl simulate`
    both take them as `orchestrator.*`."""

    kv_offload_threshold: float = field(
        default=0.9,
        metadata={
            "help": "KV usage share that triggers relief (migrate or offload)",
            "gt": 0,
            "le": 1,
        },
    )
    rebalance_period_s: float = field(
        default=5.0, metadata={"help": "temporal re-balance period (seconds)", "gt": 0}
    )
    p2p_weights: bool = field(
        default=True, metadata={"help": "load weights from peer instances when possible"}
    )
    trainer_fanout: int = field(
        default=1, metadata={"help": "concurrent weight loads served by one source"}
    )
    engine_offload: bool = field(
        default=True,
        metadata={
            "help": "KV pressure may offload a request's KV to host memory (false, or engines "
            "that cannot: relief by migration only, the engine preempting on its own)"
        },
    )
    legacy_fill: bool = field(
        default=True, metadata={"help": "fill idle legacy-version slots with new groups"}
    )
    kv_packing: bool = field(
        default=True,
        metadata={
            "help": "consolidate a legacy version only down to the requests per instance "
            "that fit under the KV threshold at the last reports, not its slots"
        },
    )

    # An episode waiting for its environment keeps its KV but no decode slot, so counting it
    # as a running request idles the slots of an instance whose episodes wait on slow tools.
    # It takes none, but an instance holds at most this many times its slots in requests:
    # the KV of waiting episodes stays bounded (at 2, their KV is at most the running
    # requests'; the engine offloads it to host memory first under pressure), and so does
    # the queue of episodes whose environments all answer at once (they wait for a slot in
    # the engine, resumed before fresh prompts). At 2 the slots stay busy as long as an
    # episode's environment takes no longer per turn than its decoding does.
    episode_overcommit: float = field(
        default=2.0,
        metadata={
            "help": "requests an instance holds at most, as a multiple of its slots: "
            "episodes waiting for their environment take no slot, only room under this "
            "bound (1: a waiting episode keeps its slot)",
            "ge": 1,
        },
    )

    def within(self, serves_weights: bool, offloads: bool) -> OrchestratorConfig:
        """These knobs as engines can carry them out: ones that serve no weights get every
        load from the trainer, ones that offload no KV are relieved by migration only."""
        return dataclasses.replace(
            self,
            p2p_weights=self.p2p_weights and serves_weights,
            engine_offload=self.engine_offload and offloads,
        )

    def validate(self) -> None:
        if not math.isfinite(self.rebalance_period_s):
            raise ConfigError(f"rebalance_period_s: must be finite, got {self.rebalance_period_s}")
        if not math.isfinite(self.episode_overcommit):
            raise ConfigError(f"episode_overcommit: must be finite, got {self.episode_overcommit}")


@dataclass(kw_only=True)
class RolloutConfig:
    """What rollout hands the trainer (`dorarl train` and `dorarl simulate` take these as
    `rollout.*`): DAPO's dynamic sampling (docs/design.md, section 5, "Filtered groups")."""

    filter_groups: bool = field(
        default=False,
        metadata={
            "help": "DAPO dynamic sampling: a completed group whose rewards are all equal "
            "(zero advantage) is not trained on, and more prompts are dispatched to fill "
            "the batch with tbs informative groups"
        },
    )
    max_filtered_per_step: int = field(
        default=64,
        metadata={
            "help": "filter_groups: groups filtered at most per step (between two published "
            "versions); once reached, uniform groups are trained on, so a step always forms",
            "ge": 1,
        },
    )


@dataclass(kw_only=True)
class ControllerConfig:
    mode: Mode = field(
        default="dora", metadata={"help": "sync | one_step_off | partial_rollout | dora"}
    )
    K: int = field(
        default=2, metadata={"help": "staleness bound K of Eq. 1 (dora, partial_rollout)", "ge": 0}
    )
    rbs: int = field(
        default=48,
        metadata={"help": "RBS: target groups in rollout (dispatched, not yet complete)"},
    )
    tbs: int = field(
        default=32, metadata={"help": "TBS: groups consumed by one training step", "ge": 1}
    )
    group_size: int = field(default=8, metadata={"help": "G: samples per group (prompt)", "ge": 1})
    instances: int = field(
        default=4, metadata={"help": "rollout instances (one version each)", "ge": 1}
    )
    slots: int = field(default=64, metadata={"help": "max running requests per instance", "ge": 1})
    versions_per_instance: int = field(
        default=1,
        metadata={
            "help": "versions one instance holds at once (1: one; more with LoRA adapters): "
            "an instance takes the newest version while requests of older ones finish on it",
            "ge": 1,
        },
    )
    steps: int = field(
        default=10,
        metadata={"help": "version the run ends at (steps run: steps - initial_version)", "ge": 1},
    )
    initial_version: int = field(
        default=0,
        metadata={"help": "version every instance and the trainer start at (resume)", "ge": 0},
    )
    first_group: int = field(
        default=0,
        metadata={"help": "id of the first group (resume: groups dispatched before)", "ge": 0},
    )
    first_prompt: int = field(
        default=0,
        metadata={"help": "prompt index of the first new prompt (resume: data position)", "ge": 0},
    )
    resume_prompts: list[int] = field(
        default_factory=list,
        metadata={"help": "prompt indices dispatched before new ones (untrained at a checkpoint)"},
    )
    max_groups: int | None = field(
        default=None,
        metadata={"help": "cap on dispatched groups (dataset passes); None: unbounded"},
    )
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)

    def validate(self) -> None:
        check_fields(self)  # its fields' bounds and choices, sections' included
        if self.initial_version >= self.steps:
            raise ConfigError(
                f"steps: the run starts at version {self.initial_version}, so it must end "
                f"after it, got {self.steps}"
            )
        if any(p < 0 for p in self.resume_prompts):
            raise ConfigError(
                f"resume_prompts: prompt indices must be >= 0, got {self.resume_prompts}"
            )
        if self.rbs < self.tbs:
            raise ConfigError(f"rbs: must be >= tbs ({self.tbs}), got {self.rbs}")
        if self.group_size > self.instances * self.slots:
            raise ConfigError(
                f"group_size: {self.group_size} samples do not fit in "
                f"{self.instances} x {self.slots} slots"
            )
        self._check_max_groups()
        self._check_versions_per_instance()
        try:
            self.orchestrator.validate()
        except ConfigError as exc:
            raise ConfigError(f"orchestrator.{exc}") from None
        if self.rollout.filter_groups and self.group_size < 2:
            raise ConfigError(
                "rollout.filter_groups: needs group_size >= 2 (a group of one always has "
                "zero advantage, so every group would be filtered)"
            )

    def _check_versions_per_instance(self) -> None:
        """Several versions per instance: at a publish every instance takes the newest while
        its older requests finish, which needs room for the K+1 versions a window spans
        (fewer would leave an instance unable to switch, a policy of its own)."""
        held = self.versions_per_instance
        if held == 1:
            return
        if self.mode != "dora":
            raise ConfigError(f"versions_per_instance: {held} needs mode=dora, got {self.mode}")
        if held < self.effective_K + 1:
            raise ConfigError(
                f"versions_per_instance: {held} cannot hold the K+1={self.effective_K + 1} "
                "versions a window spans; hold more or lower K"
            )

    def _check_max_groups(self) -> None:
        """Enough groups for every step, filtered ones included: each step takes tbs and
        at most `max_filtered_per_step` more are filtered while it is gathered."""
        if self.max_groups is None:
            return
        per_step = self.tbs
        what = "tbs"
        if self.rollout.filter_groups:
            per_step += self.rollout.max_filtered_per_step
            what = "(tbs + rollout.max_filtered_per_step)"
        needed = (self.steps - self.initial_version) * per_step
        if self.max_groups < needed:
            raise ConfigError(f"max_groups: {self.max_groups} < steps to run x {what} = {needed}")

    @property
    def effective_K(self) -> int:
        """K in force: sync 0, one_step_off 1, otherwise `K`."""
        return {"sync": 0, "one_step_off": 1}.get(self.mode, self.K)

    @property
    def rollout_batch(self) -> int:
        """RBS in force: TBS for the lockstep modes; admission caps it at (K+1) x TBS."""
        if self.mode in ("sync", "one_step_off"):
            return self.tbs
        return min(self.rbs, (self.effective_K + 1) * self.tbs)

    @property
    def max_held(self) -> int:
        """Requests one instance holds at most, episodes waiting for their environment
        included (`orchestrator.episode_overcommit` x slots, never under the slots)."""
        return max(self.slots, int(self.slots * self.orchestrator.episode_overcommit))

    @property
    def lockstep(self) -> bool:
        """All instances host one version and switch together once the batch is done."""
        return self.mode in ("sync", "one_step_off")

    def ignored_settings(self) -> list[str]:
        """Human-readable notes on settings the mode overrides (for warnings)."""
        notes = []
        if self.effective_K != self.K:
            notes.append(f"K={self.K} ignored: {self.mode} uses K={self.effective_K}")
        if self.rbs != self.rollout_batch:
            why = "lockstep mode" if self.lockstep else "admission caps it at (K+1) x tbs"
            notes.append(f"rbs={self.rbs} ignored: {why}, effective {self.rollout_batch}")
        return notes
