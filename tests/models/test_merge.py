"""`dorarl model merge`: a LoRA checkpoint into a HF folder equal to peft's merge_and_unload;
a resumed LoRA run's engines start from the same merge."""

import importlib.util
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from dorarl.cli import main
from dorarl.jobs.config import TrainConfig
from dorarl.jobs.engine_plan import model_folder
from dorarl.jobs.resume import ResumePoint
from dorarl.trainer import Trainer, TrainerConfig
from dorarl.trainer.config import LoraConfig

# The trainer tests' made-up groups (their conftest, by path: this folder has its own).
_spec = importlib.util.spec_from_file_location(
    "trainer_groups", Path(__file__).resolve().parents[1] / "trainer" / "conftest.py"
)
_groups = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_groups)
_make_groups = _groups._make_groups


@pytest.fixture(scope="module")
def lora_checkpoint(tiny_model_dir, tmp_path_factory) -> tuple[Trainer, Path]:
    config = TrainerConfig(lr=1e-2, lora=LoraConfig(rank=4, alpha=8.0))
    trainer = Trainer.from_pretrained(tiny_model_dir, config)
    for seed in range(2):
        trainer.train_step(_make_groups(seed, vocab=40))
    folder = tmp_path_factory.mktemp("run") / "version_00002"
    return trainer, trainer.save_checkpoint(folder, {})


def _assert_merged(folder: Path, trainer: Trainer) -> None:
    got = AutoModelForCausalLM.from_pretrained(folder, use_safetensors=True).state_dict()
    want = trainer.named_tensors()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-6, atol=1e-7, msg=name)
    assert (folder / "tokenizer.json").is_file()


def test_merge_writes_the_merged_model(lora_checkpoint, tiny_model_dir, tmp_path, capsys):
    trainer, checkpoint = lora_checkpoint
    out = tmp_path / "merged"
    assert main(["model", "merge", str(checkpoint), "--out", str(out)]) == 0
    _assert_merged(out, trainer)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    want = PeftModel.from_pretrained(base, checkpoint).merge_and_unload().state_dict()
    got = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_merge_refuses_a_full_weight_checkpoint(tiny_model_dir, tmp_path, capsys):
    assert main(["model", "merge", str(tiny_model_dir), "--out", str(tmp_path / "o")]) == 2
    assert "not a LoRA checkpoint (no adapter_config.json)" in capsys.readouterr().err


def test_a_resumed_lora_run_starts_its_engines_from_the_merge(lora_checkpoint):
    trainer, checkpoint = lora_checkpoint
    point = ResumePoint(folder=checkpoint, version=2)
    folder = Path(model_folder(TrainConfig(), point))
    assert folder == checkpoint / "merged"
    _assert_merged(folder, trainer)
    assert model_folder(TrainConfig(), point) == str(folder)  # written once, then reused
