"""`dorarl simulate`: the controller at cluster scale on the cost model, modes side by side.

    dorarl simulate [--config FILE.yaml] [--out DIR] [--modes sync,dora] [key=value ...]

Keys are dotted fields of `SimulateConfig` (controller.*, cost.*, lengths.*, seed); every
mode runs the same workload (same seed, same lengths) and writes DIR/<mode>/ with the
recorder's files. Prints one row per mode.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dorarl.config import ConfigError, describe, load_config
from dorarl.controller import MODES, ControllerConfig
from dorarl.sim.cost import CostModel
from dorarl.sim.lengths import LengthDist
from dorarl.sim.runtime import SimRuntime


@dataclass(kw_only=True)
class SimulateConfig:
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    cost: CostModel = field(default_factory=CostModel)
    lengths: LengthDist = field(default_factory=LengthDist)
    seed: int = field(default=0, metadata={"help": "workload seed (lengths)"})
    trace: bool = field(default=True, metadata={"help": "write trace.json (large at scale)"})
    trajectories: bool = field(default=True, metadata={"help": "write trajectories.jsonl"})


def _parse(argv: list[str]) -> argparse.Namespace:
    keys = "\n".join(f"  {k:<40} {d:>12}  {h}" for k, d, h in describe(SimulateConfig))
    parser = argparse.ArgumentParser(
        prog="dorarl simulate",
        description=__doc__.split("\n\n")[0],
        epilog=f"keys (key=value):\n{keys}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="YAML file with SimulateConfig keys")
    parser.add_argument(
        "--out", default="runs/simulate", help="output folder (default: %(default)s)"
    )
    parser.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated modes (default: all)"
    )
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    return parser.parse_args(argv)


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ConfigError(f"--modes: unknown {unknown or text!r}; choose from {', '.join(MODES)}")
    return modes


def run_modes(cfg: SimulateConfig, modes: list[str], out: Path) -> dict[str, dict]:
    """Run each mode on the same workload; returns mode -> summary (+ simulator wall time)."""
    results = {}
    for mode in modes:
        controller = dataclasses.replace(cfg.controller, mode=mode)
        if controller.lockstep:  # the mode fixes these; set them so nothing is "ignored"
            controller = dataclasses.replace(
                controller, k=controller.staleness_bound, rbs=controller.tbs
            )
        started = time.perf_counter()
        sim = SimRuntime(
            controller,
            cfg.cost,
            cfg.lengths,
            seed=cfg.seed,
            out_dir=out / mode,
            trace=cfg.trace,
            trajectories=cfg.trajectories,
        )
        summary = sim.run().summary
        results[mode] = summary | {"simulator_wall_s": time.perf_counter() - started}
    return results


def _table(results: dict[str, dict]) -> Table:
    table = Table(title="dorarl simulate (virtual time)")
    for name in (
        "mode",
        "tokens/s",
        "step s",
        "rollout-only",
        "slot util",
        "migrations",
        "re-prefill",
        "sim s",
    ):
        table.add_column(name, justify="right")
    for mode, s in results.items():
        table.add_row(
            mode,
            f"{s['throughput_tokens_per_s']:,.0f}",
            f"{s['mean_step_time_s']:.1f}",
            f"{s['rollout_only_share']:.0%}",
            f"{s['slot_utilization']:.0%}",
            str(s["migrations"]),
            f"{s['reprefill_tokens']:,}",
            f"{s['simulator_wall_s']:.1f}",
        )
    return table


def main(argv: list[str]) -> int:
    args = _parse(argv)
    cfg = load_config(SimulateConfig, args.config, args.overrides)
    modes = _modes(args.modes)
    out = Path(args.out)
    results = run_modes(cfg, modes, out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "modes.json").write_text(json.dumps(results, indent=2) + "\n")
    Console(width=max(100, Console().width)).print(_table(results))
    return 0
