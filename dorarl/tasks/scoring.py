"""Safe scoring: a reward function that raises or returns garbage gives 0 and an error string.

Invariant: `score` never raises because of the reward function or the response; the
caller counts the errors (they end up in `Sample.reward_error`).
"""

from __future__ import annotations

import logging
import math

from dorarl.tasks.base import Prompt, Task

log = logging.getLogger(__name__)


def score(task: Task, prompt: Prompt, response_ids: list[int]) -> tuple[float, str | None]:
    """(reward, None) on success; (0.0, "ExcType: message") if the reward function fails."""
    try:
        value = task.reward(prompt, list(response_ids))
        reward = float(value)
    except Exception as exc:  # any failure of user reward code must not stop training
        error = f"{type(exc).__name__}: {exc}"
        log.debug("reward failed on prompt %s: %s", prompt.prompt_id, error)
        return 0.0, error
    if not math.isfinite(reward):
        return 0.0, f"ValueError: reward is not finite ({reward})"
    return reward, None
