"""The engine worker on engine.backend=vllm, planned by the backend's capabilities: a
migration leaves as an abort and lands as a re-prefill under the same version (its greedy
tokens those of an unmoved request), loads are checked inside vLLM's worker (a flipped
tensor refused, the old version kept), and what vLLM cannot do is refused or skipped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm.v1.engine.llm_engine")

from dorarl.config import ConfigError  # noqa: E402
from dorarl.engine.config import EngineConfig, SamplingParams  # noqa: E402
from dorarl.engine.vllm.config import VllmArgs  # noqa: E402
from dorarl.errors import UserInputError  # noqa: E402
from dorarl.runtime.transfer.weight_layout import (  # noqa: E402
    WeightsRefused,
    build_manifest,
    wire_tensors,
)
from dorarl.runtime.workers.engine_worker import EngineWorker, NewRequest  # noqa: E402

BASE_MODEL = Path(__file__).resolve().parents[3] / "assets" / "base_model"
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, stop_token_ids=[])  # 24 tokens each
PROMPTS = [[1, 5, 9, 14, 30], [1, 40, 41, 42, 43, 44], [1, 70, 3, 3, 60, 61, 62, 8]]


@pytest.fixture(scope="module")
def worker():
    config = EngineConfig(
        backend="vllm", max_model_len=256, max_num_seqs=8,
        vllm=VllmArgs(enforce_eager=True, block_size=32),
    )  # fmt: skip
    w = EngineWorker(0, str(BASE_MODEL), config)
    yield w
    w._close()


def _run_all(worker: EngineWorker) -> dict:
    done = {}
    for _ in range(200):
        if not worker.engine.has_runnable():
            return done
        done.update({o.request_id: o for o in worker.run(8, until_finished=False).finished})
    raise AssertionError("requests still running after 200 calls")


def _add(worker: EngineWorker, tag: str) -> None:
    worker.add([NewRequest(f"{tag}{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])


def test_a_migration_is_an_abort_and_a_re_prefill_under_the_same_version(worker):
    _add(worker, "still")
    unmoved = _run_all(worker)
    _add(worker, "moved")
    worker.run(5, until_finished=False)  # a few tokens each, then they move
    ids, snapshots = worker.export([f"moved{i}" for i in range(3)])
    assert ids == ["moved0", "moved1", "moved2"] and worker.engine.request_ids() == []
    assert all(s.kv is None and s.output_ids for s in snapshots)  # tokens only
    assert worker.import_(snapshots) == ids
    moved = _run_all(worker)
    for i in range(3):
        out = moved[f"moved{i}"]
        assert out.output_ids == unmoved[f"still{i}"].output_ids
        assert out.migrations == 1 and out.reprefill_tokens >= len(PROMPTS[i])
        assert set(out.versions) == {worker.engine.version}


def test_a_snapshot_of_another_version_is_not_continued_here(worker):
    worker.add([NewRequest("old", PROMPTS[0], GREEDY)])
    worker.run(2, until_finished=False)
    _, (snap,) = worker.export(["old"])
    snap.version += 1
    with pytest.raises(UserInputError, match="is not hosted here"):
        worker.import_([snap])
    assert worker.engine.request_ids() == []


def test_what_vllm_cannot_do_is_refused_or_skipped(worker):
    worker.add([NewRequest("kept", PROMPTS[1], GREEDY)])
    assert worker.offload("kept") is False  # vLLM preempts on its own
    with pytest.raises(RuntimeError, match="serves no weights"):
        worker.weights()
    assert worker.resident_versions() == [worker.engine.version]
    worker.abort(["kept"])


def test_a_model_vllm_cannot_run_here_is_refused_at_the_first_call(tiny_model_dir):
    """The tiny test Llama's heads of 16 have no vLLM-CPU attention kernel: refused in one
    line naming engine.backend when the run starts, not when a request first decodes."""
    config = EngineConfig(backend="vllm", max_model_len=64, vllm=VllmArgs(enforce_eager=True))
    refused = EngineWorker(1, str(tiny_model_dir), config)
    with pytest.raises(ConfigError) as error:
        refused.started()
    line = str(error.value)
    assert line.startswith("engine.backend: vLLM ") and "head_dim=16" in line
    assert "\n" not in line


def _moved(version: int, seed: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(seed)
    base = load_file(str(BASE_MODEL / "model.safetensors"))
    return {n: t.float() + torch.randn(t.shape, generator=gen) * 0.02 for n, t in base.items()}


def _manifest(named: dict[str, torch.Tensor], version: int):
    return build_manifest(wire_tensors(named, torch.float32), version, bucket_bytes=1 << 20)


def test_a_load_is_checked_in_vllms_worker_and_a_flipped_tensor_refused(worker):
    named = _moved(1, seed=1)
    report = worker.load_weights(named, 1, _manifest(named, 1))
    assert report.version == 1 and worker.engine.version == 1
    _add(worker, "v1_")
    before = _run_all(worker)
    sent = _moved(2, seed=2)
    flipped = dict(sent)
    name = "model.layers.0.self_attn.v_proj.weight"
    flipped[name] = sent[name].clone()
    flipped[name][2, 5] = -flipped[name][2, 5]
    with pytest.raises(WeightsRefused) as refused:
        worker.load_weights(flipped, 2, _manifest(sent, 2))
    line = str(refused.value)
    assert "\n" not in line and name in line and "instance 0 in its worker" in line
    assert worker.engine.version == 1
    _add(worker, "v1_")
    assert {r: o.output_ids for r, o in _run_all(worker).items()} == {
        r: o.output_ids for r, o in before.items()
    }


def test_the_evaluator_runs_the_runs_backend_and_checks_in_vllms_worker():
    """An evaluator of a vLLM run scores on a vLLM engine; a version unlike its manifest is
    refused in vLLM's worker (never scored), the matching one is scored."""
    from dorarl.runtime.workers.eval_worker import EvalWorker
    from dorarl.tasks import make_task

    config = EngineConfig(backend="vllm", max_model_len=128, max_num_seqs=4,
                          vllm=VllmArgs(enforce_eager=True, block_size=32))  # fmt: skip
    evaluator = EvalWorker(str(BASE_MODEL), config, make_task("running_sum", seed=0), 4)
    try:
        assert type(evaluator.engine).__name__ == "VllmEngine"
        sent = _moved(3, seed=3)
        tampered = dict(sent)
        name = "model.norm.weight"
        tampered[name] = sent[name] + 1.0
        with pytest.raises(WeightsRefused, match=f"the evaluator in its worker: tensor '{name}'"):
            evaluator.evaluate(tampered, 3, _manifest(sent, 3))
        result = evaluator.evaluate(sent, 3, _manifest(sent, 3))
        assert result["version"] == 3 and result["n"] == 4
    finally:
        evaluator.engine.close()
