"""Bad input raises a clear UserInputError and the engine keeps serving the others."""

import json

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
    ):
        engine.add_request("long", [1] * 64, greedy(4))
    with pytest.raises(
        UserInputError, match=r"'forced'.*10 \+ target_len 60 tokens exceeds max_model_len 64"
    ):
        engine.add_request("forced", [1] * 10, SamplingParams(target_len=60))
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
