"""RL tasks: prompts, verifiable rewards, held-out sets and their tokenizer."""

from dorarl.tasks.arith import ArithConfig, ArithTask
from dorarl.tasks.base import Prompt, Task, cut_at_stop
from dorarl.tasks.evaluate import evaluate
from dorarl.tasks.jsonl import JsonlTask
from dorarl.tasks.registry import TASK_NAMES, make_task
from dorarl.tasks.running_sum import RunningSumConfig, RunningSumTask
from dorarl.tasks.scoring import score

__all__ = [
    "ArithConfig",
    "ArithTask",
    "TASK_NAMES",
    "JsonlTask",
    "Prompt",
    "RunningSumConfig",
    "RunningSumTask",
    "Task",
    "cut_at_stop",
    "evaluate",
    "make_task",
    "score",
]
