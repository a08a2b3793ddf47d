"""The engine on a GPU with its defaults there (Triton attention, device sampling, CUDA
graphs): exact against Hugging Face, graph replay equal to eager, weights of a new version
loaded in place under captured graphs, migration between two engines on one GPU. Skipped
where torch sees no GPU (`scripts/gpu_check_1.sh` runs them on one)."""

import copy
import pickle

import pytest
import torch
from engine_testlib import greedy, make_engine, prompts, run_all, seeded, tiny_model

from dorarl.engine import SamplingParams
from dorarl.engine.weights import random_named

pytestmark = pytest.mark.cuda
CUDA = dict(device="cuda", block_size=16, num_blocks=64, max_model_len=256, dtype="float32")


def _cuda_hf(variant: str, seed: int = 1):
    return copy.deepcopy(tiny_model(variant, seed=seed)).to("cuda")  # the cached one stays


def _hf_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    with torch.no_grad():
        ids = torch.tensor([prompt + output], device="cuda")
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).cpu()


def _mixed(engine, batch, params) -> dict:
    for i, (p, sp) in enumerate(zip(batch, params, strict=True)):
        engine.add_request(f"r{i}", p, sp)
    return run_all(engine)


def _assert_same(got: dict, want: dict, atol: float) -> None:
    for rid, out in want.items():
        assert got[rid].output_ids == out.output_ids, rid
        torch.testing.assert_close(
            torch.tensor(got[rid].logprobs), torch.tensor(out.logprobs), atol=atol, rtol=0
        )


def test_defaults_on_cuda_are_the_fast_paths():
    engine = make_engine(_cuda_hf("qwen2"), **{**CUDA, "dtype": "auto"})
    b = engine.backends
    assert (b.attention, b.sampler, b.cuda_graphs, b.dtype) == (
        "triton", "device", True, torch.bfloat16,
    )  # fmt: skip
    assert engine.graphs is not None and engine.graphs.graphs  # captured at start
    setup = engine.setup()  # the Triton and graph start-up checks passed on this GPU
    assert setup.fast_path_fallbacks == [] and setup.attention == "triton" and setup.cuda_graphs


def test_an_unset_pool_is_sized_from_the_memory_share_and_start_up_stays_within_it():
    """No num_blocks: the pool is what 0.05 of this GPU holds after weights and workspace
    (at most what 64 sequences of 4k tokens use), and torch's peak allocation by the end of
    start-up (weights, pool, the graphs' private pool, the checks) stays within the plan."""
    torch.cuda.reset_peak_memory_stats()
    config = dict(device="cuda", max_num_seqs=64, max_model_len=4096, gpu_memory_share=0.05)
    engine = make_engine(_cuda_hf("qwen2"), **{**config, "num_blocks": None})
    plan = engine.kv_plan
    assert plan is not None and engine.kv_blocks == plan.blocks <= engine.config.kv_blocks
    assert engine.setup().kv_budget.startswith(f"KV {plan.blocks} blocks")
    pool = engine.kv.pool.numel() * engine.kv.pool.element_size()
    assert torch.cuda.max_memory_allocated() <= plan.weight_bytes + pool + plan.workspace.allocated
    engine.add_request("a", prompts([30], seed=1)[0], greedy(8))
    assert len(run_all(engine)["a"].output_ids) == 8


