"""Safe scoring: a reward function that raises or returns garbage gives 0 and an error string.

Invariant: neither `score` nor `score_all` raises because of the reward function or the
response; the caller counts the errors (they end up in `Sample.reward_error`). A task with
users' rewards (`Task.user_rewards`) is scored by them, each call bounded in time.
"""

from __future__ import annotations

import logging
import math

from dorarl.tasks.base import Prompt, Task
from dorarl.tasks.user_rewards import RewardInput, Scored

log = logging.getLogger(__name__)


def score(task: Task, prompt: Prompt, response_ids: list[int]) -> tuple[float, str | None]:
    """(reward, None) on success; (0.0, "ExcType: message") if the reward function fails."""
    scored = score_all(task, [(prompt, response_ids)])[0]
    return scored.reward, scored.error


def score_all(task: Task, responses: list[tuple[Prompt, list[int]]]) -> list[Scored]:
    """Each (prompt, response ids)'s reward, its named parts and error; users' rewards run
    together, off the caller's thread."""
    if task.user_rewards is None:
        return [_task_reward(task, prompt, ids) for prompt, ids in responses]
    inputs, failed = [], {}
    for i, (prompt, ids) in enumerate(responses):
        try:
            text = task.answer_text(list(ids), prompt)
        except Exception as exc:  # a response the tokenizer cannot decode scores 0
            failed[i] = Scored(0.0, f"{type(exc).__name__}: {exc}")
            continue
        inputs.append(RewardInput(prompt.fields(), text, list(ids), prompt.answer))
    scored = iter(task.user_rewards.score(inputs))
    return [failed[i] if i in failed else next(scored) for i in range(len(responses))]


def _task_reward(task: Task, prompt: Prompt, response_ids: list[int]) -> Scored:
    try:
        value = task.reward(prompt, list(response_ids))
        reward = float(value)
    except Exception as exc:  # any failure of user reward code must not stop training
        error = f"{type(exc).__name__}: {exc}"
        log.debug("reward failed on prompt %s: %s", prompt.prompt_id, error)
        return Scored(0.0, error)
    if not math.isfinite(reward):
        return Scored(0.0, f"ValueError: reward is not finite ({reward})")
    return Scored(reward)
