"""`task.*` of `dorarl train`: what the run trains on (the task, its data files, rewards,
environments, agents and the code sandbox), as `TrainConfig`'s task section."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(kw_only=True)
class TaskSection:
    name: str = field(
        default="running_sum",
        metadata={"help": "running_sum | jsonl | arith | multiturn_sum | calculator | code"},
    )
    path: str | None = field(
        default=None,
        metadata={
            "help": "jsonl, code: data file (.jsonl, or .parquet with .[data]), a datasets "
            "save_to_disk folder, or a data set's name in the datasets cache (with .[data]); "
            "code: None for the shipped problems, assets/code/problems.jsonl",
            "path": True,
            "or_name": True,
        },
    )
    split: str | None = field(
        default=None,
        metadata={"help": "jsonl: the split of a data set in task.path (None: its only one)"},
    )
    eval_path: str | None = field(
        default=None,
        metadata={
            "help": "jsonl: held-out file, folder or cached data set (None: split off the data)",
            "path": True,
            "or_name": True,
        },
    )
    eval_split: str | None = field(
        default=None,
        metadata={"help": "jsonl: the split of a data set in task.eval_path (None: its only one)"},
    )
    eval_fraction: float = field(
        default=0.1,
        metadata={"help": "jsonl, code: the share of the rows held out (drawn from seed) when "
                  "task.eval_path is not given", "ge": 0, "lt": 1},
    )  # fmt: skip
    format: Literal["prompt_answer", "gsm8k", "math"] = field(
        default="prompt_answer",
        metadata={
            "help": "jsonl rows: prompt_answer {prompt, answer}; gsm8k {question, answer "
            "ending in '#### N'}; math {problem, solution with the answer in \\boxed{}}"
        },
    )
    prompt_template: str | None = field(
        default=None,
        metadata={
            "help": "jsonl: the prompt as a Python format string over the row's fields, e.g. "
            "'{question} Put the final answer in \\boxed{{}}.' (None: the question field)"
        },
    )
    reward: str | None = field(
        default=None,
        metadata={
            "help": "exact | math (jsonl), or 'module:function', a reward of your own from the "
            "Python path or the working directory (docs/models-and-data.md) (None: math for "
            "gsm8k and math rows, exact for prompt_answer; arith: always the final answer; "
            "code: tests, the share of tests passed, or all_tests, 1 only when all pass)"
        },
    )
    rewards: list[dict[str, Any]] | str | None = field(
        default=None,
        metadata={
            "help": "several rewards, weighted: a list of {fn: NAME or module:function, "
            "weight: W}, or 'mod:f*0.5,math*1'; the reward is their weighted sum (in place "
            "of task.reward)"
        },
    )
    reward_timeout_s: float = field(
        default=30.0,
        metadata={
            "help": "task.reward=module:function: seconds one call may take (past it: reward 0, "
            "counted in reward_errors)",
            "gt": 0,
        },
    )
    reward_model: str | None = field(
        default=None,
        metadata={
            "help": "a local HF folder (safetensors) of a reward model: a sequence classifier "
            "of one label (its logit the score) or a causal-LM judge; scored on its own actor",
            "path": True,
        },
    )
    reward_model_kind: Literal["auto", "classifier", "judge"] = field(
        default="auto",
        metadata={"help": "task.reward_model: classifier, judge (rubric prompt, the first "
                  "number it writes), or auto (from config.json's architecture)"},
    )  # fmt: skip
    reward_mix: float = field(
        default=1.0,
        metadata={
            "help": "task.reward_model: its score's weight in the reward; the task's reward "
            "(verifier) weighs 1 - mix (0: the model's score recorded only)",
            "ge": 0,
            "le": 1,
        },
    )
    reward_model_gpus: float = field(
        default=0.0,
        metadata={"help": "task.reward_model: GPUs of its actor (0: the CPU)", "ge": 0},
    )
    reward_model_timeout_s: float = field(
        default=60.0,
        metadata={
            "help": "task.reward_model: seconds one batch may take (past it the actor is "
            "replaced and the batch scored again)",
            "gt": 0,
        },
    )
    reward_model_batch: int = field(
        default=64, metadata={"help": "task.reward_model: samples per batch at most", "ge": 1}
    )
    reward_model_rubric: str | None = field(
        default=None,
        metadata={"help": "task.reward_model judge: the prompt, with {prompt} and {response} "
                  "(None: a 0-to-1 rubric)"},
    )  # fmt: skip
    chat_template: bool = field(
        default=False, metadata={"help": "jsonl: render prompts through the chat template"}
    )
    shuffle: bool = field(
        default=True,
        metadata={"help": "jsonl, code: train on the rows in an order drawn from seed (false: "
                  "the file's order)"},
    )  # fmt: skip
    min_value: int | None = field(
        default=None,
        metadata={"help": "arith, calculator: smallest operand (None: arith 1, calculator 100)"},
    )
    max_value: int | None = field(
        default=None,
        metadata={"help": "arith, calculator: largest operand (None: arith 99, calculator 999)"},
    )
    min_factor: int = field(
        default=11, metadata={"help": "calculator: smallest second factor of a product"}
    )
    max_factor: int = field(
        default=99, metadata={"help": "calculator: largest second factor of a product"}
    )
    ops: list[str] = field(
        default_factory=lambda: ["add", "subtract", "multiply"],
        metadata={"help": "calculator: the operations asked, of add, subtract, multiply"},
    )
    demonstration: bool = field(
        default=True,
        metadata={
            "help": "calculator: one worked exchange (a call, its result, the answer) "
            "before the question; code with chat_template: one solved problem before it"
        },
    )
    system_prompt: str | None = field(
        default=None,
        metadata={
            "help": "arith, calculator, and jsonl with chat_template: system message (None: the "
            "template's own; calculator: its own, which describes the tool)"
        },
    )

    env: str | None = field(
        default=None,
        metadata={
            "help": "multi-turn: 'module:Class', a dorarl.tasks.env.Env or ChatEnv subclass "
            "(the module from the Python path or the working directory); the task's prompts "
            "become episodes and the env gives the reward (None: the task's own)"
        },
    )
    agent: str | None = field(
        default=None,
        metadata={
            "help": "multi-turn: 'module:function', an async agent(client, prompt) -> reward that "
            "calls the model through an OpenAI client (docs/environments.md)"
        },
    )
    agent_host: str = field(
        default="127.0.0.1",
        metadata={
            "help": "task.agent: the address the OpenAI endpoint binds (a free port); off "
            "loopback, every call needs the run's bearer token (handed to the agent's client)"
        },
    )
    max_turns: int = field(
        default=0,
        metadata={
            "help": "multi-turn: turns per episode at most (0: the task's own; 8 for a task "
            "without one, as jsonl and arith; calculator's is 4)",
            "ge": 0,
        },
    )
    max_segments: int = field(
        default=8,
        metadata={
            "help": "task.agent: conversations per episode at most (a call that does not extend "
            "the last one opens another; one past the bound gets HTTP 400, code max_segments)",
            "ge": 1,
        },
    )
    env_timeout_s: float = field(
        default=30.0,
        metadata={"help": "multi-turn: timeout of one env call (reset or step)", "gt": 0},
    )
    env_latency_s: float = field(
        default=0.0,
        metadata={
            "help": "multiturn_sum, calculator: simulated tool latency per env step (tool call)",
            "ge": 0,
        },
    )
    sandbox: Literal["bwrap", "unsafe_rlimits_only"] = field(
        default="bwrap",
        metadata={
            "help": "code: how model-written programs run: bwrap (bubblewrap namespaces: no "
            "network, no file of yours; refused where it cannot), or unsafe_rlimits_only "
            "(limits only: a program can read your files and reach the network)"
        },
    )
    test_timeout_s: float = field(
        default=6.0,
        metadata={
            "help": "code: wall seconds one program gets on one test (its CPU seconds too)",
            "gt": 0,
        },
    )

    def resolved_reward(self) -> str:
        """The built-in reward the jsonl task scores with: the key's, else what the rows'
        format calls for (users' rewards, when given, score in its place)."""
        if self.reward in ("exact", "math"):
            return self.reward
        return "exact" if self.format == "prompt_answer" else "math"