@pytest.mark.parametrize("variant", ["qwen2", "llama-tied-bias-llama3rope", "qwen3"])
def test_greedy_tokens_and_logprobs_match_hf_on_cuda(variant):
    model = _cuda_hf(variant)
    engine = make_engine(model, **{**CUDA, "prefill_chunk_size": 8, "max_num_seqs": 4})
    batch = prompts([3, 17, 9, 30, 1, 12], seed=2)
    outs = _mixed(engine, batch, [greedy(10 + 3 * i) for i in range(len(batch))])
    for i, p in enumerate(batch):
        out = outs[f"r{i}"]
        ref = _hf_logprobs(model, p, out.output_ids)
        assert out.output_ids == ref.argmax(-1).tolist(), f"request {i}"
        want = ref.gather(1, torch.tensor(out.output_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(out.logprobs), want, atol=1e-4, rtol=0)


def test_bf16_logprobs_stay_close_to_hf_float32():
    model = _cuda_hf("qwen2")
    engine = make_engine(model, **{**CUDA, "dtype": "bfloat16"})
    batch = prompts([5, 40, 12], seed=4)
    outs = _mixed(engine, batch, [seeded(24, seed=i) for i in range(3)])
    for i, p in enumerate(batch):
        out = outs[f"r{i}"]
        ref = _hf_logprobs(model, p, out.output_ids)
        want = ref.gather(1, torch.tensor(out.output_ids)[:, None]).squeeze(1)
        assert (torch.tensor(out.logprobs) - want).abs().mean() < 0.05, f"request {i}"


def test_graph_replay_equals_eager():
    model = _cuda_hf("llama")
    batch = prompts([4, 9, 23, 2, 15], seed=5)
    params = [
        seeded(20, seed=1),
        greedy(12),
        seeded(30, seed=2, top_p=0.9),
        seeded(8, seed=3, top_k=10),
        SamplingParams(temperature=0.7, max_new_tokens=25, stop_token_ids=[], seed=4),
    ]
    graphed = make_engine(model, **{**CUDA, "cuda_graphs": "on"})
    assert graphed.graphs is not None and graphed.graphs.graphs
    eager = make_engine(model, **{**CUDA, "cuda_graphs": "off"})
    assert eager.graphs is None
    _assert_same(_mixed(graphed, batch, params), _mixed(eager, batch, params), atol=1e-4)


def test_weights_loaded_in_place_keep_the_graphs_right():
    """A new version copied into the live storage: the captured graphs then compute with
    it, exactly as an engine built from that version does."""
    model = _cuda_hf("qwen2")
    batch = prompts([6, 13], seed=6)
    params = [greedy(16), seeded(16, seed=5)]
    live = make_engine(model, **CUDA)
    before = {k: v.clone() for k, v in live.state_dict().items()}
    _mixed(live, batch, params)
    new = random_named(live.spec, seed=9, std=0.05)
    addresses = [t.data_ptr() for t in live.state_dict().values()]
    live.load_weights(new, version=1)
    assert [t.data_ptr() for t in live.state_dict().values()] == addresses
    fresh = make_engine(model, **CUDA)
    fresh.load_weights(new, version=1)
    reference = make_engine(model, **{**CUDA, "cuda_graphs": "off"})
    reference.load_weights(new, version=1)
    want = _mixed(reference, batch, params)
    _assert_same(_mixed(live, batch, params), want, atol=1e-4)
    _assert_same(_mixed(fresh, batch, params), want, atol=1e-4)
    for name, tensor in model.state_dict().items():  # the caller's tensors never written
        if name in before:
            torch.testing.assert_close(tensor, before[name].to(tensor.dtype), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_migration_between_two_engines_on_one_gpu(dtype):
    """Bit for bit, block size changed. The request runs alone on every engine: on cuda a
    row's products may depend on how many rows share the step (cuBLAS picks kernels by
    shape), unlike the CPU's oneDNN path, so neighbours are left out of this claim."""
    model = _cuda_hf("qwen2")
    prompt = prompts([37], seed=7)[0]
    params = seeded(40, seed=8, top_p=0.95)
    cfg = {**CUDA, "dtype": dtype}
    alone = make_engine(model, **cfg)
    alone.add_request("x", prompt, params)
    want = run_all(alone)["x"]
    a, b = make_engine(model, **cfg), make_engine(model, **{**cfg, "block_size": 32})
    a.add_request("x", prompt, params)
    while a.progress("x") < 17:
        a.step()
    b.import_request(pickle.loads(pickle.dumps(a.export_request("x"))))
    got = run_all(b)["x"]
    assert got.output_ids == want.output_ids and got.migrations == 1
    assert got.logprobs == want.logprobs


def test_kv_leaves_through_pinned_memory_or_stays_on_the_device():
    """An export lands in pinned host memory; `to_host=False` keeps it on the GPU, and a
    request imported from there (no host hop) continues exactly; an offload and restore
    through the pinned host pool do too."""
    model = _cuda_hf("qwen2")
    prompt = prompts([29], seed=9)[0]
    params = seeded(30, seed=4, top_p=0.9)
    cfg = {**CUDA, "host_blocks": 16}
    alone = make_engine(model, **cfg)
    alone.add_request("x", prompt, params)
    want = run_all(alone)["x"]
    a, b = make_engine(model, **cfg), make_engine(model, **cfg)
    a.add_request("x", prompt, params)
    while a.progress("x") < 9:
        a.step()
    assert a.offload("x") and a.kv.host.is_pinned()
    while a.progress("x") < 15:
        a.step()  # restored from the host pool first
    snap = a.export_request("x", to_host=False)
    assert snap.kv.is_cuda
    assert a.kv.host_copy(snap.kv).is_pinned()
    b.import_request(snap)
    got = run_all(b)["x"]
    assert got.output_ids == want.output_ids and got.offloads == 1 and got.migrations == 1
