"""`dorarl simulate`: the controller at cluster scale on the cost model, modes side by side.

    dorarl simulate [--preset NAME] [--config FILE.yaml] [--out DIR] [--modes sync,dora]
                    [--validate] [--bench MODES_JSON] [--whatif [tail|split]]
                    [--expert-imbalance-from RUN] [key=value ...]

Keys are dotted fields of `SimulateConfig` (controller.*, cost.*, lengths.*, seed), applied
over the preset, then the YAML file, then the command line. Each mode of --modes runs once,
with the settings as given (dora and partial_rollout at controller.K), on the same workload
(same seed, same lengths) through the same controller as the real runtime, and writes
DIR/<mode>/ with the recorder's files; DIR/sim.json holds the per-mode figures of the steps
after `warmup_steps`, DIR/timeline_<mode>.png the instance lanes (when traced).
`--validate` compares each run with the `dorarl bench modes` run recorded in the package
that ran the same controller settings (sim.json `validation`); `--bench MODES_JSON` with
another modes.json. Both take the `local` preset (this machine as that bench paced it);
`--preset local` with its own settings validates too. `--whatif` sweeps dora's speedup over
p99/median and K, `--whatif split` the step time as the devices are split between rollout
instances and the trainer.
`--expert-imbalance-from RUN` sets `cost.expert_imbalance` (an MoE preset's slowest-expert
factor) to the mean `moe_imbalance` of a `dorarl train` run's metrics.jsonl.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from dorarl.config import ConfigError, describe, load_config, to_yaml
from dorarl.config.yaml_text import load_yaml
from dorarl.controller import MODES, ControllerConfig
from dorarl.errors import UserInputError
from dorarl.report.console import table_console
from dorarl.report.lanes import plot_lanes
from dorarl.run_layout import RunFolder
from dorarl.simulate.config import SimulateConfig
from dorarl.simulate.paper import comparison_table
from dorarl.simulate.presets import PRESETS, check_bars, reference_consistency
from dorarl.simulate.runs import mode_controller, run_named
from dorarl.simulate.validate import (
    COMPARED,
    LOCAL_BENCH,
    bench_controllers,
    compare,
    local_from_bench,
    measured_as,
    read_bench,
    recorded_bench,
    schedule,
    unmeasured_reason,
)
from dorarl.simulate.whatif import (
    WHATIF_AXES,
    plot_split,
    plot_whatif,
    run_split_whatif,
    run_whatif,
    split_lines,
    split_table,
    whatif_table,
)

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
        action="store_true",
        help="compare each run with the bench run that ran its settings (the local preset's "
        "recorded `dorarl bench modes` run, or --bench's)",
    )
    parser.add_argument(
        "--bench",
        metavar="MODES_JSON",
        help="a `dorarl bench modes` modes.json to take the local preset from and validate "
        "against (implies --validate)",
    )
    parser.add_argument(
        "--whatif",
        nargs="?",
        const="tail",
        choices=WHATIF_AXES,
        help="a what-if grid and its heat map: tail (the default: dora's speedup vs "
        "p99/median and K) or split (step time vs rollout / trainer devices, per mode)",
    )
    parser.add_argument(
        "--expert-imbalance-from",
        metavar="RUN",
        help="a dorarl train run folder of an MoE model: its measured expert imbalance "
        "(mean moe_imbalance over the steps) becomes cost.expert_imbalance",
    )
    _add_output_flags(parser)
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    return parser.parse_args(argv)


def _add_output_flags(parser: argparse.ArgumentParser) -> None:
    """What to print besides the runs' table and comparisons."""
    parser.add_argument(
        "--bars",
        action="store_true",
        help="also check a paper preset's run against the paper's figures as pass/fail bars, "
        "within the project's tolerances (MET / MISSED)",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved settings as YAML (a file --config reads back) and exit",
    )


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
        layers += _flatten(load_yaml(Path(path).read_text()) or {})  # read as the loader reads
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
        str(plot_lanes(RunFolder(out / name).trace, out / f"timeline_{name}.png", slots, name))
        for name in results
        if RunFolder(out / name).trace.exists()
    ]


