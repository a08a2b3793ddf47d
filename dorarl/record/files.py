"""A run's output files: metrics.jsonl and trajectories.jsonl as they grow, summary.json
and trace.json at the end (in `records_dir`: a segment's folder when the run has segments,
dorarl.record.segments). A resumed run (`append`) adds to its run's files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dorarl.record.trace import TraceBuilder
from dorarl.run_layout import RunFolder


class RunFiles:
    def __init__(
        self,
        out_dir: str | Path | None,
        *,
        trajectories: bool,
        append: bool,
        records_dir: str | Path | None = None,
    ) -> None:
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.records_dir = Path(records_dir) if records_dir is not None else self.out_dir
        self._metrics = self._trajectories = None
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            how = "a" if append else "w"
            run = RunFolder(self.out_dir)
            self._metrics = open(run.metrics, how)  # noqa: SIM115
            if trajectories:
                self._trajectories = open(run.trajectories, how)  # noqa: SIM115

    @property
    def writes_trajectories(self) -> bool:
        return self._trajectories is not None

    def metrics_row(self, row: dict[str, Any]) -> None:
        if self._metrics is not None:
            self._metrics.write(json.dumps(row) + "\n")
            self._metrics.flush()

    def trajectory_row(self, row: dict[str, Any]) -> None:
        if self._trajectories is not None:
            self._trajectories.write(json.dumps(row) + "\n")

    def close(self, summary: dict[str, Any], trace: TraceBuilder | None) -> None:
        for f in (self._metrics, self._trajectories):
            if f is not None:
                f.close()
        if self.records_dir is None:
            return
        records = RunFolder(self.records_dir)  # a segment's records: the same names
        records.summary.write_text(json.dumps(summary, indent=2) + "\n")
        if trace is not None:
            trace.write(records.trace)
