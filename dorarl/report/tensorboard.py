"""Mirror per-step metrics into TensorBoard (and Weights & Biases when enabled and installed),
each under its group: train/, rollout/, eval/ or system/ (dorarl.report.metric_groups)."""

from __future__ import annotations

import logging
import numbers
from pathlib import Path
from typing import Any

from dorarl.report.metric_groups import grouped_tag
from dorarl.run_layout import RunFolder

log = logging.getLogger(__name__)


def flatten_scalars(row: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Nested metric dicts become `a/b` scalar tags; non-numeric values are skipped."""
    scalars: dict[str, float] = {}
    for key, value in row.items():
        tag = f"{prefix}{key}"
        if isinstance(value, dict):
            scalars.update(flatten_scalars(value, f"{tag}/"))
        elif isinstance(value, numbers.Real) and not isinstance(value, bool):
            scalars[tag] = float(value)
    return scalars


class ScalarLogger:
    """Writes each metrics row as scalars at its step, tagged `group/name`; `close()`
    flushes."""

    def __init__(self, out_dir: str | Path, use_wandb: bool = False, run_name: str = "") -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._tb = SummaryWriter(log_dir=str(RunFolder(out_dir).tensorboard))
        self._wandb = _start_wandb(run_name) if use_wandb else None

    def log(self, row: dict[str, Any]) -> None:
        step = int(row.get("step", 0))
        flat = flatten_scalars({k: v for k, v in row.items() if k != "step"})
        scalars = {grouped_tag(name): value for name, value in flat.items()}
        for tag, value in scalars.items():
            self._tb.add_scalar(tag, value, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _start_wandb(run_name: str) -> Any:
    try:
        import wandb
    except ImportError:
        log.warning("wandb=true but wandb is not installed; logging to TensorBoard only")
        return None
    return wandb.init(project="dorarl", name=run_name or None)
