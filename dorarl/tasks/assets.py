"""Where the shipped base models live: `assets/base_model/` (running_sum),
`assets/multiturn_base/` (multiturn_sum, fine-tuned from it by scripts/train_multiturn_base.py)
and `assets/moe_base/` (running_sum, a Mixtral upcycled from the base by
scripts/upcycle_base_model.py: `model=assets/moe_base`); the code task's problems
`assets/code/problems.jsonl`."""

from __future__ import annotations

from pathlib import Path

from dorarl.errors import UserInputError

ASSETS = Path(__file__).resolve().parents[2] / "assets"
BASE_MODEL_DIR = ASSETS / "base_model"
MULTITURN_BASE_DIR = ASSETS / "multiturn_base"
MOE_BASE_DIR = ASSETS / "moe_base"
CODE_PROBLEMS = ASSETS / "code" / "problems.jsonl"  # scripts/make_code_problems.py


def shipped_base_model(task_name: str = "running_sum") -> Path:
    """The shipped base model folder for a task; a clear error if this install lacks it."""
    folder, script = BASE_MODEL_DIR, "train_base_model.py"
    if task_name == "multiturn_sum":
        folder, script = MULTITURN_BASE_DIR, "train_multiturn_base.py"
    if not (folder / "config.json").exists():
        raise UserInputError(
            f"shipped base model not found at {folder}; run scripts/{script} or pass a model folder"
        )
    return folder
