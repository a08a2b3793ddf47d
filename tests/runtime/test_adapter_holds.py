"""An engine holding LoRA adapters keeps every version the controller holds on it, and no
call of the fleet goes unread: an episode dispatched under v whose reset answers after
its instance moved to v+1 still starts under v and completes (its adapter stayed, the
controller holding v for it), and an `add` that fails stops the run naming the engine."""

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import ray
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from test_ray_runtime import _dora_k1_runtime
from transformers import AutoModelForCausalLM

from dorarl.controller import TRAINER, ControllerConfig, Dispatch, ReleaseVersion
from dorarl.controller.views import InstanceView
from dorarl.data import Sample
from dorarl.driver import RequestSpec
from dorarl.driver.requests import RequestTable
from dorarl.engine import EngineConfig
from dorarl.errors import WorkerFailed
from dorarl.record.pacing import PaceTally
from dorarl.runtime.actors import EngineSpec, spawn_engine
from dorarl.runtime.calls import CallTable, LoadCall, RunCall
from dorarl.runtime.engines import EngineFleet
from dorarl.runtime.rollout import RolloutPlan, RolloutSettings
from dorarl.runtime.transfer.weight_layout import AdapterSpec, build_manifest, wire_tensors
from dorarl.tasks import make_task
from dorarl.tasks.env import Env, EnvStep
from dorarl.tasks.env_task import EnvTask

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]

RANK, ALPHA = 4, 8.0
ENGINE = dict(max_num_seqs=4, max_model_len=128, prefix_cache="off", max_versions=3,
              max_lora_rank=8)  # fmt: skip
LORA = ["trainer.lora.rank=8", "trainer.lora.lr=1e-3", "engine.max_versions=3",
        "engine.prefix_cache=off"]  # fmt: skip
RESET_GATE = threading.Event()  # the resets answer once it is set


class GatedReset(Env):
    async def reset(self, prompt):
        while not RESET_GATE.is_set():
            await asyncio.sleep(0.01)
        return " go"

    async def step(self, response):
        return EnvStep("", 1.0, True)


class _Transport:
    """Each version's adapter, as the trainer would send it."""

    def __init__(self, adapters: dict[int, dict[str, torch.Tensor]]) -> None:
        self.adapters = adapters

    def has(self, version: int) -> bool:
        return True

    def load(self, engine: Any, version: int, peer: Any) -> ray.ObjectRef:
        named = self.adapters[version]
        wire = wire_tensors(named, torch.float32)
        manifest = build_manifest(wire, version, 1 << 14, adapter=AdapterSpec(ALPHA, RANK))
        return engine.load_weights.remote(named, version, manifest)


class _Silent:
    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


@dataclass
class _Driver:
    """What the fleet asks of its driver; the controller's view of instance 0 is `view`."""

    view: InstanceView
    requests: RequestTable = field(default_factory=lambda: RequestTable(1))
    samples: list[Sample] = field(default_factory=list)
    recorder: Any = field(default_factory=_Silent)
    config: Any = field(default_factory=lambda: ControllerConfig(mode="dora", K=1))

    def now(self) -> float:
        return time.monotonic()

    @property
    def controller(self) -> "_Driver":
        return self

    def instance(self, iid: int) -> InstanceView:
        return self.view

    def deliver(self, event: Any) -> None:
        pass

    def sample_done(self, iid: int, sample: Sample) -> None:
        self.requests.finish(f"g{sample.group_id}-{sample.sample_index}")
        self.samples.append(sample)


def _adapter(folder, seed: int) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    torch.manual_seed(seed)
    peft = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear"))
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn_like(param) * 0.2)
    return {n: t.detach().clone() for n, t in get_peft_model_state_dict(peft).items()}


def _answer(fleet: EngineFleet, calls: CallTable, until, timeout_s: float = 60.0) -> None:
    """The runtime's loop in short: hand each answer to the fleet (a failed call raises)
    and poll the envs, until `until()`; bounded by `timeout_s`."""
    handlers = {RunCall: fleet.on_run, LoadCall: fleet.on_loaded}
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, "the fleet did not get there in time"
        for ref in calls.ready(0.05):
            call = calls.take(ref)
            result = ray.get(ref)
            if type(call) in handlers:
                handlers[type(call)](result, call)
        fleet.poll_envs()


def test_an_episode_whose_reset_answers_after_its_instance_moved_on_runs_under_its_version(
    tiny_model_dir,
):
    folder = str(tiny_model_dir)
    engine = spawn_engine(0, EngineSpec(folder, EngineConfig(**ENGINE)))
    task = EnvTask(make_task("multiturn_sum", seed=0), GatedReset, max_turns=1, timeout_s=120)
    settings = RolloutSettings(max_new_tokens=6, stop_token_ids=[2])
    driver = _Driver(InstanceView(0, 1, False, ()))
    calls = CallTable()
    transport = _Transport({v: _adapter(folder, seed=v) for v in (1, 2)})
    fleet = EngineFleet(
        driver, [engine], calls, transport, RolloutPlan(task, settings), PaceTally()
    )
    try:
        fleet.load(0, 1, TRAINER)
        _answer(fleet, calls, lambda: not calls.of_kind(LoadCall))
        spec = RequestSpec("g0-0", 0, 0, prompt_index=0, version=1, seed=5)
        driver.requests.start(spec, 0)
        fleet.dispatch(Dispatch(0, 0, 1, 0, (0,)), [spec])  # its reset is out
        fleet.poll_envs()
        # the instance moves to v2; the controller holds v1 for the episode resetting there
        driver.view = InstanceView(0, 2, False, ("g0-0",), held=(1,))
        fleet.load(0, 2, TRAINER)
        _answer(fleet, calls, lambda: not calls.of_kind(LoadCall))
        assert ray.get(engine.resident_versions.remote()) == [0, 1, 2]
        RESET_GATE.set()
        _answer(fleet, calls, lambda: bool(driver.samples) and not len(calls))
        (sample,) = driver.samples
        assert sample.response_ids and set(sample.versions) == {1}
        assert driver.requests.held(0) == 0
        # the controller releases v1 once its last request ended: the adapter goes
        driver.view = InstanceView(0, 2, True, (), held=())
        fleet.release_version(ReleaseVersion(0, 1))
        _answer(fleet, calls, lambda: not len(calls))
        assert ray.get(engine.resident_versions.remote()) == [0, 2]
    finally:
        RESET_GATE.clear()
        ray.kill(engine)


def test_an_add_that_fails_stops_the_run_naming_the_engine(tiny_model_dir):
    """A request under a version its engine does not hold: the add raises there, and the
    run stops on it instead of waiting forever for a sample that never comes."""
    runtime = _dora_k1_runtime(tiny_model_dir, None, None, 0, "instances=1", "steps=2", *LORA)
    try:
        runtime.start()
        stray = RequestSpec("g999-0", 999, 0, prompt_index=0, version=7, seed=1)
        runtime.engines.start(0, [stray])
        with pytest.raises(WorkerFailed, match=r"engine instance 0 \(adding requests\)") as failed:
            runtime.run()
        assert "version 7 is not resident" in failed.value.detail
    finally:
        for actor in [*runtime.engines.workers, runtime.trainer_client.actor]:
            ray.kill(actor)
