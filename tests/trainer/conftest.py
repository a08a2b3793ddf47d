"""Random groups of made-up samples for the trainer tests."""

import random

import pytest

from dorarl.data import Group, Sample


@pytest.fixture
def make_groups():
    return _make_groups


def _make_groups(
    seed: int, n_groups: int = 3, group_size: int = 4, version: int = 0, vocab: int = 100
) -> list[Group]:
    """Random groups with varied prompt/response lengths and made-up behavior logprobs."""
    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        prompt = [1] + [rng.randrange(4, vocab) for _ in range(rng.randint(2, 9))]
        samples = []
        for i in range(group_size):
            n = rng.randint(1, 12)
            samples.append(
                Sample(
                    group_id=g,
                    sample_index=i,
                    prompt_id=g,
                    prompt_ids=prompt,
                    response_ids=[rng.randrange(4, vocab) for _ in range(n)],
                    logprobs=[-rng.uniform(3.0, 6.0) for _ in range(n)],
                    versions=[version] * n,
                    finish_reason="stop",
                    reward=float(rng.random() < 0.5),
                )
            )
        groups.append(Group(group_id=g, prompt_id=g, version=version, samples=samples))
    return groups
