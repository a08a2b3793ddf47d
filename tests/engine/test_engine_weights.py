"""Loading from a folder, versioned weight swaps, and per-token version tags."""

import json

import pytest
import torch
from engine_testlib import (
    MOE_ARCHS,
    greedy,
    make_engine,
    prompts,
    run_all,
    run_alone,
    tiny_config,
    tiny_model,
)

from dorarl.engine import Engine, EngineConfig
from dorarl.engine.model_spec import spec_from_hf
from dorarl.engine.weights import from_checkpoint, load_folder, to_checkpoint
from dorarl.errors import UserInputError


@pytest.mark.parametrize(
    "variant",
    ["qwen2", "qwen2-tied", "llama-tied-bias-llama3rope", "qwen3", "qwen3-tied-bias-headdim16"],
)
def test_from_pretrained_folder_matches_the_in_memory_model(tmp_path, variant):
    model = tiny_model(variant, seed=1)
    model.save_pretrained(tmp_path)
    assert list(tmp_path.glob("*.safetensors"))
    engine = Engine.from_pretrained(
        tmp_path, EngineConfig(max_num_seqs=4, max_model_len=128, block_size=4)
    )
    prompt = prompts([7], seed=51)[0]
    engine.add_request("x", prompt, greedy(15))
    assert run_all(engine)["x"].output_ids == run_alone(model, prompt, greedy(15)).output_ids


@pytest.mark.parametrize("variant", ["qwen2", "llama", "qwen3", "qwen3-tied-bias-headdim16"])
def test_load_weights_swaps_version_and_model(variant):
    old, new = tiny_model(variant, seed=1), tiny_model(variant, seed=2)
    engine = make_engine(old, version=0)
    engine.load_weights(new.state_dict(), version=1)
    assert engine.version == 1
    prompt = prompts([6], seed=52)[0]
    engine.add_request("x", prompt, greedy(12))
    out = run_all(engine)["x"]
    want = run_alone(new, prompt, greedy(12))
    assert out.output_ids == want.output_ids and out.versions == [1] * 12
    ours = engine.state_dict()
    for name, tensor in new.state_dict().items():
        tied_alias = name == "lm_head.weight" and new.config.tie_word_embeddings
        assert torch.equal(ours["model.embed_tokens.weight" if tied_alias else name], tensor)


def test_tokens_after_a_swap_carry_the_new_version():
    old, new = tiny_model("llama", seed=1), tiny_model("llama", seed=2)
    engine = make_engine(old, version=0)
    engine.add_request("x", prompts([5], seed=53)[0], greedy(10))
    for _ in range(4):
        engine.step()
    engine.load_weights(new.state_dict(), version=1)
    out = run_all(engine)["x"]
    assert out.versions == [0] * 4 + [1] * 6


def test_peer_serves_weights_to_another_engine():
    a, b = (
        make_engine(tiny_model("qwen2", seed=2), version=7),
        make_engine(tiny_model("qwen2", seed=1)),
    )
    b.load_weights(a.state_dict(), version=a.version)
    a.add_request("x", [1, 2, 3], greedy(6))
    a.step()
    b.import_request(a.export_request("x"))  # same version now: KV reuse is allowed
    assert run_all(b)["x"].versions == [7] * 6


def test_tied_alias_is_accepted_but_must_match():
    model = tiny_model("llama-tied-bias-llama3rope", seed=1)
    engine = make_engine(model)
    named = dict(model.state_dict())
    assert "lm_head.weight" in named  # HF lists the tied alias
    engine.load_weights(named, version=1)
    named["lm_head.weight"] = torch.zeros(3, 3)
    with pytest.raises(UserInputError, match="lm_head.weight"):
        engine.load_weights(named, version=2)
    assert engine.version == 1


def test_random_init_is_seeded():
    config = tiny_model("llama", seed=1).config
    cfg = EngineConfig(max_num_seqs=2, max_model_len=64, block_size=4)
    a, b = Engine.from_hf_config(config, cfg, seed=3), Engine.from_hf_config(config, cfg, seed=3)
    c = Engine.from_hf_config(config, cfg, seed=4)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(a.state_dict()[name], b.state_dict()[name])
    assert not torch.equal(a.state_dict()[name], c.state_dict()[name])


