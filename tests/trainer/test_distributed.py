"""The sharded trainer's split of a step: every sequence on exactly one rank, groups kept
whole when rows are packed, loads balanced, the same on every rank."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dorarl.trainer.batch import TrainSequence
from dorarl.trainer.distributed import rank_shares
from dorarl.trainer.packing import MAX_ROW_TOKENS


def _seq(prompt: list[int], n: int, first: int) -> TrainSequence:
    return TrainSequence(prompt, list(range(first, first + n)), [0.0] * n, 0.0)


@st.composite
def groups(draw) -> list[TrainSequence]:
    """A few groups (distinct prompts) with unique response tokens, so each can be traced."""
    seqs, token = [], 1000
    for g in range(draw(st.integers(0, 7))):
        prompt = [g] * draw(st.integers(1, 9))
        for _ in range(draw(st.integers(1, 6))):
            n = draw(st.integers(1, 12))
            seqs.append(_seq(prompt, n, token))
            token += n
    return seqs


def _ids(shares: list[list[TrainSequence]]) -> list[int]:
    return sorted(seq.response_ids[0] for share in shares for seq in share)


@settings(max_examples=200, deadline=None)
@given(groups(), st.integers(1, 4), st.sampled_from(["shared_prompt", "padded"]))
def test_every_sequence_goes_to_exactly_one_rank(seqs, world_size, packing):
    shares = rank_shares(seqs, world_size, packing, token_budget=10**6)
    assert len(shares) == world_size
    assert _ids(shares) == sorted(seq.response_ids[0] for seq in seqs)
    assert rank_shares(seqs, world_size, packing, 10**6) == shares  # deterministic


@settings(max_examples=200, deadline=None)
@given(groups(), st.integers(1, 4))
def test_packed_a_group_stays_on_one_rank_and_loads_balance(seqs, world_size):
    shares = rank_shares(seqs, world_size, "shared_prompt", token_budget=10**6)
    owners: dict[tuple[int, ...], set[int]] = {}
    for rank, share in enumerate(shares):
        for seq in share:
            owners.setdefault(tuple(seq.prompt_ids), set()).add(rank)
    assert all(len(ranks) == 1 for ranks in owners.values())
    loads = [_packed_tokens(share) for share in shares]
    largest_group = max((_packed_tokens([s for s in seqs if tuple(s.prompt_ids) == p])
                         for p in owners), default=0)  # fmt: skip
    assert max(loads, default=0) - min(loads, default=0) <= largest_group


def _packed_tokens(share: list[TrainSequence]) -> int:
    prompts = {tuple(seq.prompt_ids) for seq in share}
    return sum(len(p) for p in prompts) + sum(len(seq.response_ids) for seq in share)


def test_padded_deals_single_sequences_longest_first_to_the_lightest_rank():
    prompt = [1, 2]
    seqs = [_seq(prompt, n, 100 * n) for n in (3, 9, 5, 7)]
    shares = rank_shares(seqs, 2, "padded", token_budget=10**6)
    assert [[len(s.response_ids) for s in share] for share in shares] == [[3, 9], [5, 7]]
    packed = rank_shares(seqs, 2, "shared_prompt", token_budget=10**6)
    assert [len(share) for share in packed] == [4, 0]  # one group: one rank, prompt once


def test_packed_a_group_longer_than_the_widest_row_is_dealt_in_row_sized_parts():
    prompt = [7] * 100
    seqs = [_seq(prompt, 1500, 10_000 * (i + 1)) for i in range(6)]
    shares = rank_shares(seqs, 2, "shared_prompt", token_budget=10**6)
    # Rows of MAX_ROW_TOKENS hold the prompt and two responses: three parts, two ranks.
    assert 100 + 2 * 1500 <= MAX_ROW_TOKENS < 100 + 3 * 1500
    assert sorted(len(share) for share in shares) == [2, 4]
    narrow = rank_shares(seqs, 2, "shared_prompt", token_budget=1600)
    assert [len(share) for share in narrow] == [3, 3]  # parts of one response each
