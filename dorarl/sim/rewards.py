"""Simulated rewards: 0/1 scores whose groups are uniform (all equal) with a chosen share.

The cost model has no task to score, but dynamic sampling (`rollout.filter_groups`)
decides on rewards, so the simulator draws them: group g is uniform with probability
`uniform_share` (then all correct with probability `correct_share`, else all wrong);
otherwise between 1 and G-1 of its samples are correct, at random places. Rewards of
group g depend only on (seed, g), on a stream of their own: the same group gets the same
rewards (and lengths) whatever the schedule, so runs with and without filtering compare.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dorarl.config import check_fields

_STREAM = 0x5EED  # keeps reward draws apart from the length draws of the same group


@dataclass(kw_only=True)
class RewardModel:
    uniform_share: float = field(
        default=0.3,
        metadata={
            "help": "share of groups whose rewards are all equal (filtered by DAPO)",
            "ge": 0,
            "le": 1,
        },
    )
    correct_share: float = field(
        default=0.5,
        metadata={
            "help": "of the uniform groups, the share that is all correct",
            "ge": 0,
            "le": 1,
        },
    )

    def validate(self) -> None:
        check_fields(self)

    def group_rewards(self, seed: int, group_id: int, group_size: int) -> list[float]:
        """The rewards of the G samples of group `group_id`, by sample index."""
        import numpy as np  # here, as in LengthDist: configs load without numpy

        rng = np.random.default_rng([seed, group_id, _STREAM])
        if group_size < 2 or rng.random() < self.uniform_share:
            return [float(rng.random() < self.correct_share)] * group_size
        correct = int(rng.integers(1, group_size))
        rewards = np.zeros(group_size)
        rewards[rng.permutation(group_size)[:correct]] = 1.0
        return [float(r) for r in rewards]
