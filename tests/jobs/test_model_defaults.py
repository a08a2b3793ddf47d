"""`trainer.lr` left to the model: the shipped base keeps the rate it is tuned at, a model
folder gets a fine-tuning rate by its size, a resumed checkpoint its own; the choice is said
in one line and written into the config a run records."""

from __future__ import annotations

import json

import pytest

from dorarl.config import load_config
from dorarl.jobs.config import TrainConfig
from dorarl.jobs.model_defaults import default_lr, with_model_defaults
from dorarl.jobs.resume import ResumePoint
from dorarl.tasks.assets import BASE_MODEL_DIR, MULTITURN_BASE_DIR


def _llama_config(folder, hidden: int, layers: int):
    """A model folder's config.json alone (its size is read from it; no weights needed)."""
    folder.mkdir()
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32000,
        "hidden_size": hidden, "intermediate_size": hidden * 3, "num_hidden_layers": layers,
        "num_attention_heads": hidden // 128, "num_key_value_heads": hidden // 128,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "eos_token_id": 2,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_the_default_is_left_to_the_model():
    assert load_config(TrainConfig).trainer.lr is None
    assert load_config(TrainConfig, None, ["trainer.lr=3e-6"]).trainer.lr == 3e-6


@pytest.mark.parametrize("folder", [BASE_MODEL_DIR, MULTITURN_BASE_DIR])
def test_the_shipped_base_keeps_its_tuned_rate(folder):
    assert default_lr(str(folder), None).value == 2e-4


def test_a_model_folder_gets_a_fine_tuning_rate_by_its_size(tmp_path, tiny_model_dir):
    small = default_lr(str(tiny_model_dir), None)
    assert small.value == 1e-5
    assert small.line().startswith("trainer.lr: 1e-5 (the default for a model folder under 1B")
    assert "the shipped base's is 2e-4" in small.line()
    large = default_lr(str(_llama_config(tmp_path / "seven_b", 4096, 32)), None)
    assert large.value == 1e-6 and "7.24B here" in large.why


def test_a_resumed_checkpoint_keeps_the_rate_it_trained_at(tmp_path):
    folder = tmp_path / "version_00004"
    folder.mkdir()
    (folder / "trainer_state.json").write_text(json.dumps({"version": 4, "config": {"lr": 3e-5}}))
    chosen = default_lr(str(folder), ResumePoint(folder=folder, version=4))
    assert chosen.value == 3e-5 and "version_00004" in chosen.why


def test_a_run_records_the_rate_chosen_and_an_explicit_one_stays(tiny_model_dir):
    config, lines = with_model_defaults(load_config(TrainConfig), str(tiny_model_dir), None)
    assert config.trainer.lr == 1e-5 and len(lines) == 1 and lines[0].startswith("trainer.lr: ")
    assert config.trainer.temperature == config.sampling.temperature  # still derived
    given = load_config(TrainConfig, None, ["trainer.lr=2e-4"])
    assert with_model_defaults(given, str(tiny_model_dir), None) == (given, [])


def test_lora_adapters_get_ten_times_the_full_weight_rate_unless_given(tiny_model_dir):
    lora = load_config(TrainConfig, None, ["trainer.lora.rank=8"])
    config, lines = with_model_defaults(lora, str(tiny_model_dir), None)
    assert config.trainer.lora.lr == pytest.approx(1e-4) and config.trainer.lr == 1e-5
    assert len(lines) == 1 and lines[0].startswith("trainer.lora.lr: 1e-4 (10x the full-weight")
    given = load_config(TrainConfig, None, ["trainer.lora.rank=8", "trainer.lora.lr=3e-4"])
    config, lines = with_model_defaults(given, str(tiny_model_dir), None)
    assert config.trainer.lora.lr == 3e-4 and lines == []  # trainer.lr trains nothing: unsaid
