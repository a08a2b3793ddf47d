"""Mixture-of-Experts models in the engine, against Hugging Face's own forward: Qwen3-MoE (top-k
renormalised), Qwen2-MoE (a gated shared expert, a dense layer among sparse ones) and
Mixtral (softmax over the top-2). Block sizes 7 and 32 with chunked prefill, migration
between engines of different block sizes, offload, in-place weight loads, checkpoint folders,
and the recorded routes (each sampled token's expert ids) against HF's router."""

import pickle

import pytest
import torch
from engine_testlib import (
    FAMILIES,
    MOE_ARCHS,
    greedy,
    make_engine,
    prompts,
    run_all,
    run_alone,
    seeded,
    tiny_config,
    tiny_model,
)

from dorarl.config import ConfigError
from dorarl.engine import Engine, EngineConfig, RequestOutput, SamplingParams
from dorarl.engine.linear import onednn_works
from dorarl.engine.model_spec import spec_from_hf
from dorarl.errors import UserInputError

TOP_K = 2


def _hf(model, prompt: list[int], output: list[int]):
    """Teacher-forced logprobs of `output` and the experts HF routed each position to."""
    with torch.no_grad():
        res = model(torch.tensor([prompt + output]), output_router_logits=True)
    logp = torch.log_softmax(res.logits[0, len(prompt) - 1 : -1].float(), dim=-1)
    top_k = model.config.num_experts_per_tok
    experts = [
        torch.softmax(logits.float(), -1).topk(top_k, -1).indices[len(prompt) - 1 : -1]
        for logits in res.router_logits
    ]
    return logp, experts


def _routes(engine: Engine, out: RequestOutput) -> torch.Tensor:
    """The output's recorded routes as `[tokens, sparse layers, top_k]` int64 (-1: none)."""
    m = engine.spec.moe
    dtype = torch.uint8 if m.num_experts < 255 else torch.int16
    flat = torch.frombuffer(bytearray(out.routes), dtype=dtype).long()
    flat[flat == (255 if dtype == torch.uint8 else -1)] = -1
    return flat.view(len(out.output_ids), len(m.sparse_layers), m.top_k)


def _assert_matches_hf(model, engine: Engine, prompt: list[int], out: RequestOutput) -> None:
    logp, experts = _hf(model, prompt, out.output_ids)
    assert out.output_ids == logp.argmax(-1).tolist()
    want = logp.gather(1, torch.tensor(out.output_ids)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(out.logprobs), want, atol=1e-4, rtol=0)
    routes = _routes(engine, out)
    for j, layer in enumerate(engine.spec.moe.sparse_layers):
        assert torch.equal(routes[:, j], experts[j]), f"layer {layer}"


@pytest.mark.parametrize("block_size", [7, 32])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_greedy_tokens_logprobs_and_routes_match_hf(arch, block_size):
    model = tiny_model(arch, seed=1)
    engine = make_engine(
        model, block_size=block_size, prefill_chunk_size=5, max_num_seqs=3, record_routes=True
    )
    batch = prompts([3, 17, 9, 40, 1], seed=2)
    for i, p in enumerate(batch):
        engine.add_request(f"r{i}", p, greedy(12 + 3 * i))
    outs = run_all(engine)
    for i, p in enumerate(batch):
        _assert_matches_hf(model, engine, p, outs[f"r{i}"])


def test_qwen2_moe_has_a_dense_layer_and_a_shared_expert():
    spec = spec_from_hf(tiny_model("qwen2_moe", seed=1).config)
    assert spec.moe.sparse_layers == (0,) and spec.moe.shared_expert_size == 48
    assert not spec.moe.norm_topk and "model.layers.1.mlp.gate_proj.weight" in spec.weight_shapes()
    assert spec_from_hf(tiny_model("mixtral", seed=1).config).moe.norm_topk


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_migration_with_kv_and_routes_between_block_sizes_is_exact(arch):
    model = tiny_model(arch, seed=1)
    prompt = prompts([19], seed=5)[0]
    params = seeded(24, seed=7, top_p=0.9)
    want = run_alone(model, prompt, params, record_routes=True)
    a = make_engine(model, block_size=7, record_routes=True)
    b = make_engine(model, block_size=32, record_routes=True)
    for i, p in enumerate(prompts([4, 11, 6], seed=1)):
        (a if i % 2 else b).add_request(f"n{i}", p, seeded(9 + 4 * i, seed=i))
    a.add_request("x", prompt, params)
    while a.progress("x") < 10:
        a.step()
    snap = pickle.loads(pickle.dumps(a.export_request("x")))
    assert snap.kv is not None and len(snap.routes) == 10 * TOP_K * len(a.spec.moe.sparse_layers)
    b.import_request(snap)
    got = run_all(b)["x"]
    assert got.output_ids == want.output_ids and got.routes == want.routes
    torch.testing.assert_close(
        torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0
    )
    run_all(a)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_offload_restore_and_resume_continue_exactly(arch):
    model = tiny_model(arch, seed=1)
    prompt = prompts([10], seed=6)[0]
    want = run_alone(model, prompt, greedy(20), record_routes=True)
    engine = make_engine(model, host_blocks=64, record_routes=True)
    engine.add_request("x", prompt, greedy(20))
    while engine.progress("x") < 6:
        engine.step()
    assert engine.offload("x")
    while engine.progress("x") < 12:
        engine.step()
    resumed = make_engine(model, prefill_chunk_size=4, record_routes=True)
    resumed.resume_request(engine.abort("x"))  # re-prefill in chunks, routes kept
    got = run_all(resumed)["x"]
    assert got.output_ids == want.output_ids and got.routes == want.routes
    assert got.offloads == 1 and got.reprefill_tokens == 10 + 12 - 1


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_weights_load_in_place_and_round_trip_by_hf_name(arch):
    old, new = tiny_model(arch, seed=1), tiny_model(arch, seed=2)
    engine = make_engine(old)
    before = {name: t.data_ptr() for name, t in engine.state_dict().items()}
    engine.load_weights(new.state_dict(), version=1)
    ours = engine.state_dict()
    assert {name: t.data_ptr() for name, t in ours.items()} == before  # the same storage
    for name, tensor in new.state_dict().items():
        tied_alias = name == "lm_head.weight" and new.config.tie_word_embeddings
        assert torch.equal(ours["model.embed_tokens.weight" if tied_alias else name], tensor)
    prompt = prompts([8], seed=3)[0]
    engine.add_request("x", prompt, greedy(12))
    assert run_all(engine)["x"].output_ids == run_alone(new, prompt, greedy(12)).output_ids


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_a_saved_folder_with_one_tensor_per_expert_loads(tmp_path, arch):
    model = tiny_model(arch, seed=1)
    model.save_pretrained(tmp_path)
    engine = Engine.from_pretrained(tmp_path, EngineConfig(max_num_seqs=2, max_model_len=128))
    ours = engine.state_dict()
    for name, tensor in model.state_dict().items():
        if name in ours:
            assert torch.equal(ours[name], tensor), name
    prompt = prompts([7], seed=4)[0]
    engine.add_request("x", prompt, greedy(10))
    assert run_all(engine)["x"].output_ids == run_alone(model, prompt, greedy(10)).output_ids


