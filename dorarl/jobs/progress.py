"""Live progress of a training run: steps done, ETA, reward, throughput, staleness, and the
newest evaluation (greedy accuracy; mean@k and pass@k when it sampled).

On a terminal a rich progress bar (log records print above it through the same console);
otherwise (a log file, CI) one plain line every `plain_every(total)` steps and at the last.
"""

from __future__ import annotations

import time
from typing import Any

from rich import get_console
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from dorarl.jobs.evaluation import format_scores, version_label

BARS = "▁▂▃▄▅▆▇█"


def staleness_histogram(counts: dict[str, int]) -> str:
    """Groups per staleness as one bar per level from 0 to the largest, then the counts:
    {"0": 12, "1": 4} -> "█▃ 0:12 1:4"."""
    levels = {int(k): int(v) for k, v in counts.items()}
    if not levels:
        return "-"
    top = max(levels.values()) or 1
    bars = "".join(
        BARS[min(len(BARS) - 1, round(levels.get(s, 0) / top * (len(BARS) - 1)))]
        if levels.get(s, 0)
        else " "
        for s in range(max(levels) + 1)
    )
    return f"{bars} " + " ".join(f"{s}:{n}" for s, n in sorted(levels.items()))


def plain_every(total_steps: int) -> int:
    """About twenty plain lines per run, at least one per step for short runs."""
    return max(1, total_steps // 20)


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


class TrainProgress:
    def __init__(
        self, total_steps: int, enabled: bool = True, console: Console | None = None
    ) -> None:
        self.enabled = enabled
        self.total = total_steps
        self.console = console or get_console()  # the console log records go to
        self.live = enabled and self.console.is_terminal
        self.done = 0
        self._started = time.monotonic()
        self._first_step_at: float | None = None
        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.description}"),
            console=self.console,
            disable=not self.live,
        )
        self._task = self._progress.add_task("starting Ray", total=total_steps)
        self._stopped = False

    def __enter__(self) -> TrainProgress:
        self._progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> None:
        """End the live bar (once; later lines print below it)."""
        if not self._stopped:
            self._stopped = True
            self._progress.stop()

    def say(self, text: str) -> None:
        """A line of its own, with or without progress (above a live bar)."""
        self.console.print(text, highlight=False, soft_wrap=True)

    def phase(self, text: str) -> None:
        """What is under way, in a live bar's description (plain output says it by lines)."""
        self._progress.update(self._task, description=text)

    def update(
        self, row: dict[str, Any], evaluations: dict[int, dict[str, Any]], flag: str = ""
    ) -> None:
        """One step done (`row`: its metrics); `evaluations`: those finished, by version;
        `flag`: a warning's short form, shown while its condition lasts."""
        self.done += 1
        if self._first_step_at is None:
            self._first_step_at = time.monotonic()
        text = (
            f"reward {row['reward_mean']:.3f}  {row['tokens_per_s']:.0f} tok/s  "
            f"step {row['step_time_s']:.1f}s  stale {staleness_histogram(row['staleness'])}"
        )
        if row.get("filtered_groups"):
            text += f"  filtered {row['filtered_groups']}"
        if row.get("env_errors"):
            text += f"  env errors {row['env_errors']}"
        if flag:
            text += f"  {flag}"
        if evaluations:
            last = max(evaluations)
            result = evaluations[last]
            text += f"  eval {version_label(last, result)}: {format_scores(result)}"
        self._progress.update(self._task, advance=1, description=text)
        if self.enabled and not self.live and self._plain_due():
            self.console.print(self.plain_line(row, text), highlight=False, soft_wrap=True)

    def eta_s(self) -> float | None:
        """Remaining time from the mean step time since the first step (the startup before
        it would skew the estimate)."""
        if self._first_step_at is None or self.done < 2:
            return None
        per_step = (time.monotonic() - self._first_step_at) / (self.done - 1)
        return per_step * max(0, self.total - self.done)

    def plain_line(self, row: dict[str, Any], text: str) -> str:
        eta = self.eta_s()
        elapsed = format_duration(time.monotonic() - self._started)
        timing = f"{elapsed} elapsed" + (f", eta {format_duration(eta)}" if eta is not None else "")
        return f"train step {self.done}/{self.total} (v{row['new_version']})  {timing}  {text}"

    def _plain_due(self) -> bool:
        return self.done % plain_every(self.total) == 0 or self.done >= self.total

    def note(self, text: str) -> None:
        self._progress.update(self._task, description=text)
        if self.enabled and not self.live:
            self.console.print(text, highlight=False)
