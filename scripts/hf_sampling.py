"""Reference sampling with Hugging Face `generate`, beside the script that needs it.

`train_base_model.py` measures the base model with it (greedy accuracy, pass@k) while
pre-training it, and tests/tasks/test_base_model.py cross-checks the shipped model with it
(pytest puts scripts/ on the path); RL rollouts go through `dorarl.engine`. Prompts are
left-padded into batches.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, PreTrainedModel

from dorarl.tasks.base import Prompt, Task, cut_at_stop


@torch.no_grad()
def hf_generate(
    model: PreTrainedModel,
    task: Task,
    prompts: list[Prompt],
    samples: int = 1,
    temperature: float = 0.0,
    batch_size: int = 256,
) -> list[list[list[int]]]:
    """`samples` responses per prompt (greedy when temperature is 0), each cut at its stop."""
    was_training = model.training
    model.eval()
    out: list[list[list[int]]] = []
    for start in range(0, len(prompts), batch_size):
        out += _generate_batch(
            model, task, prompts[start : start + batch_size], samples, temperature
        )
    model.train(was_training)
    return out


def _generate_batch(model, task, prompts, samples, temperature) -> list[list[list[int]]]:
    pad = task.tokenizer.pad_token_id
    width = max(len(p.prompt_ids) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p.prompt_ids) :] = torch.tensor(p.prompt_ids)
        mask[row, width - len(p.prompt_ids) :] = 1
    config = GenerationConfig(
        max_new_tokens=task.max_new_tokens,
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else None,
        # Explicit: generate() fills unset fields with its defaults, top_k=50 among them.
        top_k=0 if temperature > 0 else None,
        top_p=1.0 if temperature > 0 else None,
        num_return_sequences=samples,
        eos_token_id=task.stop_token_ids,
        pad_token_id=pad,
    )
    result = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    responses = [cut_at_stop(r[width:].tolist(), task.stop_token_ids) for r in result]
    return [responses[i * samples : (i + 1) * samples] for i in range(len(prompts))]


def accuracy_and_pass_at_k(
    model: PreTrainedModel, task: Task, prompts: list[Prompt], k: int = 8, temperature: float = 1.0
) -> dict[str, float]:
    """Greedy accuracy, mean sampled accuracy and pass@k (k samples at `temperature`)."""
    greedy = hf_generate(model, task, prompts)
    sampled = hf_generate(model, task, prompts, samples=k, temperature=temperature)
    greedy_hits = [task.reward(p, g[0]) > 0 for p, g in zip(prompts, greedy, strict=True)]
    hits = [[task.reward(p, r) > 0 for r in rs] for p, rs in zip(prompts, sampled, strict=True)]
    n = len(prompts)
    return {
        "greedy_accuracy": sum(greedy_hits) / n,
        "sample_accuracy": sum(sum(h) for h in hits) / (n * k),
        f"pass@{k}": sum(any(h) for h in hits) / n,
    }
