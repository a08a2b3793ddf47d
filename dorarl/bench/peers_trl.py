"""TRL's `GRPOTrainer` on a dorarl run's workload: our task's prompts in our dispatch order,
our scorer as its reward, the run's settings mapped onto `GRPOConfig`, weights saved at the
versions our evaluator scores. trl is the optional extra `.[peers]`, imported on use."""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dorarl.errors import UserInputError
from dorarl.jobs.config import TrainConfig
from dorarl.tasks import Prompt, Task
from dorarl.tasks.scoring import score_all

MISSING = "dorarl bench peers needs trl: pip install -e '.[peers]'"


def trl_missing() -> str | None:
    """The line naming what to install, or None when trl is importable."""
    return None if importlib.util.find_spec("trl") is not None else MISSING


def prompt_text(tokenizer: Any, ids: list[int]) -> str:
    """The text whose tokenization (as TRL tokenizes a plain prompt, the tokenizer's own
    special prefix added) is exactly `ids`."""
    text = tokenizer.decode(ids, skip_special_tokens=False)
    if tokenizer(text)["input_ids"] == ids:
        return text
    lead = tokenizer("")["input_ids"]  # what the tokenizer puts before any text itself
    if lead and ids[: len(lead)] == lead:
        text = tokenizer.decode(ids[len(lead) :], skip_special_tokens=False)
        if tokenizer(text)["input_ids"] == ids:
            return text
    raise UserInputError(f"model: its tokenizer does not give back prompt ids {ids[:8]}...")


@dataclass
class TaskReward:
    """Our task's scorer as a TRL reward function; counts the completion tokens it sees."""

    task: Task
    prompts: list[Prompt]
    tokens: int = 0
    errors: int = 0
    __name__ = "dorarl_task_reward"  # what TRL logs the reward as

    def __call__(self, prompts, completions, completion_ids, prompt_index, **_) -> list[float]:
        pairs = [
            (self.prompts[i], list(ids))
            for i, ids in zip(prompt_index, completion_ids, strict=True)
        ]
        scored = score_all(self.task, pairs)
        self.tokens += sum(len(ids) for ids in completion_ids)
        self.errors += sum(s.error is not None for s in scored)
        return [float(s.reward) for s in scored]


@dataclass
class TrlRecord:
    """What the TRL run saw and took: prompt ids per generation batch (one per group), the
    end time of each step, and the seconds spent saving weights (not the run's work)."""

    prompt_ids: list[list[list[int]]] = field(default_factory=list)
    step_end_s: list[float] = field(default_factory=list)
    save_s: float = 0.0


def grpo_config(train: TrainConfig, out: Path, bf16: bool) -> Any:
    """`GRPOConfig` with the run's settings: one optimizer step per tbs groups of G, on
    policy (one iteration), token-mean loss ("dapo"), constant lr, no dataset shuffle."""
    from trl import GRPOConfig

    loss, opt, s = train.trainer.loss, train.trainer, train.sampling
    return GRPOConfig(
        output_dir=str(out), max_steps=train.steps, seed=train.seed, use_cpu=True, bf16=bf16,
        per_device_train_batch_size=train.tbs * train.group_size, gradient_accumulation_steps=1,
        num_generations=train.group_size, num_iterations=1, shuffle_dataset=False,
        max_completion_length=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
        top_k=s.top_k, learning_rate=opt.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=opt.weight_decay, adam_beta1=opt.adam_beta1, adam_beta2=opt.adam_beta2,
        adam_epsilon=opt.adam_eps, max_grad_norm=opt.max_grad_norm,
        epsilon=loss.eps_low, epsilon_high=loss.eps_high, loss_type="dapo", beta=loss.kl_coef,
        scale_rewards="group" if loss.normalize_std else "none",
        save_strategy="no", report_to="none", logging_steps=1, disable_dropout=True,
        dataloader_num_workers=0,
    )  # fmt: skip


def run_trl(
    train: TrainConfig, task: Task, model_folder: str, out: Path, saves: list[int], bf16: bool
) -> tuple[dict[str, Any], TrlRecord]:
    """Train `train.steps` steps with TRL; weights at each step of `saves` go to
    out/step_NNNNN. Returns the timings and what TRL tokenized."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    prompts = task.train_prompts()
    used = [prompts[i % len(prompts)] for i in range(train.steps * train.tbs)]
    data = Dataset.from_dict(
        {
            "prompt": [prompt_text(tokenizer, p.prompt_ids) for p in used],
            "prompt_index": list(range(len(used))),
        }
    )
    model = AutoModelForCausalLM.from_pretrained(model_folder, dtype="float32")
    reward, record = TaskReward(task, used), TrlRecord()
    trainer = _trainer(train, task, model, tokenizer, data, reward, record, out, saves, bf16)
    first_save_s = _save(trainer, out, 0, saves)
    loop_start = time.monotonic()
    trainer.train()
    loop_end = time.monotonic()
    run_wall = loop_end - loop_start - record.save_s
    times = [loop_start, *record.step_end_s]
    return {
        "process_wall_s": loop_end - started - first_save_s - record.save_s,
        "run_wall_s": run_wall,
        "step_s": [b - a for a, b in zip(times[:-1], times[1:], strict=True)],
        "s_per_step": run_wall / train.steps,
        "tokens": reward.tokens,
        "tokens_per_s": reward.tokens / run_wall if run_wall > 0 else 0.0,
        "reward_errors": reward.errors,
        "reward_mean": [row["reward"] for row in trainer.state.log_history if "reward" in row],
        "save_s": first_save_s + record.save_s,
        "eos_token_ids": list(trainer.eos_token_ids),
    }, record


def _trainer(train, task, model, tokenizer, data, reward, record, out, saves, bf16) -> Any:
    """A `GRPOTrainer` that records the prompt ids it tokenizes and saves weights at `saves`."""
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    group = train.group_size

    class Recording(GRPOTrainer):
        def _tokenize_prompts(self, prompts: list):
            result = super()._tokenize_prompts(prompts)
            record.prompt_ids.append([list(ids) for ids in result[0][::group]])
            return result

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            record.step_end_s.append(time.monotonic() - record.save_s)
            record.save_s += _save(trainer, out, state.global_step, saves)

    trainer = Recording(
        model=model, reward_funcs=[reward], args=grpo_config(train, out, bf16),
        train_dataset=data, processing_class=tokenizer, callbacks=[Steps()],
    )  # fmt: skip
    stops = list(task.stop_token_ids)
    trainer.eos_token_ids = stops  # the task's stops end a completion, as in our engines
    trainer.generation_config.eos_token_id = stops
    trainer.generation_kwargs["eos_token_id"] = stops
    return trainer


def _save(trainer: Any, out: Path, step: int, saves: list[int]) -> float:
    """Save the weights of `step` (when wanted) as a model folder; the seconds it took."""
    if step not in saves:
        return 0.0
    started = time.monotonic()
    folder = step_folder(out, step)
    trainer.model.save_pretrained(folder)
    trainer.processing_class.save_pretrained(folder)
    return time.monotonic() - started


def step_folder(out: Path, step: int) -> Path:
    return out / f"step_{step:05d}"
