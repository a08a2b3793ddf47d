"""`dorarl simulate`: the controller at cluster scale on the cost model, modes side by side.

    dorarl simulate [--preset NAME] [--config FILE.yaml] [--out DIR] [--modes sync,dora]
                    [--validate MODES_JSON] [--whatif] [--expert-imbalance-from RUN]
                    [key=value ...]

Keys are dotted fields of `SimulateConfig` (controller.*, cost.*, lengths.*, seed), applied
over the preset, then the YAML file, then the command line. Every mode runs the same
workload (same seed, same lengths) through the same controller as the real runtime and
writes DIR/<mode>/ with the recorder's files; DIR/sim.json holds the per-mode figures of
the steps after `warmup_steps`, DIR/timeline_<mode>.png the instance lanes (when traced).
`--preset local` simulates the runs of the `dorarl bench modes` run recorded in the package
and writes how far each prediction is from the measurement (sim.json `validation`).
`--expert-imbalance-from RUN` sets `cost.expert_imbalance` (an MoE preset's slowest-expert
factor) to the mean `moe_imbalance` of a `dorarl train` run's metrics.jsonl.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from dorarl.config import ConfigError, describe, load_config, to_yaml
from dorarl.controller import MODES
from dorarl.report.lanes import plot_lanes
from dorarl.simulate.config import SimulateConfig
from dorarl.simulate.presets import PRESETS, check_bars, reference_consistency
from dorarl.simulate.runs import run_modes, run_named
from dorarl.simulate.validate import (
    COMPARED,
    LOCAL_BENCH,
    bench_runs,
    compare,
    local_from_bench,
    read_bench,
    recorded_bench,
    run_controller,
)
from dorarl.simulate.whatif import plot_whatif, run_whatif, whatif_table

__all__ = ["build_config", "main"]


def _parse(argv: list[str]) -> argparse.Namespace:
    keys = "\n".join(f"  {k:<40} {d:>12}  {h}" for k, d, h in describe(SimulateConfig))
    parser = argparse.ArgumentParser(
        prog="dorarl simulate",
        description=__doc__.split("\n\n")[0],
        epilog=f"keys (key=value):\n{keys}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), help="start from a preset")
    parser.add_argument("--config", help="YAML file with SimulateConfig keys")
    parser.add_argument(
        "--out", default="runs/simulate", help="output folder (default: %(default)s)"
    )
    parser.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated modes (default: all)"
    )
    parser.add_argument(
        "--validate",
        metavar="MODES_JSON",
        help="simulate the runs of a `dorarl bench modes` modes.json and compare "
        "(--preset local does this against the bench run recorded in the package)",
    )
    parser.add_argument(
        "--whatif", action="store_true", help="dora speedup vs p99/median and K (heat map)"
    )
    parser.add_argument(
        "--expert-imbalance-from",
        metavar="RUN",
        help="a dorarl train run folder of an MoE model: its measured expert imbalance "
        "(mean moe_imbalance over the steps) becomes cost.expert_imbalance",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved settings as YAML (a file --config reads back) and exit",
    )
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    return parser.parse_args(argv)


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ConfigError(f"--modes: unknown {unknown or text!r}; choose from {', '.join(MODES)}")
    return modes


# ---- configuration ---------------------------------------------------------------------
def _flatten(tree: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted key=value strings (YAML scalars that read back to the same value)."""
    items = []
    for key, value in tree.items():
        if isinstance(value, dict):
            items += _flatten(value, f"{prefix}{key}.")
        else:
            text = yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()
            items.append(f"{prefix}{key}={text}")
    return items


def build_config(
    preset: str | SimulateConfig | None, path: str | None, overrides: list[str]
) -> SimulateConfig:
    """Preset, then YAML file, then overrides; validated by the config loader."""
    if preset is None:
        return load_config(SimulateConfig, path, overrides)
    base = PRESETS[preset]() if isinstance(preset, str) else preset
    layers = _flatten(dataclasses.asdict(base))
    if path is not None:
        load_config(SimulateConfig, path)  # errors name the file and key
        layers += _flatten(yaml.safe_load(Path(path).read_text()) or {})
    return load_config(SimulateConfig, None, layers + list(overrides))


def speedups(results: dict[str, dict]) -> dict[str, float]:
    """dora over each other mode: step time (end to end) and consumed tokens/s."""
    if "dora" not in results:
        return {}
    dora = results["dora"]
    out = {}
    for mode, r in results.items():
        if mode != "dora":
            out[f"dora/{mode} step"] = r["step_time_s"]["mean"] / dora["step_time_s"]["mean"]
            out[f"dora/{mode} tokens/s"] = (
                dora["consumed_tokens_per_s"] / r["consumed_tokens_per_s"]
            )
    return out


# ---- output ----------------------------------------------------------------------------
def _table(results: dict[str, dict], title: str) -> Table:
    table = Table(title=title)
    columns = ("run", "step s", "tokens/s", "rollout-only", "slot util", "staleness",
               "migrations", "re-prefill", "LB+xfer", "dropped", "sim s")  # fmt: skip
    for name in columns:
        table.add_column(name, justify="right")
    for name, s in results.items():
        over = s["overhead_share"]
        table.add_row(
            name,
            f"{s['step_time_s']['mean']:.1f}",
            f"{s['consumed_tokens_per_s']:,.0f}",
            f"{s['rollout_only_share']:.0%}",
            f"{s['slot_utilization']:.0%}",
            " ".join(f"{k}:{v}" for k, v in s["staleness"].items()),
            str(s["migrations"]),
            f"{s['reprefill_tokens']:,}",
            f"{over['load_balance']:.1%}+{over['request_transfer']:.1%}",
            str(s["dropped_total"]),
            f"{s['simulator_wall_s']:.1f}",
        )
    return table