def test_a_folder_missing_an_expert_is_refused_in_one_line(tmp_path):
    from safetensors.torch import load_file, save_file

    model = tiny_model("qwen3_moe", seed=1)
    model.save_pretrained(tmp_path)
    named = load_file(str(tmp_path / "model.safetensors"))
    del named["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(named, str(tmp_path / "model.safetensors"))
    with pytest.raises(UserInputError, match=r"experts\.5\.up_proj"):
        Engine.from_pretrained(tmp_path, EngineConfig(max_num_seqs=2, max_model_len=128))


@pytest.mark.skipif(not onednn_works(), reason="no oneDNN in this torch build")
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_on_onednn_a_request_is_bit_identical_whatever_shares_its_experts(arch):
    model = tiny_model(arch, seed=1)
    prompt = prompts([11], seed=5)[0]
    alone = run_alone(model, prompt, seeded(16, seed=3), prefill_chunk_size=128)
    engine = make_engine(model, prefill_chunk_size=128)
    for i, p in enumerate(prompts([3, 17, 30, 6], seed=9)):
        engine.add_request(f"n{i}", p, seeded(5 + 7 * i, seed=i))
    engine.add_request("x", prompt, seeded(16, seed=3))
    got = run_all(engine)["x"]
    assert got.output_ids == alone.output_ids and got.logprobs == alone.logprobs


@pytest.mark.skipif(not onednn_works(), reason="no oneDNN in this torch build")
def test_grouped_mm_and_per_expert_products_agree():
    model = tiny_model("qwen2_moe", seed=1)
    prompt = prompts([14], seed=6)[0]
    a = run_alone(model, prompt, greedy(16), linear_kernel="onednn", record_routes=True)
    b = run_alone(model, prompt, greedy(16), linear_kernel="torch", record_routes=True)
    assert a.output_ids == b.output_ids and a.routes == b.routes
    torch.testing.assert_close(
        torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0
    )


def test_observations_have_no_route_and_dense_models_record_none():
    model = tiny_model("mixtral", seed=1)
    engine = make_engine(model, record_routes=True)
    params = SamplingParams(temperature=0.0, max_new_tokens=4, stop_token_ids=[], multi_turn=True)
    engine.add_request("x", prompts([5], seed=7)[0], params)
    while not engine.step():
        pass
    assert engine.continue_request("x", [3, 4, 5])
    while not engine.step():
        pass
    routes = _routes(engine, engine.end_request("x"))
    assert (routes[4:7] == -1).all() and (routes[:4] >= 0).all() and (routes[7:] >= 0).all()
    dense = make_engine(tiny_model("qwen2", seed=1), record_routes=True)
    dense.add_request("y", [1, 2, 3], greedy(3))
    assert run_all(dense)["y"].routes == b""


def test_decode_graphs_are_refused_for_expert_layers():
    config = EngineConfig(device="cpu", max_num_seqs=2, max_model_len=64)
    config.cuda_graphs = "on"  # as a cuda config would hold it; refused before any device use
    with pytest.raises(ConfigError, match="engine.cuda_graphs: on is not supported"):
        Engine.from_hf_config(tiny_config("mixtral"), config)


def test_a_sliding_window_moe_and_unknown_types_are_refused_by_name():
    config = FAMILIES["mixtral"][0](**{**tiny_config("mixtral").to_dict(), "sliding_window": 64})
    with pytest.raises(UserInputError, match="sliding_window 64 is not supported"):
        spec_from_hf(config)
    config.model_type = "deepseek_v3"
    with pytest.raises(UserInputError, match="model_type 'deepseek_v3' is not supported"):
        spec_from_hf(config)
