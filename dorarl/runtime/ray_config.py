"""The `ray.*` keys of `dorarl train`: the cluster, actor threads and restarts, and where the
actors run (GPU shares, custom node resources). Settings only: no Ray or torch here
(`dorarl train --help` reads it); `dorarl.runtime.placement` turns them into a plan."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from dorarl.config import ConfigError

ROUND = 1e-4  # Ray accounts GPU shares and custom resources in 1e-4 units
ENGINE_KEY, TRAINER_KEY = "ray.engine_resources", "ray.trainer_resources"
RESERVED = ("CPU", "GPU", "memory", "object_store_memory")
"""Resources Ray accounts itself: an actor's CPUs and GPUs come from num_cpus / num_gpus."""


@dataclass(kw_only=True)
class RayConfig:
    """The `ray.*` keys of `dorarl train`."""

    address: str | None = field(
        default=None, metadata={"help": "Ray cluster address (None: start local Ray)"}
    )
    host: str = field(
        default="127.0.0.1",
        metadata={"help": "address a local Ray's services listen on (127.0.0.1: this machine)"},
    )
    threads_per_actor: int = field(
        default=0,
        metadata={
            "help": "torch threads in each actor (0: share this machine's cores: the trainer "
            "all of them, engines an equal share at lower priority, the evaluator one)",
            "ge": 0,
        },
    )
    allocator: Literal["auto", "tcmalloc", "system"] = field(
        default="auto",
        metadata={
            "help": "malloc of the actors on the CPU: tcmalloc preloaded (auto: where this "
            "machine has it; a CPU training step spends a quarter of its time in page faults "
            "on glibc's), or system (glibc's)"
        },
    )
    max_engine_restarts: int = field(
        default=3,
        metadata={"help": "dead engine instances replaced mid-run before the run stops", "ge": 0},
    )
    max_trainer_restarts: int = field(
        default=1,
        metadata={
            "help": "times a dead trainer (any rank of a sharded one) restarts from the newest "
            "checkpoint mid-run",
            "ge": 0,
        },
    )
    engine_gpus: float | None = field(
        default=None,
        metadata={
            "help": "GPU share of each engine on cuda (None: fit the node; 0.25: 4 a GPU)",
            "gt": 0,
        },
    )
    trainer_gpus: float | None = field(
        default=None,
        metadata={"help": "GPU share of the trainer on cuda (None: fit the node)", "gt": 0},
    )
    eval_gpus: float | None = field(
        default=None,
        metadata={
            "help": "GPU share of the evaluator, inside the trainer's bundle (None: 0.1 of it)",
            "gt": 0,
        },
    )
    placement_timeout_s: float = field(
        default=60.0,
        metadata={"help": "seconds to wait for Ray to place the actors' GPUs", "gt": 0},
    )
    startup_timeout_s: float = field(
        default=1800.0,
        metadata={
            "help": "seconds the actors may take to come up (imports, model load) before the "
            "run fails naming those not up",
            "gt": 0,
        },
    )
    gpu_memory_gb: float | None = field(
        default=None,
        metadata={
            "help": "memory of each GPU, to check the engines' KV budgets before any actor "
            "starts and for --print-placement (None: what nvidia-smi reports here)",
            "gt": 0,
        },
    )
    engine_resources: dict[str, float] = field(
        default_factory=dict,
        metadata={
            "help": "custom Ray resources each engine asks for, e.g. {rollout: 0.01}: engines "
            "run only on nodes started with them (ray start --resources='{\"rollout\": 1}')"
        },
    )
    trainer_resources: dict[str, float] = field(
        default_factory=dict,
        metadata={
            "help": "custom Ray resources the trainer (each rank) asks for, and the evaluator "
            "beside it (beside the first engine when only the engines are on cuda)"
        },
    )

    def validate(self) -> None:
        if self.allocator == "tcmalloc":
            from dorarl.runtime.malloc import preload_library

            preload_library(self.allocator)  # refused here, before anything starts
        check_resource_names(ENGINE_KEY, self.engine_resources)
        check_resource_names(TRAINER_KEY, self.trainer_resources)


def check_resource_names(key: str, amounts: Mapping[str, float]) -> None:
    """`key` (ray.engine_resources, ray.trainer_resources) names custom resources in positive
    amounts Ray can account (at least 1e-4; CPUs and GPUs have keys of their own)."""
    for name, amount in amounts.items():
        if not name or name in RESERVED:
            raise ConfigError(
                f"{key}: {name!r} is not a custom resource (CPUs and GPUs come from "
                "engine.device / trainer.device and ray.*_gpus); name one a node was started "
                "with (ray start --resources)"
            )
        if not (math.isfinite(amount) and amount >= ROUND):
            raise ConfigError(f"{key}.{name}: must be >= {ROUND:g}, got {amount:g}")