def measured_imbalance(run: str | Path) -> float:
    """The mean `moe_imbalance` (busiest expert over the mean, per step) of a run's steps."""
    path = RunFolder(run).metrics
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
    args = _parse(_whatif_axis(argv))
    if args.expert_imbalance_from:
        imbalance = measured_imbalance(args.expert_imbalance_from)
        args.overrides = [f"cost.expert_imbalance={imbalance!r}", *args.overrides]
    out = Path(args.out)
    bench = _bench(args)
    preset = "local" if bench is not None else args.preset
    if args.whatif and preset is None:
        preset = "paper-64"
    base = local_from_bench(bench) if bench is not None else preset
    cfg = build_config(base, args.config, args.overrides)
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    console = table_console()
    if args.whatif:
        return _main_whatif(args.whatif, preset, cfg, out, console)
    runs = [(mode, mode_controller(cfg, mode)) for mode in _modes(args.modes)]
    check = _validation_plan(args, bench, cfg, runs, console)
    results = run_named(cfg, runs, out)
    doc = {"preset": preset, "config": dataclasses.asdict(cfg), "modes": results}
    doc["speedups"] = speedups(results)
    doc["bars"] = check_bars(preset, results)
    doc["reference_consistency"] = reference_consistency(preset, results)
    if check is not None:
        doc["validation"] = check.report(results)
    out.mkdir(parents=True, exist_ok=True)
    doc["timelines"] = _timelines(cfg, results, out)
    _write(out, doc)
    console.print(_table(results, f"dorarl simulate {preset or ''} (virtual time)"))
    _print_comparisons(doc, console, bars=args.bars)
    return 0


def _print_comparisons(doc: dict[str, Any], console: Console, bars: bool = False) -> None:
    """Speedups, a paper preset's run beside the paper's figures (with `bars`, also as the
    project's pass/fail bars), and the validation against the bench where there is one."""
    for key, value in doc["speedups"].items():
        console.print(f"{key}: {value:.2f}x")
    if doc["bars"]:
        console.print(comparison_table(doc["bars"], doc["reference_consistency"], doc["preset"]))
    if bars:
        for bar in doc["bars"]:
            console.print(f"bar {bar['name']}: {bar['value']:.3g} vs {bar['target']:.3g} "
                          f"(+-{bar['tolerance']:g}) {'MET' if bar['met'] else 'MISSED'}")  # fmt: skip
    if "validation" in doc:
        _print_validation(doc["validation"], console)


# ---- validation against a `dorarl bench modes` run --------------------------------------
def _bench(args: argparse.Namespace) -> dict[str, Any] | None:
    """The modes.json the local preset is made from: --bench's, the recorded one for
    --validate or --preset local; None for another preset (or none). --bench with --whatif
    takes the preset from it and validates nothing."""
    if (args.validate or args.bench) and args.preset not in (None, "local"):
        raise ConfigError(
            f"--validate: compares with a `dorarl bench modes` run of this machine, so it "
            f"takes the local preset; drop --preset {args.preset}"
        )
    if args.validate and args.whatif:
        raise ConfigError("--validate: a what-if grid runs settings no bench measured; drop one")
    if args.bench:
        return read_bench(args.bench)
    if args.validate or args.preset == "local":
        return recorded_bench()
    return None


@dataclass
class Validation:
    """The runs to compare with the bench's measurements: run name -> bench run name, and
    why each other run has none."""

    bench: dict[str, Any]
    source: str
    matched: dict[str, str]
    unmeasured: dict[str, str]

    def report(self, results: dict[str, dict]) -> dict[str, Any]:
        predicted = {self.matched[name]: results[name] for name in self.matched}
        checked = compare(predicted, self.bench["modes"])
        return checked | {"modes_json": self.source, "not_measured": self.unmeasured}


