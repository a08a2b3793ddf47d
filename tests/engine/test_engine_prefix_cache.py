"""The prefix cache: a group's samples prefill their prompt once, a cached system prompt is
not prefilled again, blocks are read within one weights version only, idle cached blocks go
before any request is evicted, and a request's tokens and log-probs are bit-identical with
the cache on and off (checked through the block tables and the engine's counters)."""

import pickle

import pytest
from engine_testlib import make_engine, prompts, run_all, run_alone, seeded, tiny_model

from dorarl.engine import Engine, RequestOutput
from dorarl.engine.weights import random_named

BS = 4  # make_engine's block size


def _exactly(got: dict[str, RequestOutput], want: dict[str, RequestOutput]) -> None:
    assert got.keys() == want.keys()
    for rid, out in want.items():
        assert got[rid].output_ids == out.output_ids, rid
        assert got[rid].logprobs == out.logprobs, rid  # bit for bit


def _group(engine: Engine, prompt: list[int], size: int, tokens: int = 10, tag: str = "s"):
    for i in range(size):
        engine.add_request(f"{tag}{i}", prompt, seeded(tokens, seed=i))


def _step_until_all_decode(engine: Engine, rids: list[str]) -> None:
    while min(engine.progress(r) for r in rids) < 2:
        engine.step()


def test_a_groups_samples_prefill_their_prompt_once():
    model = tiny_model("llama", seed=1)
    prompt = prompts([30], seed=4)[0]  # 7 full blocks and 2 tokens in an eighth
    results = {}
    for cache in ("on", "off"):
        engine = make_engine(model, prefix_cache=cache)
        _group(engine, prompt, 8)
        _step_until_all_decode(engine, [f"s{i}" for i in range(8)])
        tables = [engine.block_table(f"s{i}") for i in range(8)]
        results[cache] = (run_all(engine), engine.stats(), tables)
    on, off = results["on"], results["off"]
    _exactly(on[0], off[0])
    # the leader computes the prompt; each other sample its last token only, for its logits
    assert (on[1].prefill_tokens, on[1].prefill_saved_tokens) == (30 + 7, 7 * 29)
    assert (off[1].prefill_tokens, off[1].prefill_saved_tokens) == (8 * 30, 0)
    leader, *others = on[2]
    assert all(t[:7] == leader[:7] for t in others)  # the full blocks: one copy, read by all
    last = [t[7] for t in on[2]]
    assert len(set(last)) == 8  # the partial block: copied on write, one each
    assert len({b for t in off[2] for b in t[:7]}) == 8 * 7


def test_a_cached_system_prompt_is_not_prefilled_again():
    model = tiny_model("qwen3", seed=2)
    system = prompts([40], seed=6)[0]  # 10 full blocks
    episodes = [system + tail for tail in prompts([7, 12, 3], seed=7)]
    results = {}
    for cache in ("on", "off"):
        engine = make_engine(model, prefix_cache=cache)
        computed, outs = [], {}
        for i, prompt in enumerate(episodes):  # one after another: each finds the last's
            before = engine.stats().prefill_tokens
            engine.add_request(f"e{i}", prompt, seeded(8, seed=i))
            outs |= run_all(engine)
            computed.append(engine.stats().prefill_tokens - before)
        results[cache] = (outs, computed)
    _exactly(results["on"][0], results["off"][0])
    assert results["on"][1] == [47, 12, 3]  # only what follows the system prompt
    assert results["off"][1] == [47, 52, 43]


def test_blocks_are_read_within_one_version_only():
    model = tiny_model("llama", seed=1)
    prompt = prompts([30], seed=4)[0]
    new = random_named(make_engine(model).spec, seed=3, std=0.1)
    engine = make_engine(model)
    _group(engine, prompt, 2, tokens=40, tag="old")
    _step_until_all_decode(engine, ["old0", "old1"])
    engine.add_request("done", prompts([21], seed=9)[0], seeded(3, seed=1))
    while "done" in engine.request_ids():
        engine.step()
    old_blocks = set(engine.block_table("old0")) | set(engine.block_table("old1"))
    stats = engine.stats()
    # the 7 shared prompt blocks and old0's partial one; done's 5 and its partial one, idle
    assert (stats.kv_blocks_cached, stats.kv_blocks_used) == (8 + 6, len(old_blocks))
    engine.load_weights(new, version=1)
    stats = engine.stats()
    # every cached block of version 0 is gone: the idle ones are free again, the ones old0
    # and old1 still hold are theirs alone until they leave
    assert (stats.kv_blocks_cached, stats.kv_blocks_used) == (0, len(old_blocks))
    assert stats.kv_blocks_free == stats.kv_blocks_total - len(old_blocks)
    _group(engine, prompt, 2, tokens=6, tag="new")
    _step_until_all_decode(engine, ["new0", "new1"])
    new_tables = [engine.block_table("new0"), engine.block_table("new1")]
    assert not old_blocks & {b for t in new_tables for b in t}  # nothing of version 0
    assert new_tables[0][:7] == new_tables[1][:7]  # version 1's own prompt blocks, shared
    outs = run_all(engine)
    reference = make_engine(model, prefix_cache="off")
    reference.load_weights(new, version=1)
    _group(reference, prompt, 2, tokens=6, tag="new")
    _exactly({r: outs[r] for r in ("new0", "new1")}, run_all(reference))
    assert all(v == 1 for r in ("new0", "new1") for v in outs[r].versions)


