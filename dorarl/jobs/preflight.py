"""Every check a run makes before anything starts, in one function that `dorarl train` and
`dorarl train --print-config` both call: every problem found, one line each, exit 2.

Checked: the model folder (a model the engine runs, the fast paths its heads allow, its
tokenizer), the task's keys (`task.env` and `task.agent` import, `task.reward` and
`task.rewards` are built-in rewards or import as functions that take a reward's arguments,
`task.reward_model` is a folder of a classifier or a causal LM with safetensors weights,
the data files, data set folders or cached data sets exist), then the task itself built as
the run builds it (its data rows, each
prompt against `engine.max_model_len`). A task key found wrong is left out of that build,
so the data are checked all the same. Starting actors and placing them on the cluster are
the run's alone.
"""

from __future__ import annotations

import dataclasses

from dorarl.config.problems import Problems
from dorarl.errors import UserInputError
from dorarl.jobs.config import TaskSection, TrainConfig
from dorarl.jobs.engine_plan import check_engines, model_folder, model_spec
from dorarl.jobs.resume import ResumePoint
from dorarl.jobs.workload import build_task, reward_model_spec, user_rewards
from dorarl.tasks import Task
from dorarl.tasks.agent import load_agent
from dorarl.tasks.env import load_env_class
from dorarl.tasks.hf_datasets import DataSource, missing_problem
from dorarl.tasks.model_files import load_tokenizer
from dorarl.tasks.rewards import REWARDS


def check_run(config: TrainConfig, point: ResumePoint | None) -> Task:
    """Run every check; raise every problem found together (one: itself; several:
    `ManyProblems`, one line each). Returns the task, built as the run uses it."""
    problems = Problems()
    problems.check(config.check_response_cap)  # the context as it follows the model
    folder = model_folder(config, point)
    read = problems.check(model_spec, folder, config.engine.backend)
    tokenizer = None
    if read is not None:
        problems.check(check_engines, config, *read)
        tokenizer = problems.check(load_tokenizer, folder)
    section = _checked_task_keys(config.task, problems)
    task = None
    if tokenizer is not None and section is not None:
        checked = config if section == config.task else dataclasses.replace(config, task=section)
        with problems.collecting():
            task = build_task(checked, folder)
    problems.raise_any()
    assert task is not None  # no problem: it was built
    return task


def _checked_task_keys(section: TaskSection, problems: Problems) -> TaskSection | None:
    """The task's keys checked; the section with each key found wrong unset (the format's
    reward, no env, no agent), or None when its data cannot be read (a missing file)."""
    wrong: dict[str, None] = {}
    if section.env is not None and problems.check(load_env_class, section.env) is None:
        wrong["env"] = None
    if section.agent is not None and problems.check(load_agent, section.agent) is None:
        wrong["agent"] = None
    if _user_named(section) and problems.check(user_rewards, section) is None:
        wrong |= {"reward": None, "rewards": None}
    if section.reward_model is not None and problems.check(reward_model_spec, section) is None:
        wrong["reward_model"] = None
    if section.name == "jsonl":
        given = (("task.path", section.path), ("task.eval_path", section.eval_path))
        sources = [DataSource(value, key) for key, value in given if value is not None]
        missing = [p for p in map(missing_problem, sources) if p is not None]
        for line in missing:
            problems.add(UserInputError(line))
        if missing:
            return None
    return dataclasses.replace(section, **wrong)


def _user_named(section: TaskSection) -> bool:
    """Whether the reward keys name a reward of the user's (what `user_rewards` loads)."""
    return section.rewards is not None or section.reward not in (None, *REWARDS)