def _validation_plan(
    args: argparse.Namespace,
    bench: dict[str, Any] | None,
    cfg: SimulateConfig,
    runs: list[tuple[str, ControllerConfig]],
    console: Console,
) -> Validation | None:
    """What to validate: asked for (--validate, --bench), every run the bench measured, at
    least one; the local preset's own settings, every run; other settings, nothing."""
    if bench is None:
        return None
    asked = bool(args.validate or args.bench)
    if not asked and not _same_settings(cfg, local_from_bench(bench)):
        console.print("not validated: the settings differ from the recorded bench run's "
                      "(--validate compares the runs it measured)")  # fmt: skip
        return None
    measured = bench_controllers(bench)
    matched = {name: measured_as(c, measured) for name, c in runs}
    unmeasured = {name: unmeasured_reason(c, measured) for name, c in runs if not matched[name]}
    if not any(matched.values()):
        names = "; ".join(f"{schedule(c)}: {unmeasured[name]}" for name, c in runs)
        raise UserInputError(f"--validate: the bench measured none of these runs ({names})")
    source = args.bench or f"{LOCAL_BENCH} ({bench.get('source', 'recorded bench run')})"
    return Validation(bench, str(source), {n: b for n, b in matched.items() if b}, unmeasured)


def _same_settings(cfg: SimulateConfig, preset: SimulateConfig) -> bool:
    """Whether `cfg` simulates what `preset` does (whether it writes traces aside)."""
    return dataclasses.replace(cfg, trace=preset.trace, trajectories=preset.trajectories) == preset


def _print_validation(validation: dict[str, Any], console: Console) -> None:
    for name, row in validation["runs"].items():
        cells = [f"{k} {row[k]['predicted']:.3g} vs {row[k]['measured']:.3g} "
                 f"({row[k]['rel_error']:+.0%})" for k in COMPARED]  # fmt: skip
        ctx = row["context"]
        cells.append(f"train s {ctx['train_time_s_predicted']:.2f} vs "
                     f"{ctx['train_time_s_measured']:.2f} (unpaced excess "
                     f"{ctx['pace_excess_train_s']:.1f}s)")  # fmt: skip
        console.print(f"validation {name}: " + "; ".join(cells))
    for name, why in validation["not_measured"].items():
        console.print(f"not validated {name}: not measured by the bench ({why})")
    console.print(
        f"validated against {validation['modes_json']}: all within "
        f"{validation['tolerance']:.0%}: {validation['all_within']}"
    )


# ---- what-if grids -----------------------------------------------------------------------
def _whatif_axis(argv: list[str]) -> list[str]:
    """`--whatif` without an axis is `--whatif tail` (argparse would take a key=value after
    it for the axis)."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--whatif" and (i + 1 == len(out) or out[i + 1] not in WHATIF_AXES):
            out[i] = "--whatif=tail"
    return out


def _main_whatif(axis: str, preset: str, cfg: SimulateConfig, out: Path, console: Console) -> int:
    """The what-if grid of `axis` (tail: p99/median x K; split: rollout / trainer devices x
    mode), its table and heat map."""
    out.mkdir(parents=True, exist_ok=True)
    doc = {"preset": preset, "config": dataclasses.asdict(cfg)}
    if axis == "split":
        grid = run_split_whatif(cfg)
        doc |= {"whatif": grid, "heatmap": str(plot_split(grid, out / "whatif_split.png"))}
        _write(out, doc)
        console.print(split_table(grid))
        for line in split_lines(grid):
            console.print(line)
        return 0
    grid = run_whatif(cfg)
    doc |= {"whatif": grid, "heatmap": str(plot_whatif(grid, out / "whatif.png"))}
    _write(out, doc)
    console.print(whatif_table(grid))
    return 0


def _write(out: Path, doc: dict[str, Any]) -> None:
    (out / "sim.json").write_text(json.dumps(doc, indent=2) + "\n")
    if "modes" in doc:  # the per-mode figures alone, as `dorarl bench modes` names its file
        (out / "modes.json").write_text(json.dumps(doc["modes"], indent=2) + "\n")
