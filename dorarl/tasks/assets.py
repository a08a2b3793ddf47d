"""Where the shipped base model lives (repository `assets/base_model/`)."""

from __future__ import annotations

from pathlib import Path

from dorarl.errors import UserInputError

BASE_MODEL_DIR = Path(__file__).resolve().parents[2] / "assets" / "base_model"


def shipped_base_model() -> Path:
    """The shipped base model folder; a clear error if this install does not have it."""
    if not (BASE_MODEL_DIR / "config.json").exists():
        raise UserInputError(
            f"shipped base model not found at {BASE_MODEL_DIR}; run scripts/train_base_model.py "
            "or pass a model folder"
        )
    return BASE_MODEL_DIR
