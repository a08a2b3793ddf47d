"""Where each actor runs: GPU shares per actor, packed into one Ray placement group.

`plan_placement` is pure (it only needs the node's GPU count), so a plan can be printed for
any machine; `PlacedActors` reserves the plan on a live Ray cluster, refusing in one line
when the cluster cannot hold it instead of waiting forever on an actor Ray cannot place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dorarl.config import ConfigError

# The evaluator's share of the bundle it shares: Ray needs a positive GPU share to give an
# actor a visible device, and evaluation is idle most of the run, so it takes a sliver.
EVAL_SHARE = 0.1
ROUND = 1e-4  # Ray accounts GPU shares in 1e-4 units


@dataclass(frozen=True)
class Bundle:
    """One reservation (a GPU or a share of one) and the actors that run inside it."""

    gpus: float
    actors: tuple[str, ...]


@dataclass(frozen=True)
class PlacementPlan:
    """GPU share of every actor on cuda and the bundles that hold them (none: all on CPU)."""

    shares: dict[str, float] = field(default_factory=dict)
    bundles: tuple[Bundle, ...] = ()

    @property
    def total_gpus(self) -> float:
        return round(sum(b.gpus for b in self.bundles), 4)

    @property
    def uses_gpus(self) -> bool:
        return bool(self.bundles)

    def bundle_of(self, actor: str) -> int:
        return next(i for i, b in enumerate(self.bundles) if actor in b.actors)

    def asked(self) -> str:
        """The ask in words, e.g. `1 GPU (engine0 0.3333 + engine1 0.3333 + trainer 0.3 + ...)`."""
        parts = " + ".join(f"{actor} {share:g}" for actor, share in self.shares.items())
        return f"{self.total_gpus:g} GPU ({parts})"

    def lines(self) -> list[str]:
        if not self.uses_gpus:
            return ["every actor on the CPU: no GPU asked for"]
        rows = [f"asks Ray for {self.total_gpus:g} GPU in one placement group (PACK):"]
        for i, b in enumerate(self.bundles):
            shares = ", ".join(f"{a} {self.shares[a]:g}" for a in b.actors)
            rows.append(f"  bundle {i}: {b.gpus:g} GPU -> {shares}")
        return rows


def plan_placement(
    *,
    instances: int,
    engine_on_gpu: bool,
    trainer_on_gpu: bool,
    node_gpus: float,
    engine_gpus: float | None = None,
    trainer_gpus: float | None = None,
    eval_gpus: float | None = None,
) -> PlacementPlan:
    """Shares for `instances` engines, the trainer and the evaluator (on the engines' device).

    Unset shares are chosen to fit `node_gpus`: a whole GPU per engine and one for the trainer
    when there are that many, else an equal share of what there is. The evaluator, idle most
    of the run, lives in the trainer's bundle (the first engine's when the trainer is on the
    CPU) and takes `EVAL_SHARE` of it.
    """
    engines = [f"engine{i}" for i in range(instances)] if engine_on_gpu else []
    seats = len(engines) + trainer_on_gpu
    if seats == 0:
        return PlacementPlan()
    auto = _auto_share(seats, node_gpus)
    shares = {e: engine_gpus if engine_gpus is not None else auto for e in engines}
    if trainer_on_gpu:
        shares["trainer"] = trainer_gpus if trainer_gpus is not None else auto
    if min(shares.values()) <= 0:
        raise ConfigError(
            f"ray: {seats} actors on cuda cannot share {node_gpus:g} GPUs "
            "(set ray.engine_gpus / ray.trainer_gpus, or put some on the CPU)"
        )
    host = "trainer" if trainer_on_gpu else (engines[0] if engines else None)
    groups = {actor: [actor] for actor in shares}
    if engine_on_gpu:
        host_auto = (trainer_gpus if host == "trainer" else engine_gpus) is None
        evaluator = (
            eval_gpus if eval_gpus is not None else _floor(EVAL_SHARE * min(shares[host], 1))
        )
        if host_auto:  # carve the evaluator's share out of the host's automatic one
            shares[host] = _floor(shares[host] - evaluator)
        if evaluator <= 0 or shares[host] <= 0:
            raise ConfigError(
                f"ray.eval_gpus: the evaluator ({evaluator:g}) and {host} "
                f"({shares[host]:g}) must both get a positive GPU share"
            )
        shares["evaluator"] = evaluator
        groups[host].append("evaluator")
    bundles = tuple(
        Bundle(_floor(sum(shares[a] for a in members)), tuple(members))
        for members in groups.values()
    )
    for b in bundles:
        if b.gpus > 1 and b.gpus != int(b.gpus):
            raise ConfigError(
                f"ray: bundle {', '.join(b.actors)} asks for {b.gpus:g} GPU: a share above 1 "
                "must be a whole number of GPUs"
            )
    return PlacementPlan(shares, bundles)


def _auto_share(seats: int, node_gpus: float) -> float:
    """A whole GPU per seat when there are enough; else an equal share such that every GPU
    holds whole shares (Ray places a fractional share within a single GPU)."""
    if node_gpus >= seats or node_gpus <= 0:  # none: ask as a GPU node would (and be refused)
        return 1.0
    if node_gpus < 1:
        return _floor(node_gpus / seats)
    return _floor(1.0 / math.ceil(seats / int(node_gpus)))


def _floor(value: float) -> float:
    return round(int(value / ROUND + 1e-6) * ROUND, 4)


class PlacedActors:
    """The plan reserved on a live cluster: Ray options (GPU share, bundle) per actor."""

    def __init__(self, plan: PlacementPlan, timeout_s: float = 60.0) -> None:
        self.plan = plan
        self.group = None
        if plan.uses_gpus:
            self.group = _reserve(plan, timeout_s)

    def options(self, actor: str) -> dict[str, Any]:
        """`ray.remote(...)` keyword arguments for `actor` (engine<i>, trainer, evaluator)."""
        if self.group is None:
            return {"num_cpus": 0, "num_gpus": 0}
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.group, placement_group_bundle_index=self.plan.bundle_of(actor)
        )
        return {
            "num_cpus": 0,
            "num_gpus": self.plan.shares[actor],
            "scheduling_strategy": strategy,
        }


def check_fits(plan: PlacementPlan, cluster: dict[str, float]) -> None:
    """One line, before anything starts, when the cluster has fewer GPUs than the plan asks."""
    available = float(cluster.get("GPU", 0.0))
    if plan.total_gpus > available + ROUND:
        raise ConfigError(
            f"ray: the run asks for {plan.asked()} but Ray reports {available:g} GPU "
            f"(resources: {_resources(cluster)}); set ray.engine_gpus / ray.trainer_gpus / "
            "ray.eval_gpus, fewer instances, or engine.device=cpu / trainer.device=cpu"
        )


def _reserve(plan: PlacementPlan, timeout_s: float) -> Any:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    check_fits(plan, ray.cluster_resources())
    group = placement_group([{"GPU": b.gpus} for b in plan.bundles], strategy="PACK")
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise ConfigError(
            f"ray: could not place {plan.asked()} within {timeout_s:g} s "
            f"(ray.placement_timeout_s); no node can hold a bundle "
            f"{[b.gpus for b in plan.bundles]} (resources: {_resources(ray.cluster_resources())})"
        ) from None
    return group


def _resources(cluster: dict[str, float]) -> str:
    keys = ("CPU", "GPU", "memory")
    return ", ".join(f"{k}={cluster[k]:g}" for k in keys if k in cluster and k != "memory")
