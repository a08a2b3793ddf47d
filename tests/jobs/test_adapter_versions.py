"""A LoRA run on engines that hold adapters (trainer.lora.rank > 0, engine.max_versions > 1):
its versions travel as adapters, its engines and evaluator start on the base (version 0)
whether it starts or resumes, and what an engine slot cannot take is refused up front."""

import json
import re

import pytest

from dorarl.config import ConfigError, load_config
from dorarl.jobs.config import TrainConfig
from dorarl.jobs.engine_plan import engines_start_at, model_folder
from dorarl.jobs.resume import ResumePoint

ADAPTERS = ["trainer.lora.rank=8", "engine.max_versions=2", "engine.prefix_cache=off"]


def _config(*overrides: str) -> TrainConfig:
    return load_config(TrainConfig, overrides=list(overrides))


@pytest.fixture
def lora_checkpoint(tmp_path, tiny_model_dir) -> ResumePoint:
    """A LoRA checkpoint folder as far as the run's start reads it: its adapter config."""
    folder = tmp_path / "version_00005"
    folder.mkdir()
    config = {"base_model_name_or_path": str(tiny_model_dir), "r": 8, "lora_alpha": 16}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return ResumePoint(folder, 5)


def test_versions_travel_as_adapters_only_with_lora_on_engines_holding_adapters():
    assert _config(*ADAPTERS).adapter_versions
    assert not _config("trainer.lora.rank=8").adapter_versions  # merged full weights
    assert not _config("engine.max_versions=2", "engine.prefix_cache=off").adapter_versions
    spec = _config(*ADAPTERS).weights.spec("cpu", "cpu", "auto", adapters=True)
    assert spec.adapters and spec.kind == "collective"


def test_a_resumed_run_starts_its_engines_on_the_base(lora_checkpoint, tiny_model_dir):
    config = _config(*ADAPTERS)
    assert model_folder(config, lora_checkpoint) == str(tiny_model_dir)
    assert engines_start_at(config, lora_checkpoint) == 0  # the adapter of v5 comes later
    assert not (lora_checkpoint.folder / "merged").exists()
    full = _config(f"model={tiny_model_dir}")
    assert engines_start_at(full, ResumePoint(tiny_model_dir, 5)) == 5
    assert engines_start_at(config, None) == 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.lora.rank=128"], "trainer.lora.rank: 128 is over engine.max_lora_rank=64"),
        (
            ["trainer.lora.target_modules=[q_proj,fc1]"],
            "trainer.lora.target_modules: the engines hold adapters of ",
        ),
    ],
)
def test_what_an_engine_slot_cannot_take_is_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        _config(*ADAPTERS, *overrides)
    _config("trainer.lora.rank=8", *overrides)  # merged full weights take them
