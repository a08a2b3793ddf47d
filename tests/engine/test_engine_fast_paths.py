"""The engine on its GPU fast paths, run on the CPU: Triton attention (in Triton's
interpreter, which tests/conftest.py turns on where there is no GPU), the device sampler,
and the keys that choose them. The interpreter is slow: tiny models, few tokens."""

import dataclasses
import os
import pickle

import pytest
import torch
from engine_testlib import make_engine, prompts, run_all, seeded, tiny_model

from dorarl.config import ConfigError
from dorarl.engine import EngineConfig, SamplingParams
from dorarl.engine.backends import fit_to_model, resolve_backends
from dorarl.engine.cpu_kernels import load_kernels
from dorarl.engine.device_runner import DeviceRunner
from dorarl.engine.weights import random_named

pytest.importorskip("triton")
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter is not on"
)
FAST = dict(block_size=16, num_blocks=24, max_model_len=96, prefill_chunk_size=16)
MIXED = [
    seeded(5, seed=3),
    SamplingParams(temperature=0.0, max_new_tokens=5, stop_token_ids=[]),
    seeded(5, seed=4, top_p=0.8, top_k=20),
]


def _run(model, batch, **cfg):
    engine = make_engine(model, **{**FAST, **cfg})
    for i, (p, params) in enumerate(zip(batch, MIXED, strict=True)):
        engine.add_request(f"r{i}", p, params)
    return engine, run_all(engine)


def _same_tokens(got, want, atol: float) -> None:
    for rid, out in want.items():
        assert got[rid].output_ids == out.output_ids, rid
        torch.testing.assert_close(
            torch.tensor(got[rid].logprobs), torch.tensor(out.logprobs), atol=atol, rtol=0
        )


@needs_interpreter
def test_triton_attention_equals_the_torch_path():
    model = tiny_model("qwen2", seed=1)
    # 20 tokens prefill in two chunks (the second reads cached keys); decodes share steps.
    batch = prompts([20, 3, 9], seed=2)
    engine, got = _run(model, batch, attention="triton", sampler="host")
    assert isinstance(engine.runner, DeviceRunner) and engine.graphs is None
    _, want = _run(model, batch, attention="torch")
    _same_tokens(got, want, atol=1e-5)


@needs_interpreter
def test_triton_reads_shared_prefix_blocks_through_the_block_tables():
    """A group's samples on the prefix cache: the Triton kernels read the shared blocks
    through the same block tables, and match the torch path without the cache."""
    model = tiny_model("qwen2", seed=1)
    prompt = prompts([40], seed=7)[0]  # two full blocks of 16 and 8 tokens in a third
    got = {}
    for path, cache in (("triton", "on"), ("torch", "off")):
        engine = make_engine(model, **FAST, attention=path, sampler="host", prefix_cache=cache)
        for i in range(3):
            engine.add_request(f"s{i}", prompt, seeded(3, seed=i))
        got[path] = run_all(engine)
        if path == "triton":
            assert engine.stats().prefill_tokens == 40 + 2
    _same_tokens(got["triton"], got["torch"], atol=1e-5)


def test_device_sampler_equals_the_host_sampler_bit_for_bit():
    model = tiny_model("llama", seed=2)
    batch = prompts([7, 12, 4], seed=3)
    _, got = _run(model, batch, sampler="device")
    _, want = _run(model, batch, sampler="host")
    _same_tokens(got, want, atol=0.0)


@needs_interpreter
def test_migration_mid_sequence_continues_the_same_stream():
    """Counter-based seeds: the n-th draw is a hash of (seed, n), so a request moved to an
    engine of another block size, with other neighbours, samples what it would have."""
    model = tiny_model("qwen2", seed=1)
    prompt = prompts([11], seed=5)[0]
    params = seeded(8, seed=9, top_p=0.9)
    cfg = dict(FAST, attention="triton", sampler="device")
    alone = make_engine(model, **cfg)
    alone.add_request("x", prompt, params)
    want = run_all(alone)["x"]
    a, b = make_engine(model, **cfg), make_engine(model, **{**cfg, "block_size": 32})
    b.add_request("neighbour", prompts([5], seed=6)[0], seeded(6, seed=1))
    a.add_request("x", prompt, params)
    while a.progress("x") < 4:
        a.step()
    b.import_request(pickle.loads(pickle.dumps(a.export_request("x"))))
    got = run_all(b)["x"]
    assert got.output_ids == want.output_ids and got.migrations == 1
    torch.testing.assert_close(
        torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0
    )


def test_auto_resolves_todays_path_on_cpu_and_the_fast_one_on_cuda():
    cpu = resolve_backends(EngineConfig())
    # attention.py, its decode rows (and the RMSNorms) on the fused C++ kernels where they build
    attention = "cpp" if load_kernels() is not None else "torch"
    assert (cpu.attention, cpu.sampler, cpu.cuda_graphs, cpu.dtype) == (
        attention, "host", False, torch.float32,
    )  # fmt: skip
    assert not cpu.fast
    cuda = resolve_backends(EngineConfig(device="cuda"))  # resolving needs no GPU
    assert (cuda.attention, cuda.sampler, cuda.cuda_graphs, cuda.dtype) == (
        "triton", "device", True, torch.bfloat16,
    )  # fmt: skip
    off = resolve_backends(EngineConfig(device="cuda", cuda_graphs="off", dtype="float32"))
    assert not off.cuda_graphs and off.dtype == torch.float32


