"""Where each actor runs: GPU shares per actor, packed into one Ray placement group, and the
custom Ray resources each asks for (`ray.engine_resources`, `ray.trainer_resources`), which
keep it to the nodes started with them (`ray start --resources`).

`plan_placement` is pure (the run's sections and the node's GPU count), so a plan can be
printed for any machine; `place_actors` reserves the plan on a live Ray cluster
(`PlacedActors`), refusing in one line when the cluster cannot hold it, or an engine's share
cannot hold the model (`dorarl.runtime.engine_budget`), instead of waiting forever on an
actor Ray cannot place.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dorarl.config import ConfigError
from dorarl.engine.config import EngineConfig
from dorarl.runtime.engine_budget import budget_lines, engine_budgets, gpu_memory
from dorarl.runtime.ray_config import ENGINE_KEY, RESERVED, ROUND, TRAINER_KEY, RayConfig
from dorarl.trainer.config import TrainerConfig

if TYPE_CHECKING:
    from dorarl.engine.model_spec import ModelSpec

# The evaluator's share of the bundle it shares: Ray needs a positive GPU share to give an
# actor a visible device, and evaluation is idle most of the run, so it takes a sliver.
EVAL_SHARE = 0.1


@dataclass(frozen=True)
class NodeAsk:
    """Custom Ray resources an actor asks for, so that it runs only on a node that has them,
    and the key that sets them."""

    key: str
    amounts: dict[str, float]


@dataclass(frozen=True)
class Bundle:
    """One reservation (a GPU or a share of one) and the actors that run inside it, with
    the custom resources they ask for (an actor in a bundle takes from the bundle only)."""

    gpus: float
    actors: tuple[str, ...]
    resources: dict[str, float] = field(default_factory=dict)

    def reserved(self) -> dict[str, float]:
        return {"GPU": self.gpus, **self.resources}


@dataclass(frozen=True)
class PlacementPlan:
    """GPU share of every actor on cuda and the bundles that hold them (none: all on CPU),
    and the custom resources of the actors that ask for some (`asks`; trainer ranks 1..N-1
    of a sharded trainer as `trainer_rank<r>`)."""

    shares: dict[str, float] = field(default_factory=dict)
    bundles: tuple[Bundle, ...] = ()
    asks: dict[str, NodeAsk] = field(default_factory=dict)

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

    def resources_of(self, actor: str) -> dict[str, float]:
        """The custom resources `actor` asks for ({}: it may run on any node)."""
        ask = self.asks.get(actor)
        return dict(ask.amounts) if ask else {}

    def lines(self) -> list[str]:
        rows = ["every actor on the CPU: no GPU asked for"]
        if self.uses_gpus:
            rows = [f"asks Ray for {self.total_gpus:g} GPU in one placement group (PACK):"]
        for i, b in enumerate(self.bundles):
            shares = ", ".join(f"{a} {self.shares[a]:g}" for a in b.actors)
            extra = f" and {_amounts(b.resources)}" if b.resources else ""
            rows.append(f"  bundle {i}: {b.gpus:g} GPU{extra} -> {shares}")
        by_key: dict[tuple[str, str], list[str]] = {}
        for actor, ask in self.asks.items():
            by_key.setdefault((ask.key, _amounts(ask.amounts)), []).append(actor)
        for (key, amounts), actors in by_key.items():
            rows.append(f"{', '.join(actors)}: each asks for {amounts} ({key})")
        return rows


def plan_placement(
    instances: int,
    engine: EngineConfig,
    trainer: TrainerConfig,
    ray: RayConfig,
    node_gpus: float,
) -> PlacementPlan:
    """The plan of a run of `instances` engines and one trainer, on the devices `engine.device`
    and `trainer.device` name, with the GPU shares and custom resources of `ray.*`, on a node
    with `node_gpus` GPUs."""
    return plan_shares(
        instances=instances,
        engine_on_gpu=engine.device != "cpu",
        trainer_on_gpu=trainer.device != "cpu",
        node_gpus=node_gpus,
        engine_gpus=engine_share(engine, ray.engine_gpus),
        trainer_gpus=ray.trainer_gpus,
        eval_gpus=ray.eval_gpus,
        engine_resources=ray.engine_resources,
        trainer_resources=ray.trainer_resources,
        trainer_ranks=trainer.world_size,
    )


def engine_share(engine: EngineConfig, asked: float | None) -> float | None:
    """An instance's GPU share: `ray.engine_gpus` (None: automatic), but whole GPUs for a
    vLLM engine sharded over engine.vllm.tensor_parallel_size of them."""
    tp = engine.vllm.tensor_parallel_size if engine.backend == "vllm" else 1
    if tp == 1:
        return asked
    if asked is not None and asked != tp:
        raise ConfigError(
            f"ray.engine_gpus: {asked:g} for instances that engine.vllm.tensor_parallel_size="
            f"{tp} shards over {tp} GPUs (leave it unset, or set {tp})"
        )
    return float(tp)


def plan_shares(
    *,
    instances: int,
    engine_on_gpu: bool,
    trainer_on_gpu: bool,
    node_gpus: float,
    engine_gpus: float | None = None,
    trainer_gpus: float | None = None,
    eval_gpus: float | None = None,
    engine_resources: Mapping[str, float] | None = None,
    trainer_resources: Mapping[str, float] | None = None,
    trainer_ranks: int = 1,
) -> PlacementPlan:
    """Shares for `instances` engines, the trainer and the evaluator (on the engines' device).

    Unset shares are chosen to fit `node_gpus`: a whole GPU per engine and one for the trainer
    when there are that many, else an equal share of what there is. The evaluator, idle most
    of the run, lives in the trainer's bundle (the first engine's when the trainer is on the
    CPU) and takes `EVAL_SHARE` of it. Every engine asks for `engine_resources`, every
    trainer rank for `trainer_resources`, and the evaluator for what the actor whose bundle
    it shares asks (on the CPU: the trainer's).
    """
    asks = _node_asks(
        instances,
        trainer_ranks,
        dict(engine_resources or {}),
        dict(trainer_resources or {}),
        evaluator_with_engines=engine_on_gpu and not trainer_on_gpu,
    )
    engines = [f"engine{i}" for i in range(instances)] if engine_on_gpu else []
    if not engines and not trainer_on_gpu:
        return PlacementPlan(asks=asks)
    shares = _gpu_shares(engines, trainer_on_gpu, node_gpus, engine_gpus, trainer_gpus)
    groups = {actor: [actor] for actor in shares}
    if engine_on_gpu:
        host = "trainer" if trainer_on_gpu else engines[0]
        host_auto = (trainer_gpus if host == "trainer" else engine_gpus) is None
        _seat_evaluator(shares, host, host_auto, eval_gpus)
        groups[host].append("evaluator")
    return PlacementPlan(shares, _bundles(groups, shares, asks), asks)


def _gpu_shares(
    engines: list[str],
    trainer_on_gpu: bool,
    node_gpus: float,
    engine_gpus: float | None,
    trainer_gpus: float | None,
) -> dict[str, float]:
    """Each GPU actor's share: the one set, else an equal automatic one of `node_gpus`."""
    seats = len(engines) + trainer_on_gpu
    auto = _auto_share(seats, node_gpus)
    shares = {e: engine_gpus if engine_gpus is not None else auto for e in engines}
    if trainer_on_gpu:
        shares["trainer"] = trainer_gpus if trainer_gpus is not None else auto
    if min(shares.values()) <= 0:
        raise ConfigError(
            f"ray: {seats} actors on cuda cannot share {node_gpus:g} GPUs "
            "(set ray.engine_gpus / ray.trainer_gpus, or put some on the CPU)"
        )
    return shares


def _seat_evaluator(
    shares: dict[str, float], host: str, host_auto: bool, eval_gpus: float | None
) -> None:
    """Give the evaluator its share in `host`'s bundle, carved out of the host's own share
    when that was chosen automatically."""
    evaluator = eval_gpus if eval_gpus is not None else _floor(EVAL_SHARE * min(shares[host], 1))
    if host_auto:
        shares[host] = _floor(shares[host] - evaluator)
    if evaluator <= 0 or shares[host] <= 0:
        raise ConfigError(
            f"ray.eval_gpus: the evaluator ({evaluator:g}) and {host} "
            f"({shares[host]:g}) must both get a positive GPU share"
        )
    shares["evaluator"] = evaluator


def _bundles(
    groups: dict[str, list[str]], shares: dict[str, float], asks: dict[str, NodeAsk]
) -> tuple[Bundle, ...]:
    """One bundle per group of actors placed together, its GPUs and custom resources summed."""
    bundles = tuple(
        Bundle(
            _floor(sum(shares[a] for a in members)),
            tuple(members),
            _summed(asks[a].amounts for a in members if a in asks),
        )
        for members in groups.values()
    )
    for b in bundles:
        if b.gpus > 1 and b.gpus != int(b.gpus):
            raise ConfigError(
                f"ray: bundle {', '.join(b.actors)} asks for {b.gpus:g} GPU: a share above 1 "
                "must be a whole number of GPUs"
            )
    return bundles


def _node_asks(
    instances: int,
    trainer_ranks: int,
    engine: dict[str, float],
    trainer: dict[str, float],
    evaluator_with_engines: bool,
) -> dict[str, NodeAsk]:
    asks: dict[str, NodeAsk] = {}
    if engine:
        asks.update({f"engine{i}": NodeAsk(ENGINE_KEY, engine) for i in range(instances)})
    if trainer:
        asks["trainer"] = NodeAsk(TRAINER_KEY, trainer)
        asks.update(
            {f"trainer_rank{r}": NodeAsk(TRAINER_KEY, trainer) for r in range(1, trainer_ranks)}
        )
    key, evaluator = (ENGINE_KEY, engine) if evaluator_with_engines else (TRAINER_KEY, trainer)
    if evaluator:
        asks["evaluator"] = NodeAsk(key, evaluator)
    return asks


def check_resources(plan: PlacementPlan, nodes: list[dict[str, float]]) -> None:
    """One line, before anything starts, when no node of the cluster (`nodes`: each alive
    node's resources) has what an actor asks for, or all of them together have less than the
    actors ask for in all: Ray would wait for it without end."""
    for actor, ask in plan.asks.items():
        if not any(_holds(node, ask.amounts) for node in nodes):
            raise ConfigError(
                f"{ask.key}: no node of the cluster has {_amounts(ask.amounts)} ({actor} asks "
                f"for it); the nodes have: {_nodes(nodes)} (a node offers a resource it was "
                "started with: ray start --resources='{\"NAME\": AMOUNT}')"
            )
    asked = _summed(ask.amounts for ask in plan.asks.values())
    held = _summed(nodes)
    for name, amount in asked.items():
        if amount > held.get(name, 0.0) + ROUND:
            keys = sorted({a.key for a in plan.asks.values() if name in a.amounts})
            askers = [actor for actor, a in plan.asks.items() if name in a.amounts]
            raise ConfigError(
                f"{', '.join(keys)}: {', '.join(askers)} ask for {name}={amount:g} in all, "
                f"the cluster has {name}={held.get(name, 0.0):g} (nodes: {_nodes(nodes)})"
            )


def _holds(node: dict[str, float], amounts: dict[str, float]) -> bool:
    return all(node.get(name, 0.0) + ROUND > amount for name, amount in amounts.items())


def _summed(amounts: Any) -> dict[str, float]:
    total: dict[str, float] = {}
    for each in amounts:
        for name, amount in each.items():
            total[name] = round(total.get(name, 0.0) + amount, 4)
    return total


def _amounts(amounts: dict[str, float]) -> str:
    return ", ".join(f"{name}={amount:g}" for name, amount in amounts.items())


def _nodes(nodes: list[dict[str, float]]) -> str:
    """Each node's resources a user places by: CPU, GPU and custom ones (not Ray's own
    node:<ip> and memory accounts)."""
    shown = [
        _amounts({k: node[k] for k in ("CPU", "GPU") if k in node} | _custom(node))
        for node in nodes
    ]
    return "; ".join(f"[{s}]" for s in shown) or "none alive"


def _custom(node: dict[str, float]) -> dict[str, float]:
    return {k: node[k] for k in sorted(node) if k not in RESERVED and not k.startswith("node:")}


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


def place_actors(
    instances: int,
    engine: EngineConfig,
    trainer: TrainerConfig,
    ray_config: RayConfig,
    spec: ModelSpec,
) -> PlacedActors:
    """Reserve the actors' GPU shares on the cluster Ray is connected to, or refuse in one
    line (exit 2) when it cannot hold them, lacks the custom resources they ask for, or an
    engine's share cannot hold the model (`spec`) and one max_model_len sequence; the plan
    (with the engines' KV budgets) is printed when it asks for GPUs or custom resources."""
    import ray

    cluster = ray.cluster_resources()
    plan = plan_placement(instances, engine, trainer, ray_config, cluster.get("GPU", 0.0))
    gpu_bytes = gpu_memory(ray_config) if plan.uses_gpus else None
    budgets = engine_budgets(instances, engine, spec, plan.shares, gpu_bytes)
    if plan.uses_gpus or plan.asks:
        lines = plan.lines() + budget_lines(budgets, gpu_bytes)
        print("\n".join(f"placement: {line}" for line in lines))
    if plan.uses_gpus:
        check_fits(plan, cluster)
    for budget in budgets:
        budget.check()
    return PlacedActors(plan, timeout_s=ray_config.placement_timeout_s)


class PlacedActors:
    """The plan reserved on a live cluster: Ray options (GPU share, bundle) per actor."""

    def __init__(self, plan: PlacementPlan, timeout_s: float = 60.0) -> None:
        self.plan = plan
        self.group = None
        if plan.asks:
            check_resources(plan, _alive_nodes())
        if plan.uses_gpus:
            self.group = _reserve(plan, timeout_s)

    def release(self) -> None:
        """Give the reservation back to the cluster (its actors, if any still live, die)."""
        if self.group is None:
            return
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)
        self.group = None

    def options(self, actor: str) -> dict[str, Any]:
        """`ray.remote(...)` keyword arguments for `actor` (engine<i>, trainer, evaluator):
        its GPU share and bundle, or none on the CPU, and its custom resources."""
        resources = self.plan.resources_of(actor)
        if self.group is None or actor not in self.plan.shares:
            return {"num_cpus": 0, "num_gpus": 0, "resources": resources}
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.group, placement_group_bundle_index=self.plan.bundle_of(actor)
        )
        return {
            "num_cpus": 0,
            "num_gpus": self.plan.shares[actor],
            "resources": resources,
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
    group = placement_group([b.reserved() for b in plan.bundles], strategy="PACK")
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        wanted = [b.reserved() if b.resources else b.gpus for b in plan.bundles]
        raise ConfigError(
            f"ray: could not place {plan.asked()} within {timeout_s:g} s "
            f"(ray.placement_timeout_s); no node can hold a bundle {wanted} "
            f"(resources: {_resources(ray.cluster_resources())}; nodes: {_nodes(_alive_nodes())})"
        ) from None
    return group


def _alive_nodes() -> list[dict[str, float]]:
    import ray

    return [node["Resources"] for node in ray.nodes() if node.get("Alive")]


def _resources(cluster: dict[str, float]) -> str:
    keys = ("CPU", "GPU", "memory")
    return ", ".join(f"{k}={cluster[k]:g}" for k in keys if k in cluster and k != "memory")