def test_bfloat16_engine_runs():
    model = tiny_model("qwen2", seed=1)
    engine = make_engine(model, dtype="bfloat16")
    engine.add_request("x", prompts([9], seed=54)[0], greedy(8))
    out = run_all(engine)["x"]
    assert len(out.output_ids) == 8 and all(lp <= 0.0 for lp in out.logprobs)
    assert engine.state_dict()["model.norm.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
            "rope_type 'dynamic'",
        ),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    ],
)
def test_unsupported_settings_are_named(overrides, message):
    config = tiny_config("llama", **overrides)
    with pytest.raises(UserInputError, match=message):
        Engine.from_hf_config(config, EngineConfig(max_model_len=64))


def test_sliding_window_qwen2_is_refused():
    config = tiny_config("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=0)
    with pytest.raises(UserInputError, match="sliding-window"):
        Engine.from_hf_config(config, EngineConfig(max_model_len=64))


def test_only_the_model_weight_files_are_weights(tmp_path):
    from safetensors.torch import save_file

    from dorarl.engine.weights import weight_files

    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    save_file({"state.w.exp_avg": torch.zeros(2)}, str(tmp_path / "optimizer.safetensors"))
    assert weight_files(tmp_path) == [tmp_path / "model.safetensors"]
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        save_file({name: torch.zeros(1)}, str(sharded / name))
    save_file({"x": torch.zeros(1)}, str(sharded / "rng.safetensors"))
    assert [p.name for p in weight_files(sharded)] == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    ]  # fmt: skip
    index = {"weight_map": {"a": "model-00002-of-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    assert [p.name for p in weight_files(sharded)] == ["model-00002-of-00002.safetensors"]


def test_a_load_goes_into_the_live_weights_and_never_into_the_callers_tensors():
    old, new = tiny_model("qwen2", seed=1), tiny_model("qwen2", seed=2)
    before = {n: t.clone() for n, t in old.state_dict().items()}
    engine = make_engine(old)
    live = {n: t.data_ptr() for n, t in engine.state_dict().items()}
    engine.load_weights(new.state_dict(), version=1)
    assert {n: t.data_ptr() for n, t in engine.state_dict().items()} == live  # in place
    assert all(torch.equal(t, before[n]) for n, t in old.state_dict().items())  # not aliased


def test_a_wrong_shaped_tensor_is_refused_in_one_line_leaving_the_weights_whole():
    old, new = tiny_model("qwen2", seed=1), tiny_model("qwen2", seed=2)
    engine = make_engine(old, version=3)
    prompt = prompts([6], seed=55)[0]
    engine.add_request("before", prompt, greedy(10))
    want = run_all(engine)["before"].output_ids
    kept = {n: t.clone() for n, t in engine.state_dict().items()}
    named = dict(new.state_dict())
    last = "model.norm.weight"  # copied last: every other tensor would be in place already
    named[last] = torch.ones(named[last].shape[0] + 1)
    with pytest.raises(UserInputError, match=r"tensor 'model.norm.weight' has shape") as refused:
        engine.load_weights(named, version=4)
    assert "\n" not in str(refused.value) and engine.version == 3
    assert all(torch.equal(t, kept[n]) for n, t in engine.state_dict().items())
    engine.add_request("after", prompt, greedy(10))
    assert run_all(engine)["after"].output_ids == want


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_weights_in_a_checkpoints_layout_are_what_save_pretrained_writes(tmp_path, arch):
    """`to_checkpoint`: the in-memory (trainer's) names as a folder holds them, one module
    per expert (what vLLM reloads), and `from_checkpoint` takes them back."""
    model = tiny_model(arch)
    model.save_pretrained(str(tmp_path))
    saved = load_folder(tmp_path)
    named = dict(model.state_dict())
    laid_out = to_checkpoint(model.config.model_type, named)
    assert sorted(laid_out) == sorted(saved)
    assert all(torch.equal(laid_out[n], saved[n]) for n in saved)
    spec = spec_from_hf(model.config)
    back = from_checkpoint(spec, laid_out)
    assert sorted(back) == sorted(named) and all(torch.equal(back[n], named[n]) for n in named)
    dense = dict(tiny_model("llama").state_dict())
    assert to_checkpoint("llama", dense) is dense
