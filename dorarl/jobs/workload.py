"""What a training run trains on and samples: the task built from the `task.*` keys with the
run's limits (context, response cap), the sampling settings of rollout and evaluation,
trajectory texts. The checks made before a run starts are `dorarl.jobs.preflight`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dorarl.data import Sample
from dorarl.errors import UserInputError
from dorarl.jobs.config import TaskSection, TrainConfig
from dorarl.runtime.rollout import RolloutSettings
from dorarl.tasks import Task, make_task
from dorarl.tasks.agent import AgentTask, load_agent
from dorarl.tasks.env import load_env_class
from dorarl.tasks.env_task import DEFAULT_MAX_TURNS, EnvTask
from dorarl.tasks.evaluate import EvalSampling
from dorarl.tasks.model_files import load_tokenizer
from dorarl.tasks.reward_model import (
    DEFAULT_RUBRIC,
    RewardModelSpec,
    check_folder,
    check_rubric,
)
from dorarl.tasks.user_rewards import Rewards, RewardSpec, is_user_reward, parse_reward_specs


def build_task(config: TrainConfig, model_folder: str) -> Task:
    """The task `config.task` names, tokenized with `model_folder`'s tokenizer; with
    `task.env` (or `task.agent`), its prompts played as episodes of that environment (agent)."""
    name, options = task_options(config)
    section = config.task
    if section.agent is not None and section.env is not None:
        raise UserInputError("task.agent: an episode is an env's or an agent's; set one")
    tokenizer = model_folder if name in CHAT_TASKS else load_tokenizer(model_folder)[0]
    task = make_task(name, tokenizer=tokenizer, **options)
    rewards = user_rewards(section)
    if rewards is not None:
        if getattr(task, "multi_turn", False) or section.agent or section.env:
            raise UserInputError(
                f"{rewards.key}: a reward of your own scores single-turn tasks; "
                "a multi-turn task's reward is its env's"
            )
        task.user_rewards = rewards
    multi_turn = getattr(task, "multi_turn", False) or section.agent or section.env
    if section.reward_model is not None and multi_turn:
        raise UserInputError(
            "task.reward_model: a reward model scores single-turn tasks; a multi-turn task's "
            "reward is its env's"
        )
    max_turns = section.max_turns or getattr(task, "max_turns", 0) or DEFAULT_MAX_TURNS
    if section.agent is not None:
        load_agent(section.agent)  # checked before anything starts
        return AgentTask(
            task, section.agent, max_turns, section.env_timeout_s, section.agent_host,
            section.max_segments,
        )  # fmt: skip
    if section.env is None:
        return task
    env_class = load_env_class(section.env)
    return EnvTask(task, env_class, max_turns, section.env_timeout_s)


def reward_specs(section: TaskSection) -> tuple[list[RewardSpec], str] | None:
    """The users' rewards the keys name and the key that names them (None: the task's own
    reward, or the built-in `task.reward` names)."""
    if section.name == "code":
        if section.rewards is not None:
            raise UserInputError("task.rewards: the code task's reward is its tests (task.reward)")
        return None
    if section.rewards is not None:
        if section.reward is not None:
            raise UserInputError("task.rewards: set task.reward or task.rewards, not both")
        return parse_reward_specs(section.rewards), "task.rewards"
    if section.reward is not None and is_user_reward(section.reward):
        return [RewardSpec(section.reward)], "task.reward"
    return None


def user_rewards(section: TaskSection) -> Rewards | None:
    """The run's rewards of `reward_specs`, loaded and checked (None: the task's own)."""
    named = reward_specs(section)
    return None if named is None else Rewards(named[0], section.reward_timeout_s, named[1])


def reward_model_spec(section: TaskSection) -> RewardModelSpec | None:
    """The run's reward model (`task.reward_model`), its folder checked (None: none)."""
    if section.reward_model is None:
        return None
    check_folder(section.reward_model, section.reward_model_kind)
    return RewardModelSpec(
        section.reward_model, section.reward_model_kind, section.reward_mix,
        section.reward_model_gpus, section.reward_model_timeout_s, section.reward_model_batch,
        check_rubric(section.reward_model_rubric or DEFAULT_RUBRIC),
    )  # fmt: skip


