"""What a training run samples: its task, its sampling settings, the text of its trajectories."""

from __future__ import annotations

from collections.abc import Callable

from dorarl.data import Sample
from dorarl.jobs.config import TrainConfig
from dorarl.runtime.rollout import RolloutSettings
from dorarl.tasks import Task, make_task


def build_task(config: TrainConfig, model_folder: str) -> Task:
    """The task `config.task` names, tokenized with `model_folder`'s tokenizer."""
    section = config.task
    if section.name == "jsonl":
        return make_task(
            "jsonl",
            path=section.path,
            eval_path=section.eval_path,
            reward=section.reward,
            tokenizer=model_folder,
            seed=config.seed,
            max_new_tokens=config.sampling.max_new_tokens or config.engine.max_model_len // 2,
            max_model_len=config.engine.max_model_len,
            chat_template=section.chat_template,
        )
    if section.name == "arith":
        cap = config.sampling.max_new_tokens
        return make_task(
            "arith",
            tokenizer=model_folder,
            seed=config.seed,
            min_value=section.min_value,
            max_value=section.max_value,
            system_prompt=section.system_prompt,
            max_model_len=config.engine.max_model_len,
            **({"max_new_tokens": cap} if cap else {}),
        )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    return make_task(section.name, seed=config.seed, tokenizer=tokenizer)


def rollout_settings(config: TrainConfig, task: Task) -> RolloutSettings:
    """The sampling knobs of `config` with the task's response cap and stop tokens."""
    s = config.sampling
    return RolloutSettings(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        max_new_tokens=s.max_new_tokens or task.max_new_tokens,
        stop_token_ids=list(task.stop_token_ids),
        seed=config.seed,
        forced_lengths=config.forced_lengths.dist() if config.forced_lengths.enabled else None,
    )


def trajectory_texts(task: Task) -> Callable[[Sample], dict[str, str]]:
    """A sample's prompt, reference answer and response (up to its stop token) as text."""
    prompts = {p.prompt_id: p for p in task.train_prompts()}

    def texts(sample: Sample) -> dict[str, str]:
        prompt = prompts[sample.prompt_id]
        response = task.response_text(sample.response_ids)
        return {"prompt": prompt.text, "answer": prompt.answer, "response": response}

    return texts
