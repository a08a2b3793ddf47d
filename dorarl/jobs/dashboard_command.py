"""`dorarl report dashboard RUN`: draw (or redraw) a run folder's dashboard.png from the
metrics.jsonl and evaluations.jsonl it holds, for a run still going or one drawn before."""

from __future__ import annotations

import argparse
from pathlib import Path

from dorarl.jobs.compare import check_run_folder, read_summary
from dorarl.report.dashboard import plot_dashboard
from dorarl.report.run_curve import read_history
from dorarl.run_layout import RunFolder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dorarl report dashboard", description=__doc__)
    parser.add_argument("run", type=Path, help="a run folder (dorarl train --out)")
    parser.add_argument("--out", type=Path, help="PNG to write (default: RUN/dashboard.png)")
    parser.add_argument("--title", help="the figure's title (default: the run's mode and K)")
    args = parser.parse_args(argv)
    check_run_folder(args.run)
    history = read_history(args.run)
    out = args.out or RunFolder(args.run).dashboard
    out.parent.mkdir(parents=True, exist_ok=True)
    plot_dashboard(history, out, args.title or _title(args.run))
    print(f"wrote {out} ({len(history.rows)} steps)")
    return 0


def _title(run_dir: Path) -> str:
    summary = read_summary(run_dir)
    if summary.get("mode") is None:
        return run_dir.name
    return f"{run_dir.name}: {summary['mode']} (K={summary.get('K')})"
