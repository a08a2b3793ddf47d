"""Held-out accuracy: greedy decoding through a rollout engine, scored by the task.

Invariant: evaluation needs an idle engine (it drains every request it sees), so it runs
between training steps; the engine's weights and version are left as they were.
"""

from __future__ import annotations

from typing import Any

from dorarl.tasks.base import Prompt, Task, cut_at_stop
from dorarl.tasks.scoring import score


def evaluate(
    engine: Any, task: Task, prompts: list[Prompt] | None = None, max_prompts: int | None = None
) -> dict[str, float]:
    """{"accuracy", "n", "mean_len", "reward_errors"} over `prompts` (default: the eval set)."""
    from dorarl.engine import SamplingParams  # the engine package is heavy; import on use

    if engine.has_unfinished():
        raise ValueError("evaluate needs an idle engine (it would swallow other requests)")
    prompts = list(task.eval_prompts() if prompts is None else prompts)[:max_prompts]
    params = SamplingParams(
        temperature=0.0,
        max_new_tokens=task.max_new_tokens,
        stop_token_ids=list(task.stop_token_ids),
    )
    by_id = {f"eval-{p.prompt_id}": p for p in prompts}
    for request_id, prompt in by_id.items():
        engine.add_request(request_id, prompt.prompt_ids, params)
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out.output_ids
    return _summarise(task, [(by_id[rid], ids) for rid, ids in outputs.items()])


def _summarise(task: Task, results: list[tuple[Prompt, list[int]]]) -> dict[str, float]:
    n = len(results)
    scored = [score(task, p, ids) for p, ids in results]
    lengths = [len(cut_at_stop(ids, task.stop_token_ids)) for _, ids in results]
    return {
        "accuracy": sum(r for r, _ in scored) / n if n else 0.0,
        "n": float(n),
        "mean_len": sum(lengths) / n if n else 0.0,
        "reward_errors": float(sum(e is not None for _, e in scored)),
    }
