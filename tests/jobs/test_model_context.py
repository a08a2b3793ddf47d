"""`engine.max_model_len` left unset follows the model folder (its max_position_embeddings,
capped by the engines' device); the shipped base models keep 256, a given value is kept."""

import json

import pytest

from dorarl.jobs.model_context import context_line, model_context
from dorarl.jobs.run_folder import load_run_config
from dorarl.tasks.assets import MOE_BASE_DIR


def _folder(tmp_path, positions):
    folder = tmp_path / f"model_{positions}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": positions}))
    return folder


def test_a_model_folder_gets_its_own_context_capped_by_the_device(tmp_path):
    long = _folder(tmp_path, 32768)
    assert load_run_config(None, [f"model={long}"]).engine.max_model_len == 2048
    on_gpu = load_run_config(None, [f"model={long}", "engine.device=cuda"])
    assert on_gpu.engine.max_model_len == 8192
    short = _folder(tmp_path, 1024)
    assert load_run_config(None, [f"model={short}"]).engine.max_model_len == 1024
    blocks = load_run_config(None, [f"model={long}", "engine.num_blocks=64"])
    assert blocks.engine.max_model_len == 64 * blocks.engine.block_size  # the pool holds one


@pytest.mark.parametrize("model", [None, MOE_BASE_DIR])
def test_the_shipped_base_models_keep_256(model):
    overrides = [] if model is None else [f"model={model}"]
    assert load_run_config(None, overrides).engine.max_model_len == 256


def test_a_given_context_is_kept_from_the_command_line_or_the_config_file(tmp_path):
    long = _folder(tmp_path, 32768)
    given = load_run_config(None, [f"model={long}", "engine.max_model_len=300"])
    assert given.engine.max_model_len == 300
    file = tmp_path / "run.yaml"
    file.write_text(f"model: {long}\nengine:\n  max_model_len: 320\n")
    assert load_run_config(str(file), []).engine.max_model_len == 320
    file.write_text(f"model: {long}\nsteps: 3\n")
    assert load_run_config(str(file), []).engine.max_model_len == 2048


def test_the_start_line_names_the_key_and_an_unreadable_folder_gets_the_cap(tmp_path):
    config = load_run_config(None, [f"model={_folder(tmp_path, 4096)}"])
    assert context_line(config).startswith("engine.max_model_len: 2048 tokens")
    assert "engine.max_model_len=N sets another" in context_line(config)
    assert context_line(load_run_config(None, [])) is None
    assert model_context(tmp_path / "missing", "cpu") == 2048
