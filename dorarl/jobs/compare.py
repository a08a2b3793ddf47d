"""`dorarl report compare RUN...`: run folders side by side, a table and the convergence PNG.

Reads each folder's metrics.jsonl, evaluations.jsonl and summary.json (what `dorarl train`
writes; a folder written before evaluations.jsonl existed has its evaluations in its metrics
rows), so runs made at different times or on different machines compare without re-running
anything.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.table import Table

from dorarl.errors import UserInputError
from dorarl.jobs.evaluation import headline_scores
from dorarl.record.evaluations import held_out_count, sampled_scores
from dorarl.report.console import table_console
from dorarl.report.convergence_plot import plot_convergence
from dorarl.report.run_curve import read_curve
from dorarl.run_layout import RunFolder


def run_row(name: str, run_dir: Path, curve: dict[str, Any]) -> dict[str, Any]:
    """What a reader compares first: mode, steps, wall time, held-out accuracy (the first
    evaluation and the last when later, with their versions; mean@k and pass@k of the last
    where it sampled), throughput (`curve`: the folder's `read_curve`)."""
    summary = read_summary(run_dir)
    evals = curve["eval"]
    first = evals[0] if evals else None
    last = evals[-1] if evals and evals[-1]["version"] > evals[0]["version"] else None
    sampled = {str(p["version"]): sampled_scores(p) for p in evals if sampled_scores(p)}
    return {
        "name": name,
        "mode": summary.get("mode"),
        "K": summary.get("K"),
        "steps": len(curve["steps"]),
        "wall_time_s": summary.get("wall_time_s", curve["wall_time_s"]),
        "mean_step_time_s": summary.get("mean_step_time_s"),
        "rollout_only_share": summary.get("rollout_only_share"),
        "throughput_tokens_per_s": summary.get("throughput_tokens_per_s"),
        "eval_first": first["accuracy"] if first else None,
        "eval_version_first": first["version"] if first else None,
        "eval_last": last["accuracy"] if last else None,
        "eval_version_last": last["version"] if last else None,
        "eval_n": held_out_count(evals),  # held-out prompts each accuracy is a share of
        "sampled_last": headline_scores(last) if last else {},
        "eval": {str(p["version"]): p["accuracy"] for p in evals},
        "eval_sampled": sampled,
        "dropped_total": summary.get("dropped_total"),
    }


def check_run_folder(run_dir: Path) -> None:
    metrics = RunFolder(run_dir).metrics
    if not metrics.is_file():
        raise UserInputError(f"{run_dir}: not a run folder (no {metrics.name})")


def read_summary(run_dir: Path) -> dict[str, Any]:
    path = RunFolder(run_dir).summary
    if not path.is_file():
        return {}  # a run still going, or stopped hard: its curve so far still compares
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserInputError(f"{path}: line {exc.lineno}: not JSON ({exc.msg})") from None


def run_names(run_dirs: list[Path], names: str | None) -> list[str]:
    if names is None:
        return [d.name for d in run_dirs]
    given = [n.strip() for n in names.split(",")]
    if len(given) != len(run_dirs) or len(set(given)) != len(given):
        raise UserInputError(
            f"--names: {len(run_dirs)} distinct names needed (one per run folder), got {names!r}"
        )
    return given


def _table(rows: list[dict[str, Any]]) -> Table:
    """One row a run; a column per sampled score of the last evaluations (mean@k, pass@k)
    when a run's evaluation sampled."""
    scores = list(dict.fromkeys(key for r in rows for key in r["sampled_last"]))
    table = Table(title="runs compared")
    for column in ("run", "mode", "steps", "wall s", "s/step", "rollout-only", "tok/s",
                   "held-out first", "held-out last", *(f"{k} last" for k in scores),
                   "dropped"):  # fmt: skip
        table.add_column(column, justify="left" if column in ("run", "mode") else "right")
    for r in rows:
        mode = f"{r['mode']} (K={r['K']})" if r["mode"] == "dora" else str(r["mode"])
        table.add_row(r["name"], mode, str(r["steps"]), _fmt(r["wall_time_s"], 0),
                      _fmt(r["mean_step_time_s"], 1), _fmt(r["rollout_only_share"], 2),
                      _fmt(r["throughput_tokens_per_s"], 1),
                      _at(r["eval_first"], r["eval_version_first"], r["eval_n"]),
                      _at(r["eval_last"], r["eval_version_last"], r["eval_n"]),
                      *(_fmt(r["sampled_last"].get(k), 3) for k in scores),
                      str(r["dropped_total"]))  # fmt: skip
    return table


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _at(accuracy: float | None, version: int | None, n: int | None = None) -> str:
    """An evaluation's accuracy, the version it is of and the held-out prompts it scored
    where recorded: '0.500 (v8, n=200)', '0.500 (v8)'."""
    if accuracy is None:
        return "-"
    return f"{accuracy:.3f} (v{version}" + ("" if n is None else f", n={n}") + ")"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dorarl report compare", description=__doc__)
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (dorarl train --out)")
    parser.add_argument("--names", help="comma-separated labels, one per run (default: folder)")
    parser.add_argument("--out", type=Path, default=Path("compare.png"), help="PNG to write")
    args = parser.parse_args(argv)
    names = run_names(args.runs, args.names)
    for run_dir in args.runs:
        check_run_folder(run_dir)
    curves = {name: read_curve(d) for name, d in zip(names, args.runs, strict=True)}
    rows = [run_row(name, d, curves[name]) for name, d in zip(names, args.runs, strict=True)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot_convergence(curves, args.out, time_label="wall time (s)")
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n")
    table_console().print(_table(rows))
    print(f"wrote {args.out} and {args.out.with_suffix('.json')}")
    return 0
