"""Bad input raises a clear UserInputError and the engine keeps serving the others."""

import json

import numpy as np
import pytest
import torch
from engine_testlib import greedy, make_engine, prompts, run_all, run_alone, tiny_model

from dorarl.config import ConfigError
from dorarl.engine import Engine, EngineConfig, SamplingParams
from dorarl.errors import UserInputError


def _engine_with_two_requests(**cfg):
    model = tiny_model("qwen2", seed=1)
    engine = make_engine(model, **cfg)
    batch = prompts([5, 9], seed=31)
    for i, p in enumerate(batch):
        engine.add_request(f"ok{i}", p, greedy(12))
    engine.step()
    return model, engine, batch


def _assert_others_finish_correctly(model, engine, batch):
    outs = run_all(engine)
    for i, p in enumerate(batch):
        assert outs[f"ok{i}"].output_ids == run_alone(model, p, greedy(12)).output_ids


def test_prompt_over_the_context_limit():
    model, engine, batch = _engine_with_two_requests(max_model_len=64)
    with pytest.raises(
        UserInputError, match=r"request 'long': prompt has 64 tokens, max_model_len is 64"
    ) as info:
        engine.add_request("long", [1] * 64, greedy(4))
    assert "engine.max_model_len" in str(info.value)
    with pytest.raises(
        UserInputError, match=r"'forced'.*10 \+ target_len 60 tokens exceeds max_model_len 64"
    ) as info:
        engine.add_request("forced", [1] * 10, SamplingParams(target_len=60))
    assert "engine.max_model_len" in str(info.value)
    assert sorted(engine.request_ids()) == ["ok0", "ok1"]
    _assert_others_finish_correctly(model, engine, batch)


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], greedy(4), "empty prompt"),
        ([1, 500], greedy(4), "token id 500 is outside the vocabulary"),
        ([1, 2], SamplingParams(temperature=-1.0), "temperature must be >= 0"),
        ([1, 2], SamplingParams(top_p=0.0), "top_p must be in"),
        ([1, 2], SamplingParams(max_new_tokens=0), "max_new_tokens must be > 0"),
    ],
)
def test_bad_requests_are_refused(prompt, params, message):
    model, engine, batch = _engine_with_two_requests()
    with pytest.raises(UserInputError, match=message):
        engine.add_request("bad", prompt, params)
    _assert_others_finish_correctly(model, engine, batch)


@pytest.mark.parametrize(
    "bad", [6.7, 6.0, True, None, "7", b"7", np.float64(6.0), torch.tensor(6.0), [6]]
)
def test_a_non_integer_token_id_is_refused_naming_request_and_position(bad):
    model, engine, batch = _engine_with_two_requests()
    with pytest.raises(UserInputError, match=r"request 'bad': prompt token at position 2 is ") as e:
        engine.add_request("bad", [1, 2, bad, 3], greedy(4))
    assert "\n" not in str(e.value) and "not an integer token id" in str(e.value)
    with pytest.raises(UserInputError, match=r"'bad': sampling.stop_token_ids token at position 1"):
        engine.add_request("bad", [1, 2], SamplingParams(stop_token_ids=[5, bad]))
    assert sorted(engine.request_ids()) == ["ok0", "ok1"]
    _assert_others_finish_correctly(model, engine, batch)


@pytest.mark.parametrize("prompt", [None, "1 2 3", 7])
def test_a_prompt_that_is_not_a_list_is_refused(prompt):
    _, engine, _ = _engine_with_two_requests()
    with pytest.raises(UserInputError, match=r"'bad': prompt must be a list of token ids"):
        engine.add_request("bad", prompt, greedy(4))


def test_integer_scalars_of_numpy_and_torch_are_token_ids():
    model, engine, batch = _engine_with_two_requests()
    ids = [1, np.int64(5), np.int32(9), torch.tensor(3)]
    engine.add_request("np", ids, greedy(6))
    out = run_all(engine)["np"]
    assert out.output_ids == run_alone(model, [1, 5, 9, 3], greedy(6)).output_ids


def test_a_snapshot_with_a_non_integer_output_id_is_refused():
    model, engine, _ = _engine_with_two_requests()
    other = make_engine(model)
    other.add_request("x", [1, 2, 3], greedy(8))
    other.step()
    other.step()
    snap = other.abort("x")
    snap.output_ids[-1] = float(snap.output_ids[-1])
    with pytest.raises(UserInputError, match=r"'x': output_ids token at position 1 is "):
        engine.resume_request(snap)
    assert "x" not in engine.request_ids()


def test_duplicate_request_id_is_refused():
    model, engine, batch = _engine_with_two_requests()
    with pytest.raises(
        UserInputError, match="'ok0': a request with this id is already in the engine"
    ):
        engine.add_request("ok0", [1, 2, 3], greedy(4))
    _assert_others_finish_correctly(model, engine, batch)


def test_weights_of_the_wrong_shape_keep_the_old_weights():
    model, engine, batch = _engine_with_two_requests()
    bad = dict(model.state_dict())
    bad["model.layers.1.mlp.up_proj.weight"] = torch.zeros(64, 64)
    with pytest.raises(
        UserInputError,
        match=r"'model.layers.1.mlp.up_proj.weight' has shape \(64, 64\).*\(128, 64\)",
    ):
        engine.load_weights(bad, version=1)
    missing = {k: v for k, v in model.state_dict().items() if "norm" not in k}
    with pytest.raises(UserInputError, match="missing"):
        engine.load_weights(missing, version=1)
    assert engine.version == 0
    _assert_others_finish_correctly(model, engine, batch)


def test_import_of_another_version_is_refused():
    model, engine, batch = _engine_with_two_requests()
    other = make_engine(model, version=5)
    other.add_request("x", [1, 2, 3], greedy(8))
    other.step()
    snap = other.export_request("x")
    with pytest.raises(
        UserInputError,
        match="'x': snapshot of version 5 cannot be imported into an engine of version 0",
    ):
        engine.import_request(snap)
    _assert_others_finish_correctly(model, engine, batch)


def test_unknown_model_type_names_the_type_and_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "hidden_size": 8}))
    with pytest.raises(UserInputError, match=r"config.json: model_type 'mamba' is not supported"):
        Engine.from_pretrained(tmp_path, EngineConfig(max_model_len=32))


def test_unknown_request_and_bad_engine_config():
    _, engine, _ = _engine_with_two_requests()
    with pytest.raises(UserInputError, match="'nope' is not in this engine"):
        engine.export_request("nope")
    with pytest.raises(ConfigError, match="engine.num_blocks"):
        EngineConfig(num_blocks=2, block_size=4, max_model_len=64)
    with pytest.raises(ConfigError, match="engine.offload_threshold"):
        EngineConfig(offload_threshold=0.0)
