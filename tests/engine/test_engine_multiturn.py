"""Multi-turn requests: a turn ends, the request waits (KV kept, no slot), an observation
continues it exactly as a one-shot prefill of the same tokens would, wherever it went."""

import pickle

import pytest
import torch
from engine_testlib import VOCAB, make_engine, prompts, run_all, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from dorarl.engine import Engine, RequestOutput, SamplingParams
from dorarl.errors import UserInputError

TURN = 5  # sampled tokens per turn (a per-turn cap: random models rarely stop)


def _params(greedy: bool, seed: int = 3) -> SamplingParams:
    temperature = 0.0 if greedy else 1.0
    return SamplingParams(
        temperature=temperature, max_new_tokens=TURN, stop_token_ids=[], seed=seed, multi_turn=True
    )


def _until_turn_ends(engine: Engine, request_id: str) -> RequestOutput:
    for _ in range(1000):
        for out in engine.step():
            if out.request_id == request_id:
                assert out.waits_env
                return out
    raise AssertionError("the turn did not end")


def _observations(count: int, seed: int) -> list[list[int]]:
    return prompts([2 + (3 * i) % 5 for i in range(count)], seed=seed)


def _episode_in_place(model, prompt, obs, params) -> RequestOutput:
    engine = make_engine(model)
    engine.add_request("x", prompt, params)
    for o in obs:
        _until_turn_ends(engine, "x")
        assert engine.continue_request("x", o)
    _until_turn_ends(engine, "x")
    return engine.end_request("x")


def _assert_same(got: RequestOutput, want: RequestOutput) -> None:
    assert got.output_ids == want.output_ids
    assert got.observed == want.observed
    torch.testing.assert_close(
        torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_each_turn_equals_a_one_shot_prefill_of_its_history(arch):
    model = tiny_model(arch, seed=2)
    prompt = prompts([9], seed=4)[0]
    obs = _observations(3, seed=5)
    episode = _episode_in_place(model, prompt, obs, _params(greedy=True))
    out, observed = episode.output_ids, episode.observed
    assert len(out) == 4 * TURN + sum(map(len, obs)) and sum(observed) == sum(map(len, obs))
    starts = [i for i in range(len(out)) if not observed[i] and (i == 0 or observed[i - 1])]
    for start in starts:
        one_shot = make_engine(model)
        one_shot.add_request("y", prompt + out[:start], _params(greedy=True))
        turn = _until_turn_ends(one_shot, "y")
        assert turn.output_ids == out[start : start + TURN]
        torch.testing.assert_close(
            torch.tensor(turn.logprobs),
            torch.tensor(episode.logprobs[start : start + TURN]),
            atol=1e-5,
            rtol=0,
        )
    # And against Hugging Face's own forward over the whole episode, teacher-forced.
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1]
    ref = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(out)[:, None])[:, 0]
    sampled = [i for i, o in enumerate(observed) if not o]
    torch.testing.assert_close(
        torch.tensor(episode.logprobs)[sampled], ref[sampled], atol=1e-4, rtol=0
    )
    assert all(episode.logprobs[i] == 0.0 for i, o in enumerate(observed) if o)


def test_a_waiting_episode_keeps_its_kv_and_frees_its_slot():
    model = tiny_model("qwen2", seed=2)
    engine = make_engine(model, max_num_seqs=1)
    p1, p2 = prompts([7, 6], seed=8)
    engine.add_request("x", p1, _params(greedy=False))
    _until_turn_ends(engine, "x")
    held = engine.stats().kv_blocks_used
    assert held > 0 and engine.stats().env_waiting == 1 and not engine.has_runnable()
    engine.add_request("y", p2, SamplingParams(max_new_tokens=4, stop_token_ids=[], seed=1))
    assert "y" in run_until_gone(engine, "y")  # runs in the one slot while x waits
    assert engine.stats().kv_blocks_used == held
    assert engine.continue_request("x", [1, 2, 3])
    _until_turn_ends(engine, "x")
    got = engine.end_request("x")
    assert got.reprefill_tokens == 0 and engine.stats().kv_blocks_used == 0
    want = _episode_in_place(model, p1, [[1, 2, 3]], _params(greedy=False))
    _assert_same(got, want)


def run_until_gone(engine: Engine, request_id: str) -> set[str]:
    done: set[str] = set()
    while request_id in engine.request_ids() and engine.has_runnable():
        done |= {out.request_id for out in engine.step()}
    return done


def _hop(engine: Engine, other: Engine, action: str) -> tuple[Engine, Engine]:
    """One thing that may happen to a request between or within turns."""
    if action == "migrate":
        snap = pickle.loads(pickle.dumps(engine.export_request("x")))
        other.import_request(snap)
        return other, engine
    if action == "offload":
        assert engine.offload("x")
    if action == "reprefill":  # partial rollout's interrupt and resume (KV dropped)
        before = engine._seqs["x"].reprefill_tokens
        engine.resume_request(engine.abort("x"))
        assert engine._seqs["x"].reprefill_tokens > before
    return engine, other


def _neighbours(engine: Engine, seed: int) -> None:
    for i, p in enumerate(prompts([3, 5], seed=seed)):
        engine.add_request(f"n{seed}-{i}", p, SamplingParams(max_new_tokens=30, seed=i))


ACTIONS = ["stay", "migrate", "offload", "reprefill"]


@settings(max_examples=12, deadline=None)
@given(
    turns=st.lists(
        st.tuples(st.sampled_from(ACTIONS), st.sampled_from(ACTIONS), st.integers(1, 4)),
        min_size=1,
        max_size=3,
    ),
    greedy=st.booleans(),
)
def test_episodes_continue_exactly_through_migration_offload_and_reprefill(turns, greedy):
    # Between turns (the first action) and within the next one (the second, after a few
    # tokens), the request may move with its KV, go to host memory or lose its KV.
    model = tiny_model("llama", seed=3)
    prompt = prompts([8], seed=6)[0]
    obs = _observations(len(turns), seed=7)
    want = _episode_in_place(model, prompt, obs, _params(greedy))
    engine, other = make_engine(model, host_blocks=64), make_engine(model, host_blocks=64)
    _neighbours(engine, 1)
    _neighbours(other, 2)
    engine.add_request("x", prompt, _params(greedy))
    for (between, within, after), o in zip(turns, obs, strict=True):
        _until_turn_ends(engine, "x")
        engine, other = _hop(engine, other, between)
        assert engine.continue_request("x", o)
        while engine.progress("x") < len(want.output_ids) and _turn_tokens(engine) < after:
            engine.step()
        engine, other = _hop(engine, other, within)
    _until_turn_ends(engine, "x")
    got = engine.end_request("x")
    _assert_same(got, want)
    run_all(engine), run_all(other)  # the neighbours still finish


def _turn_tokens(engine: Engine) -> int:
    seq = engine._seqs["x"]
    return seq.turn_output


def test_bad_continuations_are_refused_in_one_line():
    model = tiny_model("qwen2", seed=2)
    engine = make_engine(model, max_model_len=24)
    engine.add_request("x", prompts([6], seed=1)[0], _params(greedy=True))
    with pytest.raises(UserInputError, match="not waiting for an observation"):
        engine.continue_request("x", [1])
    _until_turn_ends(engine, "x")
    with pytest.raises(UserInputError, match="outside the vocabulary"):
        engine.continue_request("x", [VOCAB])
    assert not engine.continue_request("x", [1] * 13)  # 11 + 13 = 24: no room to sample
    assert engine.continue_request("x", [1] * 12)
    assert engine.progress("x") == TURN + 12
