"""GPU placement: plans that fit the node, one-line refusals, and a reservation on live Ray."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import ray
from hypothesis import given
from hypothesis import strategies as st

from dorarl.config import ConfigError, load_config
from dorarl.engine import EngineConfig
from dorarl.engine.vllm.config import vllm_missing
from dorarl.jobs.config import TrainConfig
from dorarl.runtime.local_ray import start_local_ray
from dorarl.runtime.placement import (
    Bundle,
    PlacedActors,
    PlacementPlan,
    check_fits,
    check_resources,
    plan_placement,
)
from dorarl.runtime.ray_config import RayConfig
from dorarl.trainer import TrainerConfig


def gpu_config(*overrides: str) -> TrainConfig:
    return load_config(TrainConfig, None, ["engine.device=cuda", "trainer.device=cuda", *overrides])


def placement(config: TrainConfig, node_gpus: float) -> PlacementPlan:
    """The run's plan on a node of `node_gpus` GPUs, as `dorarl train` makes it."""
    return plan_placement(config.instances, config.engine, config.trainer, config.ray, node_gpus)


def packs(bundles: tuple[Bundle, ...], gpus: int) -> bool:
    """Whether the bundles fit `gpus` devices of capacity 1, a fractional bundle on one device
    (first fit, largest first)."""
    free = [1.0] * gpus
    for b in sorted(bundles, key=lambda b: -b.gpus):
        if b.gpus >= 1:
            whole = [i for i, f in enumerate(free) if f >= 1 - 1e-9][: int(b.gpus)]
            if len(whole) < b.gpus:
                return False
            for i in whole:
                free[i] = 0.0
            continue
        slot = next((i for i, f in enumerate(free) if f >= b.gpus - 1e-9), None)
        if slot is None:
            return False
        free[slot] -= b.gpus
    return True


def test_one_gpu_holds_the_default_run():
    plan = placement(gpu_config(), 1)
    assert plan.total_gpus <= 1 and packs(plan.bundles, 1)
    assert set(plan.shares) == {"engine0", "engine1", "trainer", "evaluator"}
    assert all(share > 0 for share in plan.shares.values())
    assert plan.bundle_of("evaluator") == plan.bundle_of("trainer")


def test_an_eight_gpu_node_gives_the_evaluator_no_gpu_of_its_own():
    plan = placement(gpu_config("instances=7"), 8)
    assert [b.gpus for b in plan.bundles] == [1.0] * 8
    assert plan.bundles[-1].actors == ("trainer", "evaluator")
    assert plan.shares["engine3"] == 1.0 and plan.shares["evaluator"] == pytest.approx(0.1)


def test_explicit_shares_and_cpu_actors():
    plan = placement(gpu_config("ray.engine_gpus=0.25"), 1)
    assert plan.shares["engine0"] == plan.shares["engine1"] == 0.25
    assert not placement(load_config(TrainConfig), 8).uses_gpus
    trainer_only = placement(load_config(TrainConfig, None, ["trainer.device=cuda"]), 1)
    assert trainer_only.shares == {"trainer": 1.0}


@pytest.mark.skipif(vllm_missing() is not None, reason="vllm is not installed here")
def test_a_vllm_instance_sharded_over_gpus_gets_them_whole():
    """engine.vllm.tensor_parallel_size=N: every instance's bundle holds N whole GPUs (its
    vLLM workers' devices); a share set otherwise is refused naming the key."""
    tp = ["engine.backend=vllm", "engine.vllm.tensor_parallel_size=2"]
    plan = placement(gpu_config("instances=3", *tp), 8)
    assert [plan.shares[f"engine{i}"] for i in range(3)] == [2.0, 2.0, 2.0]
    assert packs(plan.bundles, 8)
    with pytest.raises(ConfigError, match="^ray.engine_gpus: 0.5 for instances that engine"):
        placement(gpu_config("ray.engine_gpus=0.5", *tp), 8)


def test_a_share_above_one_must_be_whole():
    with pytest.raises(ConfigError, match="^ray: bundle trainer, evaluator asks for 1.5 GPU"):
        placement(gpu_config("ray.trainer_gpus=1.4"), 8)
    with pytest.raises(ConfigError, match="^ray.engine_gpus: must be > 0"):
        gpu_config("ray.engine_gpus=0")


@given(
    instances=st.integers(1, 16),
    node_gpus=st.integers(1, 16),
    engine_on_gpu=st.booleans(),
    trainer_on_gpu=st.booleans(),
)
def test_automatic_shares_always_pack_onto_the_node(
    instances, node_gpus, engine_on_gpu, trainer_on_gpu
):
    engine = EngineConfig(device="cuda" if engine_on_gpu else "cpu")
    trainer = TrainerConfig(device="cuda" if trainer_on_gpu else "cpu")
    plan = plan_placement(instances, engine, trainer, RayConfig(), node_gpus)
    assert plan.uses_gpus == (engine_on_gpu or trainer_on_gpu)
    assert all(share > 0 for share in plan.shares.values())
    assert plan.total_gpus <= node_gpus + 1e-9 and packs(plan.bundles, node_gpus)
    check_fits(plan, {"GPU": float(node_gpus)})


def test_a_cluster_without_the_gpus_is_refused_in_one_line():
    plan = placement(gpu_config(), 1)
    with pytest.raises(ConfigError) as refused:
        check_fits(plan, {"CPU": 2.0, "GPU": 0.0})
    message = str(refused.value)
    assert "\n" not in message
    assert "asks for 0.9999 GPU (engine0 0.3333" in message and "Ray reports 0 GPU" in message


