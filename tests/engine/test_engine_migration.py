"""Export/import with KV, offload/restore and re-prefill continue a request exactly."""

import pickle

import pytest
import torch
from engine_testlib import (
    greedy,
    make_engine,
    prompts,
    run_all,
    run_alone,
    seeded,
    tiny_model,
)

from dorarl.engine import Engine, RequestOutput, RequestSnapshot
from dorarl.errors import UserInputError

PARAMS = {
    "greedy": greedy(24),
    "seeded": seeded(24, seed=7),
    "seeded-top-p-k": seeded(24, seed=11, top_p=0.8, top_k=20),
}


def _step_until(engine: Engine, request_id: str, num_output: int) -> None:
    while engine.progress(request_id) < num_output:
        finished = [out.request_id for out in engine.step()]
        assert request_id not in finished, "request finished too early"


def _assert_same(got: RequestOutput, want: RequestOutput) -> None:
    assert got.output_ids == want.output_ids
    torch.testing.assert_close(
        torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0
    )
    assert got.versions == want.versions
    assert got.finish_reason == want.finish_reason


def _with_neighbours(engine: Engine, count: int, seed: int) -> None:
    for i, p in enumerate(prompts([4 + 3 * i for i in range(count)], seed=seed)):
        engine.add_request(f"n{seed}-{i}", p, seeded(8 + 5 * i, seed=100 + i))


@pytest.mark.parametrize("kind", list(PARAMS))
def test_migration_continues_exactly(kind):
    model = tiny_model("qwen2", seed=1)
    prompt = prompts([13], seed=5)[0]
    want = run_alone(model, prompt, PARAMS[kind])
    a, b = make_engine(model), make_engine(model, block_size=8)  # different block sizes too
    _with_neighbours(a, 3, seed=1)
    _with_neighbours(b, 2, seed=2)
    a.add_request("x", prompt, PARAMS[kind])
    _step_until(a, "x", 9)
    snap = pickle.loads(pickle.dumps(a.export_request("x")))
    assert snap.kv is not None and snap.num_computed == 13 + 9 - 1
    assert "x" not in a.request_ids()
    b.import_request(snap)
    got = run_all(b)["x"]
    _assert_same(got, want)
    assert got.migrations == 1 and got.reprefill_tokens == 0
    run_all(a)  # neighbours left behind still finish


@pytest.mark.parametrize("kind", ["greedy", "seeded-top-p-k"])
def test_repeated_migrations_a_b_a_b(kind):
    model = tiny_model("llama", seed=1)
    prompt = prompts([6], seed=8)[0]
    want = run_alone(model, prompt, PARAMS[kind])
    engines = [make_engine(model), make_engine(model)]
    _with_neighbours(engines[0], 2, seed=3)
    _with_neighbours(engines[1], 3, seed=4)
    engines[0].add_request("x", prompt, PARAMS[kind])
    for hop, until in enumerate((3, 8, 14, 19)):
        src, dst = engines[hop % 2], engines[(hop + 1) % 2]
        _step_until(src, "x", until)
        dst.import_request(src.export_request("x"))
    got = run_all(engines[0])["x"]
    _assert_same(got, want)
    assert got.migrations == 4


@pytest.mark.parametrize("kind", list(PARAMS))
def test_offload_and_restore_continue_exactly(kind):
    model = tiny_model("qwen2", seed=1)
    prompt = prompts([10], seed=6)[0]
    want = run_alone(model, prompt, PARAMS[kind])
    engine = make_engine(model, host_blocks=64)
    _with_neighbours(engine, 3, seed=5)
    engine.add_request("x", prompt, PARAMS[kind])
    _step_until(engine, "x", 5)
    assert engine.offload("x")
    stats = engine.stats()
    assert stats.offloaded == 1 and stats.host_blocks_used > 0
    outs = run_all(engine)
    _assert_same(outs["x"], want)
    assert outs["x"].offloads == 1 and outs["x"].reprefill_tokens == 0
    assert engine.stats().restores == 1 and engine.stats().host_blocks_used == 0


def test_export_of_an_offloaded_request_carries_its_host_kv():
    model = tiny_model("qwen2", seed=1)
    prompt = prompts([9], seed=9)[0]
    want = run_alone(model, prompt, greedy(24))
    a, b = make_engine(model, host_blocks=32), make_engine(model)
    a.add_request("x", prompt, greedy(24))
    _step_until(a, "x", 4)
    assert a.offload("x")
    snap = a.export_request("x")
    assert a.stats().host_blocks_used == 0
    b.import_request(snap)
    _assert_same(run_all(b)["x"], want)


def test_resume_from_tokens_reprefills_and_matches():
    model = tiny_model("llama", seed=1)
    prompt = prompts([11], seed=10)[0]
    params = seeded(20, seed=3, top_k=30)
    want = run_alone(model, prompt, params)
    a, b = make_engine(model), make_engine(model, prefill_chunk_size=5)  # resume in chunks
    a.add_request("x", prompt, params)
    _step_until(a, "x", 7)
    snap = a.abort("x")
    assert snap.kv is None and len(snap.output_ids) == 7
    b.resume_request(snap)
    got = run_all(b)["x"]
    _assert_same(got, want)
    assert got.reprefill_tokens == 11 + 7 - 1


def test_resume_under_a_new_version_tags_only_new_tokens():
    model = tiny_model("qwen2", seed=1)
    prompt = prompts([8], seed=11)[0]
    a, b = make_engine(model, version=3), make_engine(model, version=4)
    a.add_request("x", prompt, greedy(12))
    _step_until(a, "x", 5)
    snap = a.abort("x")
    with pytest.raises(UserInputError, match="version 3 .* version 4"):
        b.import_request(a_snapshot_with_kv(model, prompt))
    b.resume_request(snap)
    got = run_all(b)["x"]
    assert got.versions == [3] * 5 + [4] * 7
    assert got.logprobs[:5] == snap.logprobs


def a_snapshot_with_kv(model, prompt: list[int]) -> RequestSnapshot:
    engine = make_engine(model, version=3)
    engine.add_request("y", prompt, greedy(12))
    engine.step()
    return engine.export_request("y")


def test_waiting_request_exports_without_kv_and_still_runs():
    model = tiny_model("qwen2", seed=1)
    prompt = prompts([7], seed=12)[0]
    want = run_alone(model, prompt, greedy(10))
    a, b = make_engine(model), make_engine(model)
    a.add_request("x", prompt, greedy(10))
    snap = a.export_request("x")
    assert snap.kv is None and snap.output_ids == []
    b.import_request(snap)
    _assert_same(run_all(b)["x"], want)


def test_snapshot_is_small_and_plain():
    model = tiny_model("qwen2", seed=1)
    engine = make_engine(model)
    engine.add_request("x", prompts([20], seed=13)[0], greedy(10))
    _step_until(engine, "x", 3)
    snap = engine.export_request("x")
    spec = engine.spec
    assert snap.kv.device.type == "cpu"
    assert tuple(snap.kv.shape) == (2, spec.num_layers, spec.num_kv_heads, 22, spec.head_dim)
    payload = pickle.dumps(snap)
    assert len(payload) < snap.kv_bytes + 4096
