"""New segments of a multi-turn request: a fresh prompt whose KV is computed anew, sampled
exactly as a request of that prompt alone would be, every segment kept in the output, and
the same result through migration, offload and re-prefill."""

import pickle

import pytest
import torch
from engine_testlib import VOCAB, make_engine, prompts, run_all, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine_multiturn import ACTIONS, TURN, _hop, _neighbours, _params, _until_turn_ends

from dorarl.data import SegmentStart
from dorarl.engine import Engine, RequestOutput
from dorarl.engine.sequence import next_segment_seed
from dorarl.errors import UserInputError


def _steps(engine: Engine, request_id: str) -> tuple[RequestOutput, list[int]]:
    """Run to the end of the request's turn; the prefill tokens of each step that had some."""
    prefills = []
    for _ in range(1000):
        outs = engine.step()
        if engine.last_step.prefill_tokens:
            prefills.append(engine.last_step.prefill_tokens)
        for out in outs:
            if out.request_id == request_id:
                return out, prefills
    raise AssertionError("the turn did not end")


def test_a_new_segment_samples_as_its_prompt_alone_and_the_output_keeps_both():
    model = tiny_model("qwen2", seed=2)
    first, second = prompts([9, 7], seed=4)
    engine = make_engine(model)
    engine.add_request("x", first, _params(greedy=False))
    turn1 = _until_turn_ends(engine, "x")
    held = engine.stats().kv_blocks_used
    assert engine.start_segment("x", second)
    assert engine.stats().kv_blocks_used == 0 < held  # the old segment's KV is freed
    turn2, prefills = _steps(engine, "x")
    assert prefills == [len(second)]  # the new prompt from scratch, nothing of the old one
    # What a request of the new prompt alone samples, with the segment's own seed.
    alone = make_engine(model)
    alone.add_request("y", second, _params(greedy=False, seed=next_segment_seed(3)))
    want = _until_turn_ends(alone, "y")
    assert turn2.turn_ids == want.output_ids and turn2.turn_ids != turn1.turn_ids
    assert turn2.logprobs[-TURN:] == want.logprobs  # bit for bit on the CPU
    got = engine.end_request("x")
    assert got.prompt_ids == first
    assert got.output_ids == turn1.output_ids + second + want.output_ids
    assert got.observed == [False] * TURN + [True] * len(second) + [False] * TURN
    assert got.logprobs == turn1.logprobs + [0.0] * len(second) + want.logprobs
    assert got.segments == [SegmentStart(TURN, len(second))]
    assert got.context_tokens == len(second) + TURN
    assert engine.stats().kv_blocks_used == 0


def test_a_segment_extended_by_an_observation_continues_on_its_own_kv():
    model = tiny_model("llama", seed=2)
    first, second, obs = prompts([6, 8, 3], seed=5)
    engine = make_engine(model)
    engine.add_request("x", first, _params(greedy=True))
    _until_turn_ends(engine, "x")
    assert engine.start_segment("x", second)
    _until_turn_ends(engine, "x")
    assert engine.continue_request("x", obs)
    _, prefills = _steps(engine, "x")
    assert prefills == [len(obs) + 1]  # the observation and the turn's last token, no more
    got = engine.end_request("x")
    alone = make_engine(model)
    alone.add_request("y", second, _params(greedy=True, seed=next_segment_seed(3)))
    turn = _until_turn_ends(alone, "y")
    assert alone.continue_request("y", obs)
    _until_turn_ends(alone, "y")
    want = alone.end_request("y")
    start = got.segments[0].at + len(second)
    assert got.output_ids[start:] == want.output_ids and turn.output_ids == want.output_ids[:TURN]
    torch.testing.assert_close(torch.tensor(got.logprobs[start:]), torch.tensor(want.logprobs))


def _in_place(model, first, segments, params) -> RequestOutput:
    engine = make_engine(model)
    engine.add_request("x", first, params)
    for prompt in segments:
        _until_turn_ends(engine, "x")
        assert engine.start_segment("x", prompt)
    _until_turn_ends(engine, "x")
    return engine.end_request("x")


@settings(max_examples=10, deadline=None)
@given(
    hops=st.lists(
        st.tuples(st.sampled_from(ACTIONS), st.sampled_from(ACTIONS)), min_size=1, max_size=3
    ),
    greedy=st.booleans(),
)
def test_segments_survive_migration_offload_and_reprefill(hops, greedy):
    model = tiny_model("llama", seed=3)
    first, *segments = prompts([8] + [5 + i for i in range(len(hops))], seed=6)
    want = _in_place(model, first, segments, _params(greedy))
    engine, other = make_engine(model, host_blocks=64), make_engine(model, host_blocks=64)
    _neighbours(engine, 1)
    _neighbours(other, 2)
    engine.add_request("x", first, _params(greedy))
    for (between, within), prompt in zip(hops, segments, strict=True):
        _until_turn_ends(engine, "x")
        engine, other = _hop(engine, other, between)
        assert engine.start_segment("x", prompt)
        engine.step()
        engine.step()
        if "x" in engine.request_ids() and not engine._seqs["x"].waits_env:
            engine, other = _hop(engine, other, within)
    _until_turn_ends(engine, "x")
    got = engine.end_request("x")
    assert got.output_ids == want.output_ids and got.observed == want.observed
    assert got.segments == want.segments and len(got.segments) == len(hops)
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0)  # fmt: skip
    run_all(engine), run_all(other)


def test_a_snapshot_carries_the_earlier_segments():
    model = tiny_model("qwen2", seed=2)
    first, second = prompts([6, 4], seed=1)
    engine = make_engine(model)
    engine.add_request("x", first, _params(greedy=True))
    _until_turn_ends(engine, "x")
    assert engine.start_segment("x", second)
    snap = pickle.loads(pickle.dumps(engine.export_request("x")))
    assert snap.prompt_ids == second and snap.earlier.prompt_ids == first
    assert snap.earlier.starts == [SegmentStart(TURN, len(second))]


def test_bad_segments_are_refused_in_one_line_and_no_room_changes_nothing():
    model = tiny_model("qwen2", seed=2)
    engine = make_engine(model, max_model_len=24)
    engine.add_request("x", prompts([6], seed=1)[0], _params(greedy=True))
    with pytest.raises(UserInputError, match="not waiting for an observation"):
        engine.start_segment("x", [1])
    _until_turn_ends(engine, "x")
    with pytest.raises(UserInputError, match="outside the vocabulary"):
        engine.start_segment("x", [VOCAB])
    with pytest.raises(UserInputError, match="empty prompt"):
        engine.start_segment("x", [])
    assert not engine.start_segment("x", [1] * 24)  # no room to sample under 24
    assert engine.progress("x") == TURN and engine._seqs["x"].earlier is None
    assert engine.start_segment("x", [1] * 23)
    assert engine.progress("x") == 0
