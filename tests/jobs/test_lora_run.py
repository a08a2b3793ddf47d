"""`dorarl train trainer.lora.rank=8`: a LoRA run end to end on Ray, checkpointed as adapter
folders (resuming from one, and the engines' merged start, are tests/trainer/test_lora.py's
and tests/models/test_merge.py's: a second Ray run here would double the test's time); and
one whose engines hold adapters (engine.max_versions=2), resumed: its engines start on the
base and get the checkpoint's adapter from the trainer, nothing merged."""

import json

import pytest

from dorarl.jobs.train import main as train_main

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]
SMALL = ["instances=2", "tbs=2", "rbs=4", "group_size=2", "engine.max_num_seqs=4",
         "eval.max_prompts=4", "eval.every=0", "progress=false", "mode=dora", "K=1"]  # fmt: skip


def _train(*args: str) -> None:
    """`dorarl train ARGS` in this process (each run's own Ray; every wait in it is bounded)."""
    assert train_main(list(args)) == 0


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_lora_run_trains_and_checkpoints_adapters(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    lora = ["trainer.lora.rank=8", "trainer.lora.lr=1e-3", f"model={tiny_model_dir}", *SMALL]
    _train(*lora, "steps=3", "checkpoint_every=3", "--out", str(out))
    checkpoint = out / "checkpoints" / "version_00003"
    assert (checkpoint / "adapter_model.safetensors").is_file()
    assert not (checkpoint / "model.safetensors").exists()
    metrics = _lines(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert any(m["update_applied"] for m in metrics)

    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["version"] == 3 and state["lora_base_path"] == str(tiny_model_dir.resolve())
    assert json.loads((out / "summary.json").read_text())["dropped_total"] == 0


ADAPTERS = ["engine.max_versions=2", "engine.prefix_cache=off"]


def test_a_lora_run_on_engines_holding_adapters_resumes_with_adapters(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    lora = ["trainer.lora.rank=8", "trainer.lora.lr=1e-3", f"model={tiny_model_dir}", *SMALL]
    _train(*lora, *ADAPTERS, "steps=2", "checkpoint_every=2", "--out", str(out))
    checkpoint = out / "checkpoints" / "version_00002"
    assert (checkpoint / "adapter_model.safetensors").is_file()
    _train(*lora, *ADAPTERS, "steps=3", f"resume={out}", "--out", str(out))
    assert not (checkpoint / "merged").exists()  # the engines and the evaluator: the base
    metrics = _lines(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    # the resumed step trained samples whose tokens the engines tagged v2: v2's adapter
    behavior = [t["behavior_version"] for t in _lines(out / "trajectories.jsonl")]
    assert 2 in behavior and set(behavior) <= {0, 1, 2}
    evaluated = [e["version"] for e in _lines(out / "evaluations.jsonl")]
    assert sorted(evaluated) == [
        0,
        2,
        2,
        3,
    ]  # v2 as the resumed start: the checkpoint's adapter merged
    assert json.loads((out / "summary.json").read_text())["dropped_total"] == 0