def _warm(engine: Engine) -> None:
    """Four prompts of 5 full blocks and a partial one run to the end: 24 cached blocks idle."""
    for i, prompt in enumerate(prompts([22] * 4, seed=11)):
        engine.add_request(f"warm{i}", prompt, seeded(2, seed=i))
    run_all(engine)
    stats = engine.stats()
    assert (stats.kv_blocks_cached, stats.kv_blocks_used, stats.kv_usage) == (24, 0, 0.0)
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_the_pressure_figures_count_only_blocks_in_use():
    model = tiny_model("qwen2", seed=1)
    engine = make_engine(
        model, num_blocks=32, max_model_len=64, host_blocks=32, offload_threshold=0.5
    )
    _warm(engine)
    for i, prompt in enumerate(prompts([20, 20], seed=12)):  # 6 blocks each: 12 of 16
        engine.add_request(f"r{i}", prompt, seeded(4, seed=i))
    run_all(engine)
    assert engine.stats().offloads == 0  # 12 in use + 24 idle cached is not over 16


def test_idle_cached_blocks_go_before_any_request_is_evicted():
    model = tiny_model("qwen2", seed=1)
    pool = dict(num_blocks=24, max_model_len=64)  # no host pool: evicting means recompute
    engine = make_engine(model, **pool)
    _warm(engine)
    work = [(p, seeded(12, seed=10 + i)) for i, p in enumerate(prompts([20] * 3, seed=12))]
    for i, (prompt, params) in enumerate(work):  # 3 x 8 blocks: the whole pool, at the end
        engine.add_request(f"r{i}", prompt, params)
    outs, peak = {}, 0
    while engine.has_unfinished():
        outs |= {out.request_id: out for out in engine.step()}
        peak = max(peak, engine.stats().kv_blocks_used)
    assert peak == 24 and engine.stats().preemptions == 0  # every idle block went first
    for i, (prompt, params) in enumerate(work):
        want = run_alone(model, prompt, params, **pool, prefix_cache="off")
        assert outs[f"r{i}"].output_ids == want.output_ids
        assert outs[f"r{i}"].logprobs == want.logprobs


def test_export_of_a_sharer_carries_its_kv_and_its_destination_shares_it_again():
    model = tiny_model("qwen2", seed=1)
    prompt = prompts([30], seed=4)[0]
    src, dst = make_engine(model), make_engine(model)
    _group(src, prompt, 4)
    _step_until_all_decode(src, [f"s{i}" for i in range(4)])
    shared = src.block_table("s0")[:7]
    snap = pickle.loads(pickle.dumps(src.export_request("s1")))
    assert snap.kv is not None and snap.kv.shape[3] == snap.num_computed
    assert [src.blocks.device.refs(b) for b in shared] == [3] * 7  # s0, s2, s3 still read them
    dst.add_request("host", prompt, seeded(20, seed=9))  # dst computes and caches the prompt
    _step_until_all_decode(dst, ["host"])
    dst.import_request(snap)
    dst.step()
    assert dst.block_table("s1")[:7] == dst.block_table("host")[:7]
    moved = run_all(dst)["s1"]
    alone = make_engine(model, prefix_cache="off")
    _group(alone, prompt, 4)
    want = run_all(alone)["s1"]
    assert (moved.output_ids, moved.logprobs) == (want.output_ids, want.logprobs)
    assert moved.migrations == 1
    run_all(src)
    assert src.stats().kv_blocks_used == 0 and dst.stats().kv_blocks_used == 0


def test_offload_of_a_sharer_moves_no_block_the_others_read():
    model = tiny_model("llama", seed=3)
    prompt = prompts([30], seed=5)[0]
    engine = make_engine(model, host_blocks=64)
    rids = [f"s{i}" for i in range(4)]
    _group(engine, prompt, 4, tokens=16)
    _step_until_all_decode(engine, rids)
    before = {r: engine.block_table(r) for r in rids}
    assert engine.offload("s2")
    assert engine.block_table("s2") == []
    for r in ("s0", "s1", "s3"):
        assert engine.block_table(r) == before[r]
    assert [engine.blocks.device.refs(b) for b in before["s0"][:7]] == [3] * 7
    engine.step()  # restored: its prompt blocks are read from the cache, not copied back
    assert engine.block_table("s2")[:7] == before["s0"][:7]
    outs = run_all(engine)
    reference = make_engine(model, host_blocks=64, prefix_cache="off")
    _group(reference, prompt, 4, tokens=16)
    _exactly(outs, run_all(reference))
    assert outs["s2"].offloads == 1 and engine.stats().host_blocks_used == 0


@pytest.mark.parametrize("attention", ["torch", "cpp"])
def test_decode_rows_read_shared_blocks_bit_identically(attention):
    """The tensor path gathers shared blocks per row instead of reading the pool range in
    place; the fused kernel walks the tables: either way the same bits as unshared blocks."""
    model = tiny_model("qwen3", seed=4)
    batch = prompts([30, 13], seed=8)
    results = {}
    for cache in ("on", "off"):
        engine = make_engine(model, attention=attention, prefix_cache=cache)
        _group(engine, batch[0], 3, tag="a")
        _group(engine, batch[1], 3, tag="b")
        results[cache] = run_all(engine)
    _exactly(results["on"], results["off"])