CHAT_TASKS = ("jsonl", "arith", "calculator", "code")
"""Tasks that render chat messages: they load the tokenizer (its chat template, its context)
from the model folder themselves and take a system prompt and the run's context; the others
take a loaded tokenizer."""


def task_options(config: TrainConfig) -> tuple[str, dict[str, Any]]:
    """The task `config.task` names and its options from the run's keys (all but the
    tokenizer): the run's seed, limits (context, response cap) and the task's own keys."""
    section, cap = config.task, config.sampling.max_new_tokens
    options: dict[str, Any] = {"seed": config.seed}
    if section.name in CHAT_TASKS:
        options |= {
            "max_model_len": config.engine.max_model_len,
            "system_prompt": section.system_prompt,
        }
    if section.name in ("arith", "calculator"):
        options |= _operand_range(section) | ({"max_new_tokens": cap} if cap else {})
    if section.name in ("multiturn_sum", "calculator"):
        options |= {"latency_s": section.env_latency_s, "timeout_s": section.env_timeout_s}
    if section.name == "multiturn_sum":
        options["max_turns"] = section.max_turns
    if section.name == "calculator":
        options |= {
            "demonstration": section.demonstration,
            "ops": tuple(section.ops),
            "min_factor": section.min_factor,
            "max_factor": section.max_factor,
            **({"max_turns": section.max_turns} if section.max_turns else {}),
        }
    if section.name == "jsonl":
        options |= {
            "split": section.split,
            "eval_split": section.eval_split,
            "format": section.format,
            "prompt_template": section.prompt_template,
            "reward": section.resolved_reward(),
        }
    if section.name in ("jsonl", "code"):
        options |= {
            "path": section.path,
            "eval_path": section.eval_path,
            "eval_fraction": section.eval_fraction,
            "max_new_tokens": cap or config.engine.max_model_len // 2,
            "chat_template": section.chat_template,
            "shuffle": section.shuffle,
        }
    if section.name == "code":
        options |= {
            "reward": section.reward,
            "sandbox": section.sandbox,
            "test_timeout_s": section.test_timeout_s,
            "demonstration": section.demonstration,
        }
    return section.name, options


def _operand_range(section: Any) -> dict[str, int]:
    """task.min_value and task.max_value where set (None: the task's own range)."""
    keys = ("min_value", "max_value")
    return {k: getattr(section, k) for k in keys if getattr(section, k) is not None}


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


def trajectory_texts(task: Task) -> Callable[[Sample], dict[str, Any]]:
    """A sample's prompt, reference answer and response (up to its stop token) as text; an
    episode's prompt as the model saw it (system prompt, chat template and first observation
    included) and each of its turns: the model's reply, then the observation after it."""
    prompts = {p.prompt_id: p for p in task.train_prompts()}

    def texts(sample: Sample) -> dict[str, Any]:
        prompt = prompts[sample.prompt_id]
        if sample.turns:
            seen = _decoded(task, sample.prompt_ids)
            return {
                "prompt": seen,
                "answer": prompt.answer,
                "turn_texts": episode_turns(task, sample),
            }
        response = task.response_text(sample.response_ids)
        return {"prompt": prompt.text, "answer": prompt.answer, "response": response}

    return texts


def episode_turns(task: Task, sample: Sample) -> list[dict[str, str]]:
    """An episode's turns as text, cut where its tokens change hands (`sample.observed`
    marks the environment's): {"reply": what the model sampled, stop token included,
    "observation": what it was shown next ("" after the last turn)}; a turn after which
    the agent opened a new segment has that segment's prompt as "new_segment" instead."""
    runs: list[tuple[int, bool, list[int]]] = []
    for i, (token, observed) in enumerate(zip(sample.response_ids, sample.observed, strict=True)):
        if runs and runs[-1][1] == observed:
            runs[-1][2].append(token)
        else:
            runs.append((i, observed, [token]))
    starts = {s.at for s in sample.segments}
    turns: list[dict[str, str]] = []
    for at, observed, ids in runs:
        if observed and turns:
            turns[-1]["new_segment" if at in starts else "observation"] = _decoded(task, ids)
        else:
            turns.append({"reply": _decoded(task, ids), "observation": ""})
    return turns


def _decoded(task: Task, ids: list[int]) -> str:
    """Token ids as the model reads them: special tokens (the template's) kept."""
    return task.tokenizer.decode(ids, skip_special_tokens=False)


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
