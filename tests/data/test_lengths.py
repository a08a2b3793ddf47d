import math

import numpy as np
import pytest

from dorarl.config import ConfigError
from dorarl.data.lengths import LengthDist


def draw(dist, groups, size=8, seed=3):
    return np.array([dist.group_lengths(seed, g, size) for g in range(groups)], dtype=float)


def test_realized_median_and_tail_ratio_match_the_request():
    dist = LengthDist(median=400, p99_ratio=12, group_corr=0.5, max_len=1_000_000)
    lengths = draw(dist, 4000).ravel()
    median = np.median(lengths)
    assert median == pytest.approx(400, rel=0.05)
    assert np.percentile(lengths, 99) / median == pytest.approx(12, rel=0.12)


def test_samples_of_a_group_are_correlated_by_the_shared_factor():
    for corr in (0.0, 0.8):
        logs = np.log(
            draw(LengthDist(median=300, p99_ratio=10, group_corr=corr, max_len=10**7), 3000, size=2)
        )
        realized = np.corrcoef(logs[:, 0], logs[:, 1])[0, 1]
        assert realized == pytest.approx(corr, abs=0.06)


def test_lengths_depend_only_on_seed_and_group_and_respect_bounds():
    dist = LengthDist(median=50, p99_ratio=40, min_len=5, max_len=300)
    assert dist.group_lengths(7, 11, 4) == dist.group_lengths(7, 11, 4)
    assert dist.group_lengths(7, 11, 4) != dist.group_lengths(8, 11, 4)
    lengths = draw(dist, 500)
    assert lengths.min() >= 5 and lengths.max() <= 300
    assert dist.sigma == pytest.approx(math.log(40) / 2.3263478740408408)


@pytest.mark.parametrize(
    ("field", "value"), [("median", 0.5), ("p99_ratio", 0.9), ("group_corr", 1.5), ("max_len", 0)]
)
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ConfigError, match=f"^{field}:"):
        LengthDist(**{field: value}).validate()