def _timelines(cfg: SimulateConfig, results: dict[str, dict], out: Path) -> list[str]:
    if not cfg.trace:
        return []
    slots = cfg.controller.slots
    return [
        str(plot_lanes(out / name / "trace.json", out / f"timeline_{name}.png", slots, name))
        for name in results
        if (out / name / "trace.json").exists()
    ]


def measured_imbalance(run: str | Path) -> float:
    """The mean `moe_imbalance` (busiest expert over the mean, per step) of a run's steps."""
    path = Path(run) / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"--expert-imbalance-from: {path} does not exist")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    values = [float(r["moe_imbalance"]) for r in rows if "moe_imbalance" in r]
    if not values:
        raise ConfigError(
            f"--expert-imbalance-from: {path} has no moe_imbalance (not an MoE model's run)"
        )
    return sum(values) / len(values)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    if args.expert_imbalance_from:
        imbalance = measured_imbalance(args.expert_imbalance_from)
        args.overrides = [f"cost.expert_imbalance={imbalance!r}", *args.overrides]
    out = Path(args.out)
    console = Console(width=max(160, Console().width))
    if args.print_config:
        base = args.preset
        if args.validate or args.preset == "local":
            base = local_from_bench(
                read_bench(args.validate) if args.validate else recorded_bench()
            )
        print(to_yaml(build_config(base, args.config, args.overrides)), end="")
        return 0
    if args.whatif:
        return _main_whatif(args, out, console)
    if args.validate or args.preset == "local":
        return _main_validate(args, out, console)
    cfg = build_config(args.preset, args.config, args.overrides)
    results = run_modes(cfg, _modes(args.modes), out)
    doc = {"preset": args.preset, "config": dataclasses.asdict(cfg), "modes": results}
    doc["speedups"] = speedups(results)
    doc["bars"] = check_bars(args.preset, results)
    doc["reference_consistency"] = reference_consistency(args.preset, results)
    out.mkdir(parents=True, exist_ok=True)
    doc["timelines"] = _timelines(cfg, results, out)
    _write(out, doc)
    console.print(_table(results, f"dorarl simulate {args.preset or ''} (virtual time)"))
    for key, value in doc["speedups"].items():
        console.print(f"{key}: {value:.2f}x")
    for bar in doc["bars"]:
        console.print(f"bar {bar['name']}: {bar['value']:.3g} vs {bar['target']:.3g} "
                      f"(+-{bar['tolerance']:g}) {'MET' if bar['met'] else 'MISSED'}")  # fmt: skip
    if consistency := doc["reference_consistency"]:
        console.print(
            "trainer-side time per step, dora over sync: paper "
            f"{consistency['paper_non_rollout_ratio']:.2f}x, simulated "
            f"{consistency['simulated_non_rollout_ratio']:.2f}x (with equal training the "
            f"paper's shares would give a {consistency['paper_speedup_at_equal_training']:.2f}x "
            "speedup)"
        )
    return 0


def _main_validate(args: argparse.Namespace, out: Path, console: Console) -> int:
    bench = read_bench(args.validate) if args.validate else recorded_bench()
    cfg = build_config(local_from_bench(bench), args.config, args.overrides)
    wanted = _modes(args.modes)
    runs = [
        (name, run_controller(cfg.controller, mode, k))
        for name, mode, k in bench_runs(bench)
        if mode in wanted
    ]
    results = run_named(cfg, runs, out)
    source = args.validate or f"{LOCAL_BENCH} ({bench.get('source', 'recorded bench run')})"
    validation = compare(results, bench["modes"]) | {"modes_json": str(source)}
    doc = {"preset": "local", "config": dataclasses.asdict(cfg), "modes": results}
    doc["validation"] = validation
    out.mkdir(parents=True, exist_ok=True)
    doc["timelines"] = _timelines(cfg, results, out)
    _write(out, doc)
    console.print(_table(results, "dorarl simulate --validate (local preset, virtual time)"))
    for name, row in validation["runs"].items():
        cells = [f"{k} {row[k]['predicted']:.3g} vs {row[k]['measured']:.3g} "
                 f"({row[k]['rel_error']:+.0%})" for k in COMPARED]  # fmt: skip
        ctx = row["context"]
        cells.append(f"train s {ctx['train_time_s_predicted']:.2f} vs "
                     f"{ctx['train_time_s_measured']:.2f} (unpaced excess "
                     f"{ctx['pace_excess_train_s']:.1f}s)")  # fmt: skip
        console.print(f"{name}: " + "; ".join(cells))
    console.print(f"all within {validation['tolerance']:.0%}: {validation['all_within']}")
    return 0


def _main_whatif(args: argparse.Namespace, out: Path, console: Console) -> int:
    cfg = build_config(args.preset or "paper-64", args.config, args.overrides)
    grid = run_whatif(cfg)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"preset": args.preset or "paper-64", "config": dataclasses.asdict(cfg), "whatif": grid}
    doc["heatmap"] = str(plot_whatif(grid, out / "whatif.png"))
    _write(out, doc)
    console.print(whatif_table(grid))
    return 0


def _write(out: Path, doc: dict[str, Any]) -> None:
    (out / "sim.json").write_text(json.dumps(doc, indent=2) + "\n")
    if "modes" in doc:  # the per-mode figures alone, as `dorarl bench modes` names its file
        (out / "modes.json").write_text(json.dumps(doc["modes"], indent=2) + "\n")
