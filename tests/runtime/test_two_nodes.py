"""Two Ray nodes on this machine, both on loopback: a head offering `learner` and a second
node offering `rollout`. A dora run joins them through ray.address with its engines on the
second node and its trainer on the head (ray.engine_resources, ray.trainer_resources);
weights cross between the nodes over the weight group and an engine killed mid-run comes back
on its node (KV migration between engines is test_ray_runtime's: here the engines share a
node, and whether a request is in flight at a version change depends on the machine's load).

The nodes are `ray.cluster_utils.Cluster`'s (real GCS and raylets, children of this
process, stopped by it), not `ray start`: a second `ray start` needs Ray's cluster switch,
which turns a loopback head address into the machine's outward one, and Ray's services
listen on every interface for a node address other than 127.0.0.1.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
import ray
from ray._private import ray_constants
from ray._private.authentication.authentication_token_setup import ensure_token_if_auth_enabled
from ray.cluster_utils import Cluster
from test_local_ray import _listening, _this_run
from test_ray_runtime import COMMON, _check_invariants, _read

from dorarl.config import ConfigError, load_config
from dorarl.jobs.config import TrainConfig
from dorarl.jobs.ray_run import run_ray
from dorarl.record.pacing import DeviceModel
from dorarl.runtime.actors import TrainerSpec, spawn_trainer
from dorarl.runtime.local_ray import _single_node_mode, is_loopback, join_ray
from dorarl.runtime.placement import PlacedActors, plan_placement
from dorarl.trainer import TrainerConfig

pytestmark = pytest.mark.slow

STEPS = 8
KILL_AFTER = 4
"""Step rows in metrics.jsonl after which an engine process of the second node gets SIGKILL:
every engine has loaded a version over the weight group by then, and half the run is left
for the replacement to join."""
PLACES = {"head": {"learner": 1.0}, "second": {"rollout": 3.0}}
"""Each node's custom resources: three engines asking rollout=1 fill the second node (a
replacement can only go where the dead one was), trainer and evaluator take the head's."""
PLACEMENT = ["ray.engine_resources={rollout: 1}", "ray.trainer_resources={learner: 0.5}"]
ENGINE, TRAINER, EVALUATOR = "ray::EngineWorker", "ray::TrainerWorker", "ray::EvalWorker"


@pytest.fixture(scope="module")
def two_nodes():
    """The two nodes, token authentication on (Ray's default; the test process's own Ray
    reads the mode as ray.init does for a new cluster), every service on 127.0.0.1."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_AUTH_MODE", "token")
        _single_node_mode()  # 127.0.0.1 stays the nodes' address, not the machine's outward one
        ray._raylet.Config.initialize("")
        # what ray.init does for a new local cluster; Cluster does not, and a fresh machine
        # has no ~/.ray/auth_token until some ray.init has made it
        ensure_token_if_auth_enabled()
        cluster = Cluster(initialize_head=True, head_node_args=_node_args("head"))
        try:
            cluster.add_node(**_node_args("second"))
            yield cluster
        finally:
            ray.shutdown()
            cluster.shutdown()


def _node_args(place: str) -> dict:
    return {
        "num_cpus": 1,
        "num_gpus": 0,
        "resources": PLACES[place],
        "node_ip_address": "127.0.0.1",
        "include_dashboard": False,
    }


def _raylets(cluster: Cluster) -> dict[int, str]:
    """Raylet process id -> the node it runs ("head" or "second")."""
    nodes = {"head": cluster.head_node, "second": next(iter(cluster.worker_nodes))}
    return {
        node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid: place
        for place, node in nodes.items()
    }


class Watcher(threading.Thread):
    """Notes which node each actor process runs on (an actor's process is its raylet's
    child) and, after `KILL_AFTER` steps, SIGKILLs an engine process on the second node and
    notes every socket the run's processes listen on."""

    def __init__(self, out: Path, raylets: dict[int, str]) -> None:
        super().__init__(daemon=True)
        self.out, self.raylets, self.done = out, raylets, threading.Event()
        self.seen: dict[int, tuple[str, str]] = {}  # pid -> actor class, node
        self.killed: int | None = None
        self.listening: set[tuple[str, int]] = set()

    def run(self) -> None:
        while not self.done.is_set():
            self._look()
            if self.killed is None and self._due():
                self.listening = _listening(_this_run())
                victims = [pid for pid, (t, n) in self.seen.items() if (t, n) == (ENGINE, "second")]
                if victims and psutil.pid_exists(victims[0]):
                    os.kill(victims[0], signal.SIGKILL)
                    self.killed = victims[0]
            time.sleep(0.05)

    def _look(self) -> None:
        for raylet, place in self.raylets.items():
            try:
                children = psutil.Process(raylet).children()
            except psutil.Error:
                continue
            for child in children:
                try:
                    title = " ".join(child.cmdline())
                except psutil.Error:
                    continue
                for actor in (ENGINE, TRAINER, EVALUATOR):
                    if title.startswith(actor):
                        self.seen.setdefault(child.pid, (actor, place))

    def _due(self) -> bool:
        """`KILL_AFTER` steps logged (whole lines), however slowly a loaded machine runs."""
        path = self.out / "metrics.jsonl"
        text = path.read_text() if path.exists() else ""
        return text[: text.rfind("\n") + 1].count("\n") >= KILL_AFTER


