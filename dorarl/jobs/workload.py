"""What a training run trains on and samples, checked before anything starts: the model
folder, the task, the sampling settings of rollout and evaluation, trajectory texts.

`build_task` first reads the model folder's config as the engine will (an unsupported
model_type, RoPE or attention layout stops the run in one line, exit 2, before Ray starts),
then builds the task from the `task.*` keys with the run's limits (context, response cap).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from dorarl.data import Sample
from dorarl.engine.model_spec import read_hf_config, spec_from_hf
from dorarl.errors import UserInputError
from dorarl.jobs.config import TrainConfig
from dorarl.runtime.rollout import RolloutSettings
from dorarl.tasks import Task, make_task
from dorarl.tasks.agent import AgentTask, load_agent
from dorarl.tasks.env import load_env_class
from dorarl.tasks.env_task import DEFAULT_MAX_TURNS, EnvTask
from dorarl.tasks.evaluate import EvalSampling


def check_model_folder(model_folder: str) -> None:
    """Raise UserInputError unless the engine supports the folder's model (the trainer,
    transformers' own class for it, loads anything the engine does)."""
    where = str(Path(model_folder) / "config.json")
    spec_from_hf(read_hf_config(model_folder), where)


def build_task(config: TrainConfig, model_folder: str) -> Task:
    """The task `config.task` names, tokenized with `model_folder`'s tokenizer; with
    `task.env` (or `task.agent`), its prompts played as episodes of that environment (agent)."""
    task = _named_task(config, model_folder)
    section = config.task
    max_turns = section.max_turns or getattr(task, "max_turns", 0) or DEFAULT_MAX_TURNS
    if section.agent is not None:
        if section.env is not None:
            raise UserInputError("task.agent: an episode is an env's or an agent's; set one")
        load_agent(section.agent)  # checked before anything starts
        return AgentTask(task, section.agent, max_turns, section.env_timeout_s, section.agent_host)
    if section.env is None:
        return task
    env_class = load_env_class(section.env)
    return EnvTask(task, env_class, max_turns, section.env_timeout_s)


def _named_task(config: TrainConfig, model_folder: str) -> Task:
    check_model_folder(model_folder)
    section = config.task
    if section.name == "multiturn_sum":
        from transformers import AutoTokenizer

        return make_task(
            "multiturn_sum",
            seed=config.seed,
            tokenizer=AutoTokenizer.from_pretrained(model_folder),
            latency_s=section.env_latency_s,
            timeout_s=section.env_timeout_s,
            max_turns=section.max_turns,
        )
    if section.name == "jsonl":
        return make_task(
            "jsonl",
            path=section.path,
            eval_path=section.eval_path,
            format=section.format,
            prompt_template=section.prompt_template,
            reward=section.resolved_reward(),
            tokenizer=model_folder,
            seed=config.seed,
            max_new_tokens=config.sampling.max_new_tokens or config.engine.max_model_len // 2,
            max_model_len=config.engine.max_model_len,
            chat_template=section.chat_template,
            system_prompt=section.system_prompt,
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
        stop_strings=list(getattr(task, "stop_strings", [])),
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


def eval_sampling(config: TrainConfig) -> EvalSampling:
    """`eval.samples` responses per held-out prompt, at the run's own sampling settings."""
    s = config.sampling
    return EvalSampling(
        samples=config.eval.samples,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=config.seed,
    )