@pytest.mark.slow
def test_reservation_on_live_ray_and_no_wait_forever():
    start_local_ray(num_cpus=1, num_gpus=2)  # logical GPUs: Ray only accounts them
    try:
        plan = placement(gpu_config(), ray.cluster_resources()["GPU"])
        placed = PlacedActors(plan, timeout_s=30)

        @ray.remote
        def gpu_ids():
            return ray.get_gpu_ids()

        for actor in ("engine0", "trainer", "evaluator"):
            assert len(ray.get(gpu_ids.options(**placed.options(actor)).remote())) == 1
        # total fits (2.0 of 2) but no GPU can hold 0.7 + 0.6: refused after the timeout
        unpackable = PlacementPlan(
            {"engine0": 0.7, "engine1": 0.7, "trainer": 0.6},
            (Bundle(0.7, ("engine0",)), Bundle(0.7, ("engine1",)), Bundle(0.6, ("trainer",))),
        )
        with pytest.raises(ConfigError, match="^ray: could not place 2 GPU .* within 2 s"):
            PlacedActors(unpackable, timeout_s=2)
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_dorarl_train_on_cuda_without_gpus_exits_2_with_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-m", "dorarl.cli", "train", "--out", str(tmp_path / "run")]
        + ["engine.device=cuda", "trainer.device=cuda", "steps=2", "progress=false"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("dorarl: error:")]
    assert len(lines) == 1 and "Ray reports 0 GPU" in lines[0], done.stderr
    assert "Traceback" not in done.stderr


def test_custom_resources_follow_each_actor_and_fill_its_bundle():
    """Engines ask for ray.engine_resources, every trainer rank for ray.trainer_resources,
    the evaluator for what the actor whose bundle it shares asks (on the CPU: the
    trainer's); a bundle reserves its actors' custom resources with its GPU share."""
    keys = ["ray.engine_resources={rollout: 0.5}", "ray.trainer_resources={learner: 0.25}"]
    cpu = placement(load_config(TrainConfig, None, [*keys, "trainer.world_size=2"]), 0)
    assert not cpu.uses_gpus
    assert {a: cpu.resources_of(a) for a in cpu.asks} == {
        "engine0": {"rollout": 0.5},
        "engine1": {"rollout": 0.5},
        "trainer": {"learner": 0.25},
        "trainer_rank1": {"learner": 0.25},
        "evaluator": {"learner": 0.25},
    }
    assert "engine0, engine1: each asks for rollout=0.5 (ray.engine_resources)" in cpu.lines()
    engines_on_gpu = placement(load_config(TrainConfig, None, [*keys, "engine.device=cuda"]), 1)
    assert engines_on_gpu.resources_of("evaluator") == {"rollout": 0.5}
    assert engines_on_gpu.asks["evaluator"].key == "ray.engine_resources"
    assert [b.resources for b in engines_on_gpu.bundles] == [{"rollout": 1.0}, {"rollout": 0.5}]
    both = placement(gpu_config(*keys), 3)
    assert both.resources_of("evaluator") == {"learner": 0.25}
    held = {b.actors: b.reserved() for b in both.bundles}
    assert held[("trainer", "evaluator")] == {"GPU": 1.0, "learner": 0.5}
    assert held[("engine0",)] == {"GPU": 1.0, "rollout": 0.5}
    assert not placement(load_config(TrainConfig), 0).asks  # unset: any node


@pytest.mark.parametrize(
    ("override", "refusal"),
    [
        ("ray.engine_resources={CPU: 1}", "^ray.engine_resources: 'CPU' is not a custom resource"),
        ("ray.trainer_resources={GPU: 1}", "^ray.trainer_resources: 'GPU' is not a custom"),
        ("ray.engine_resources={rollout: 0}", "^ray.engine_resources.rollout: must be >= 0.0001"),
        ("ray.engine_resources={rollout: x}", "^ray.engine_resources.rollout: expected float"),
        ("ray.trainer_resources=learner", "^ray.trainer_resources: expected a mapping"),
    ],
)
def test_bad_custom_resources_are_refused_naming_the_key(override, refusal):
    with pytest.raises(ConfigError, match=refusal):
        load_config(TrainConfig, None, [override])


def test_a_cluster_without_the_custom_resources_is_refused_in_one_line():
    keys = ["ray.engine_resources={rollout: 1}", "ray.trainer_resources.a=1"]
    plan = placement(load_config(TrainConfig, None, keys), 0)
    head, second = {"CPU": 2.0, "a": 1.0, "node:10.0.0.1": 1.0}, {"CPU": 1.0, "rollout": 1.0}
    with pytest.raises(ConfigError) as refused:
        check_resources(plan, [head])
    message = str(refused.value)
    assert "\n" not in message and message.startswith("ray.engine_resources: no node of the")
    assert "has rollout=1 (engine0 asks for it); the nodes have: [CPU=2, a=1]" in message
    with pytest.raises(ConfigError, match=r"^ray.engine_resources: engine0, engine1 ask for "
                       r"rollout=2 in all, the cluster has rollout=1 \(nodes: \[CPU=2, a=1\]; "
                       r"\[CPU=1, rollout=1\]\)$"):  # fmt: skip
        check_resources(plan, [head, second])
    with pytest.raises(ConfigError, match="^ray.trainer_resources: trainer, evaluator ask for a=2"):
        check_resources(plan, [head, {"CPU": 1.0, "rollout": 2.0}])
    check_resources(plan, [{**head, "a": 2.0}, {"CPU": 1.0, "rollout": 2.0}])
    split_keys = ["ray.engine_resources={rollout: 1, b: 1}"]
    split = placement(load_config(TrainConfig, None, split_keys), 0)
    with pytest.raises(ConfigError, match="no node of the cluster has rollout=1, b=1"):
        check_resources(split, [{"b": 2.0}, {"rollout": 2.0}])  # each on a node, none both