def test_a_dora_run_across_two_nodes(two_nodes, tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    overrides = [f"model={tiny_model_dir}", *COMMON, "mode=dora", "K=1", f"steps={STEPS}"]
    overrides += ["weights.transport=collective", f"ray.address={two_nodes.address}"]
    config = load_config(TrainConfig, overrides=overrides + PLACEMENT)
    watcher = Watcher(out, _raylets(two_nodes))
    watcher.start()
    try:  # paced engine steps: a device-like run whose versions overlap
        run_ray(config, None, out, pace=DeviceModel(decode_step_s=0.02, train_fixed_s=0.05))
    finally:
        watcher.done.set()
        watcher.join()
    summary, trajectories, metrics, trace = _read(out)
    _check_invariants(summary, trajectories, k=1)
    assert summary["steps"] == STEPS and len(metrics) == STEPS
    assert watcher.killed is not None and summary["engine_restarts"] == 1

    # where each actor ran: engines (the replacement too) on the second node, the rest on the head
    places = {}
    for actor, place in watcher.seen.values():
        places.setdefault(actor, []).append(place)
    assert places[ENGINE] == ["second"] * 4, watcher.seen  # three, and the one replacing
    assert places[TRAINER] == ["head"] and places[EVALUATOR] == ["head"], watcher.seen
    exposed = sorted(a for a in watcher.listening if not is_loopback(a[0]))
    assert len(watcher.listening) >= 8 and not exposed, watcher.listening

    # before the engine died every engine was in the weight group: the trainer's weights
    # crossed from the head to the second node over it (whether a KV migration also happened
    # then depends on the machine's load, so it is not asserted here)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    (died,) = [e["ts"] for e in events if e.get("name", "").startswith("instance restarted")]
    before = [e["name"] for e in events if e.get("ph") == "X" and e["ts"] < died]
    assert any(name.startswith("load v") and name.endswith("from trainer") for name in before)


def test_a_sharded_trainers_ranks_ask_for_the_trainers_resources(two_nodes, tiny_model_dir):
    """Rank 1 of a two-rank trainer asks for ray.trainer_resources as rank 0 does: both
    hold the head's `learner`, so neither can run on the second node."""
    join_ray(two_nodes.address)
    try:
        keys = ["trainer.world_size=2", "ray.trainer_resources={learner: 0.25}"]
        run = load_config(TrainConfig, None, keys)
        placed = PlacedActors(plan_placement(run.instances, run.engine, run.trainer, run.ray, 0))
        config = TrainerConfig(lr=1e-3, world_size=2)
        trainer = spawn_trainer(TrainerSpec(str(tiny_model_dir), config), placed=placed)
        (rank1,) = ray.get(trainer.rank_pids.remote(), timeout=120)
        assert ray.available_resources().get("learner", 0.0) == pytest.approx(0.5)
        raylet = psutil.Process(rank1).parent().pid
        assert _raylets(two_nodes)[raylet] == "head"
        ray.kill(trainer)
    finally:
        ray.shutdown()


def test_a_run_asking_for_what_no_node_has_is_refused_before_it_starts(
    two_nodes, tiny_model_dir, tmp_path
):
    out = tmp_path / "run"
    keys = [f"model={tiny_model_dir}", f"ray.address={two_nodes.address}"]
    keys.append("ray.engine_resources={gpu_node: 1}")
    with pytest.raises(ConfigError) as refused:
        run_ray(load_config(TrainConfig, None, [*keys, "progress=false"]), None, out)
    message = str(refused.value)
    assert message.startswith("ray.engine_resources: no node of the cluster has gpu_node=1")
    assert "[CPU=1, learner=1]" in message and "[CPU=1, rollout=3]" in message
    assert "\n" not in message
    assert not out.exists()  # refused before the run folder or any actor
