"""Held-out evaluation through a rollout engine, scored by the task: greedy accuracy and,
with `EvalSampling.samples = k`, mean@k and pass@k over k sampled responses per prompt.

Invariants: evaluation needs an idle engine (it drains every request it sees), so it runs
between training steps; the engine's weights and version are left as they were. Sample j
of prompt p is drawn with a seed fixed by (seed, p, j), so every version is judged on the
same random numbers and the differences between versions are not sampling noise. pass@j
is the unbiased estimator 1 - C(k - c, j) / C(k, j) of k samples with c correct.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

from dorarl.tasks.base import Prompt, Task, cut_at_stop
from dorarl.tasks.scoring import score_all


@dataclass(frozen=True)
class EvalSampling:
    """The sampled part of an evaluation: k responses per prompt at the run's settings."""

    samples: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0


def evaluate(
    engine: Any,
    task: Task,
    prompts: list[Prompt] | None = None,
    max_prompts: int | None = None,
    sampling: EvalSampling | None = None,
) -> dict[str, float]:
    """{"accuracy", "n", "mean_len", "reward_errors"} over `prompts` (default: the eval set),
    plus "mean@k" and "pass@j" (j = 2, 4, .. below k, and k) when `sampling.samples` = k > 0."""
    if engine.has_unfinished():
        raise ValueError("evaluate needs an idle engine (it would swallow other requests)")
    prompts = list(task.eval_prompts() if prompts is None else prompts)[:max_prompts]
    if getattr(task, "multi_turn", False):
        return _evaluate_episodes(engine, task, prompts)
    sampling = sampling or EvalSampling()
    requests = _requests(task, prompts, sampling)
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt.prompt_ids, params)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out.output_ids
    greedy = [(p, outputs[_greedy_id(p)]) for p in prompts]
    result = _summarise(task, greedy)
    if sampling.samples:
        sampled = [[outputs[_sample_id(p, j)] for j in range(sampling.samples)] for p in prompts]
        result.update(_sampled_scores(task, prompts, sampled, result))
    return result


def _evaluate_episodes(engine: Any, task: Any, prompts: list[Prompt]) -> dict[str, float]:
    """Greedy episodes: accuracy is the share whose reward is 1 (every turn right)."""
    from dorarl.engine import SamplingParams
    from dorarl.tasks.episodes import run_episodes

    params = SamplingParams(
        temperature=0.0,
        max_new_tokens=task.max_new_tokens,
        stop_token_ids=list(task.stop_token_ids),
        stop_strings=list(getattr(task, "stop_strings", [])),
        multi_turn=True,
    )
    results = list(run_episodes(engine, task, prompts, params).values())
    n = max(len(results), 1)
    errors = [e.error for e, _ in results if e.error is not None]
    return {
        "accuracy": sum(e.reward >= 1.0 for e, _ in results) / n,
        "n": len(results),
        "mean_len": sum(len(out.output_ids) for _, out in results) / n,
        "mean_turns": sum(len(e.turns) for e, _ in results) / n,
        **_tool_use([e for e, _ in results]),
        "reward_errors": sum(e.error is not None for e, _ in results),
        "env_errors": len(errors),
        **({"env_error": errors[0]} if errors else {}),
    }


def _tool_use(episodes: list[Any]) -> dict[str, float]:
    """Chat episodes (messages, tools): the share that attempted a tool call, and the share
    that had one answered without an error; nothing for text episodes."""
    from dorarl.tasks.episodes import EpisodeSource

    chat = [e for e in episodes if e.conversation is not None or isinstance(e.env, EpisodeSource)]
    if not chat:
        return {}
    n = len(episodes)
    return {
        "tool_use": sum(any(t.tool_calls for t in e.turns) for e in episodes) / n,
        "tool_served": sum(any(t.tool_calls > t.tool_errors for t in e.turns) for e in episodes)
        / n,
    }


def _requests(task: Task, prompts: list[Prompt], sampling: EvalSampling) -> dict[str, tuple]:
    from dorarl.engine import SamplingParams  # the engine package is heavy; import on use

    stops = list(task.stop_token_ids)
    greedy = SamplingParams(
        temperature=0.0, max_new_tokens=task.max_new_tokens, stop_token_ids=stops
    )
    requests: dict[str, tuple] = {_greedy_id(p): (p, greedy) for p in prompts}
    for p in prompts:
        for j in range(sampling.samples):
            params = SamplingParams(
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                max_new_tokens=task.max_new_tokens,
                stop_token_ids=stops,
                seed=sample_seed(sampling.seed, p.prompt_id, j),
            )
            requests[_sample_id(p, j)] = (p, params)
    return requests


def _greedy_id(prompt: Prompt) -> str:
    return f"eval-{prompt.prompt_id}"


def _sample_id(prompt: Prompt, index: int) -> str:
    return f"eval-{prompt.prompt_id}-s{index}"


def sample_seed(seed: int, prompt_id: int, index: int) -> int:
    """A 63-bit seed fixed by (run seed, prompt, sample index), the same at every version."""
    digest = hashlib.blake2b(f"{seed}:{prompt_id}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def _summarise(task: Task, results: list[tuple[Prompt, list[int]]]) -> dict[str, float]:
    n = len(results)
    scored = [(s.reward, s.error) for s in score_all(task, results)]
    lengths = [len(cut_at_stop(ids, task.stop_token_ids)) for _, ids in results]
    return {
        "accuracy": sum(r for r, _ in scored) / n if n else 0.0,
        "n": float(n),
        "mean_len": sum(lengths) / n if n else 0.0,
        "reward_errors": float(sum(e is not None for _, e in scored)),
    }


def _sampled_scores(
    task: Task, prompts: list[Prompt], sampled: list[list[list[int]]], greedy: dict[str, float]
) -> dict[str, float]:
    """mean@k (the mean reward of all samples) and pass@j (a sample with reward > 0)."""
    k = len(sampled[0]) if sampled else 0
    rewards, errors = [], 0
    for prompt, responses in zip(prompts, sampled, strict=True):
        scored = [(s.reward, s.error) for s in score_all(task, [(prompt, r) for r in responses])]
        rewards.append([r for r, _ in scored])
        errors += sum(e is not None for _, e in scored)
    n = len(prompts)
    out = {f"mean@{k}": sum(map(sum, rewards)) / (n * k) if n else 0.0}
    for j in pass_levels(k):
        hits = [pass_at_k(k, sum(r > 0 for r in rs), j) for rs in rewards]
        out[f"pass@{j}"] = sum(hits) / n if n else 0.0
    out["reward_errors"] = greedy["reward_errors"] + errors
    return out


def pass_levels(k: int) -> list[int]:
    """The pass@j reported for k samples: 2, 4, 8, .. below k, and k itself."""
    levels = [2**i for i in range(1, k.bit_length()) if 2**i < k]
    return [*levels, k]


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Unbiased pass@k from n samples of which `correct` are right (Chen et al., 2021)."""
    if not 0 <= correct <= n or not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n and 0 <= correct <= n (n={n}, c={correct})")
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)
