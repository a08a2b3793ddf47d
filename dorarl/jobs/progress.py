"""Live progress of a training run (rich): steps done, reward, throughput, held-out accuracy."""

from __future__ import annotations

from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class TrainProgress:
    def __init__(self, total_steps: int, enabled: bool = True) -> None:
        self.enabled = enabled
        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
            disable=not enabled,
        )
        self._task = self._progress.add_task("starting Ray and the actors", total=total_steps)

    def __enter__(self) -> TrainProgress:
        self._progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._progress.__exit__(*exc)

    def update(self, row: dict[str, Any], accuracy: dict[int, float]) -> None:
        text = (
            f"reward {row['reward_mean']:.3f}  {row['tokens_per_s']:.0f} tok/s  "
            f"step {row['step_time_s']:.1f}s  staleness {row['staleness']}"
        )
        if accuracy:
            last = max(accuracy)
            text += f"  eval v{last}: {accuracy[last]:.3f}"
        self._progress.update(self._task, advance=1, description=text)

    def note(self, text: str) -> None:
        self._progress.update(self._task, description=text)