@pytest.mark.parametrize(
    ("settings", "key"),
    [
        (dict(cuda_graphs="on"), "engine.cuda_graphs"),
        (dict(device="cuda", attention="torch", cuda_graphs="on"), "engine.cuda_graphs"),
        (dict(attention="flash"), "engine.attention"),
        (dict(sampler="gpu"), "engine.sampler"),
        (dict(dtype="int8"), "engine.dtype"),
    ],
)
def test_bad_choices_are_refused_naming_the_key(settings, key):
    with pytest.raises(ConfigError, match=f"^{key}:"):
        EngineConfig(**settings)


@pytest.mark.parametrize("block_size", [24, 8])
@pytest.mark.parametrize("settings", [dict(attention="triton"), dict(cuda_graphs="on")])
def test_a_block_size_the_triton_kernels_cannot_take_is_refused_at_start(block_size, settings):
    with pytest.raises(ConfigError, match="^engine.block_size: engine.* needs a power of two"):
        EngineConfig(device="cuda", block_size=block_size, **settings)


def test_auto_on_cuda_takes_torch_for_a_block_size_or_head_dim_triton_cannot_run(caplog):
    odd = EngineConfig(device="cuda", block_size=24)
    b = resolve_backends(odd)
    assert (b.attention, b.cuda_graphs) == ("torch", False)
    assert sum("engine.block_size is 24: torch" in r.getMessage() for r in caplog.records) == 1
    fast = resolve_backends(EngineConfig(device="cuda"))
    b = fit_to_model(fast, EngineConfig(device="cuda"), 80, 2, "m/config.json")
    assert (b.attention, b.cuda_graphs) == ("torch", False)
    assert "m/config.json has 80: torch" in caplog.records[-1].getMessage()
    assert fit_to_model(fast, EngineConfig(device="cuda"), 64, 7).attention == "triton"


@pytest.mark.parametrize(("settings", "key"), [
    (dict(attention="triton"), "engine.attention"), (dict(cuda_graphs="on"), "engine.cuda_graphs"),
])  # fmt: skip
def test_an_explicit_fast_path_the_models_head_dim_rules_out_is_refused(settings, key):
    config = EngineConfig(device="cuda", **settings)
    with pytest.raises(ConfigError, match=f"^{key}: .* m/config.json has head_dim 80"):
        fit_to_model(resolve_backends(config), config, 80, 2, "m/config.json")


def test_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="^engine.attention: triton needs engine.device=cuda"):
        EngineConfig(attention="triton")


@needs_interpreter
def test_decode_graph_path_over_static_buffers_equals_the_torch_path(monkeypatch):
    """The graphs' wiring without a GPU: `cuda_graphs` forced on, `DecodeGraphs` runs the
    same forward over its static buffers eagerly (padding rows into the scratch block), and
    a new version goes into the live weights in place."""
    import dorarl.engine.engine as engine_module

    def forced(config):
        return dataclasses.replace(resolve_backends(config), attention="triton", cuda_graphs=True)

    monkeypatch.setattr(engine_module, "resolve_backends", forced)
    model = tiny_model("qwen2", seed=1)
    batch = prompts([20, 3, 9], seed=2)
    engine, got = _run(model, batch, max_num_seqs=4)  # buckets 1, 2, 4: 3 rows pad to 4
    assert engine.graphs is not None and engine.kv.pool.shape[2] == FAST["num_blocks"] + 1
    assert engine.kv.pool[:, :, -1].abs().sum() > 0  # padding rows wrote the scratch block
    monkeypatch.undo()
    _same_tokens(got, _run(model, batch, max_num_seqs=4)[1], atol=1e-5)
    monkeypatch.setattr(engine_module, "resolve_backends", forced)
    new = random_named(engine.spec, seed=3, std=0.1)
    embed = engine.model.weights.embed
    engine.load_weights(new, version=1)
    assert engine.model.weights.embed is embed  # copied into, not replaced
    for i, (p, params) in enumerate(zip(batch, MIXED, strict=True)):
        engine.add_request(f"r{i}", p, params)
    got = run_all(engine)
    monkeypatch.undo()
    reference = make_engine(model, **FAST, max_num_seqs=4)
    reference.load_weights(new, version=1)
    for i, (p, params) in enumerate(zip(batch, MIXED, strict=True)):
        reference.add_request(f"r{i}", p, params)
    _same_tokens(got, run_all(reference), atol=1e-5)


def test_bare_on_and_off_in_yaml_mean_on_and_off():
    """`engine.cuda_graphs=off` reaches the config as False (YAML 1.1): stored as "off"."""
    from dorarl.config import load_config
    from dorarl.jobs.config import TrainConfig

    assert load_config(TrainConfig, None, ["engine.cuda_graphs=off"]).engine.cuda_graphs == "off"
    with pytest.raises(ConfigError, match="engine.cuda_graphs: on needs engine.device=cuda"):
        load_config(TrainConfig, None, ["engine.cuda_graphs=on"])
    on = load_config(TrainConfig, None, ["engine.device=cuda", "engine.cuda_graphs=on"])
    assert on.engine.cuda_graphs == "on"
