"""Rich tables of `dorarl bench modes`: emulation (paced beside real), modes, bars, warnings.

Every paced time is printed next to the real compute it covered; a mode in which real
compute exceeded the pace gets a warning line with the count and share of such steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

from dorarl.report.console import table_console


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def emulation_table(result: dict[str, Any]) -> Table:
    emu = result["emulation"]
    real, dev, der = emu["calibration_real"], emu["device"], emu["derivation"]
    rule = emu["rule"]
    table = Table(title="device emulation (calibrated once, alone, 1 thread)")
    for col in ("work", "device time (paced)", "real compute", "pace / real"):
        table.add_column(col, justify="right")
    table.add_row(f"decode step, batch {real['decode_batch']}, ctx {real['decode_context']}",
                  _ms(dev["decode_step_s"]), _ms(real["decode_step_s"]),
                  f"{dev['decode_step_s'] / real['decode_step_s']:.1f}x")  # fmt: skip
    table.add_row("prefill, per token", f"{dev['prefill_token_s'] * 1e6:.1f} us",
                  f"{real['prefill_token_s'] * 1e6:.1f} us",
                  f"{dev['prefill_token_s'] / max(1e-12, real['prefill_token_s']):.1f}x")  # fmt: skip
    table.add_row("KV read, per resident token", f"{dev['kv_token_s'] * 1e6:.3f} us", "-", "-")
    table.add_row(f"training step, {real['train_tokens']} tokens",
                  f"{der['train_step_s']:.3f} s", f"{real['train_step_s']:.3f} s",
                  f"{der['train_pace_over_real']:.1f}x")  # fmt: skip
    table.caption = (
        f"rule: pace >= {rule['margin']} x real alone; paced workers keep <= "
        f"{rule['cpu_share']:.0%} of {rule['cores']} cores busy on average (at this pace: "
        f"{der['cpu_demand_cores']:.2f} cores); train step = {rule['train_ratio']} x expected "
        f"sync rollout ({der['expected_sync_rollout_s']:.2f} s, {der['sync_rollout_steps']:.0f} "
        f"steps); binding: {der['bound']}. Measured sync train/rollout: "
        f"{emu['measured_sync_train_over_rollout']:.2f}. Not paced: {emu['not_paced']}."
    )
    return table


def workload_table(result: dict[str, Any]) -> Table:
    w = result["workload"]
    title = (
        f"workload: {w['task']} episodes at their natural lengths, each tool call answered "
        f"{w['env_latency_s']:g} s late"
        if w.get("multi_turn")
        else f"workload: forced lengths, lognormal median {w['median']:g}, "
        f"p99/median {w['p99_ratio']:g}, max {w['max_len']}"
    )
    table = Table(title=title)
    for col in ("lengths", "n", "median", "mean", "p90", "p99", "max", "p99/median"):
        table.add_column(col, justify="right")
    for name in ("sampled", "dispatched", "consumed"):
        s = w.get(name) or {}
        if s:
            table.add_row(name, str(s["n"]), f"{s['median']:.0f}", f"{s['mean']:.1f}",
                          f"{s['p90']:.0f}", f"{s['p99']:.0f}", f"{s['max']:.0f}",
                          f"{s['p99_over_median']:.1f}")  # fmt: skip
    return table


def modes_table(result: dict[str, Any]) -> Table:
    modes = result["modes"]
    base = modes["sync"]["consumed_tokens_per_s"] if "sync" in modes else 0.0
    table = Table(title="modes (measured steps; paced wall time, real compute beside it)")
    table.caption = (
        "over pace: share of engine / training steps whose real compute exceeded the pace "
        "(! beyond the limits: the device model did not hold). load avg: the machine's "
        "1-minute load at the mode's start / end. fc -: no free-cache step to measure (KV "
        "blocks are freed as requests leave, inside the steps and migrations)."
    )
    cols = ("mode", "tok/s", "x sync", "step s mean/med", "rollout-only", "slot util",
            "staleness", "overhead lb/rt/fc", "re-prefill", "migr", "engine step paced/real",
            "train paced/real", "over pace eng/train", "load avg")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="right")
    for name, m in modes.items():
        table.add_row(name, *_mode_cells(m, base))
    return table


def _mode_cells(m: dict[str, Any], base: float) -> list[str]:
    eng, tr = m["pace"]["engine"], m["pace"]["train"]
    oh = m["overhead_share"]
    return [
        f"{m['consumed_tokens_per_s']:,.0f}",
        f"{m['consumed_tokens_per_s'] / base:.2f}" if base else "-",
        f"{m['step_time_s']['mean']:.2f}/{m['step_time_s']['median']:.2f}",
        f"{m['rollout_only_share']:.0%}",
        f"{m['slot_utilization']:.0%}",
        " ".join(f"{s}:{n}" for s, n in m["staleness"].items()),
        f"{oh['load_balance']:.1%}/{oh['request_transfer']:.1%}/"
        + (f"{oh['free_cache']:.2%}" if "free_cache" in oh else "-"),
        f"{m['reprefill_tokens']:,}",
        str(m["migrations"]),
        _per_step(eng, 1e3, "ms"),
        _per_step(tr, 1.0, "s"),
        f"{eng['over_share']:.1%}/{tr['over_share']:.0%}" + ("" if m["paced_reliably"] else " !"),
        "/".join(f"{x:.1f}" for x in m["load_avg_1min"]),
    ]


def _per_step(stats: dict[str, float], unit: float, name: str) -> str:
    if not stats["steps"]:
        return "-"
    paced = stats["paced_s"] / stats["steps"] * unit
    real = stats["compute_s"] / stats["steps"] * unit
    return f"{paced:.2f}/{real:.2f} {name}"


def bars_table(result: dict[str, Any]) -> Table:
    table = Table(title="bars")
    for col in ("bar", "value", "target", "met", "K bound", "pacing held"):
        table.add_column(col, justify="right")
    for bars in result["bars"].values():
        for b in bars:
            held = "yes" if b["paced_reliably"] else "NO: over pace, figure not valid"
            table.add_row(b["bar"], f"{b['value']:.3f}", b["target"], "yes" if b["met"] else "NO",
                          _bound_cell(b), held)  # fmt: skip
    table.caption = (
        "K bound: the best a schedule with the run's staleness bound K can reach when a "
        "batch's slowest group takes what sync's rollout of it took (R_b) and its training "
        "step sync's T_b. K=1: step b starts no earlier than R_b after the end of step b-2; "
        "K >= 2: a step every max(T, (R+T)/(K+1)) at best, from the means"
    )
    return table


def _bound_cell(bar: dict[str, Any]) -> str:
    """The most a '>=' figure can reach, the least a '<=' figure can go down to, under K."""
    bound = bar.get("k_bound")
    if bound is None:
        return ""
    return f"<= {bound:.2f}" if bar["target"].startswith(">=") else f">= {bound:.2f}"


def pace_warnings(result: dict[str, Any]) -> list[str]:
    lines = []
    for name, m in result["modes"].items():
        for kind, stats in m["all_steps"]["pace"].items():
            if stats["over"]:
                lines.append(
                    f"WARNING {name}: {stats['over']} of {stats['steps']} {kind} steps "
                    f"({stats['over_share']:.1%}) took longer than their pace (worst "
                    f"{stats['worst_ratio']:.1f}x, {stats['excess_s']:.2f}s over in all): "
                    "real compute, not the device model, set those steps' time"
                )
    return lines


def print_modes(result: dict[str, Any], out: Path) -> None:
    console = table_console()
    for table in (emulation_table(result), workload_table(result), modes_table(result),
                  bars_table(result)):  # fmt: skip
        console.print(table)
    for line in pace_warnings(result):
        console.print(f"[yellow]{line}[/yellow]")
    console.print(f"wrote {out / 'modes.json'}, {out / 'throughput.png'}, timeline_<mode>.png")


def clock_bars_table(title: str, bars: dict[str, dict[str, Any]]) -> Table:
    """Bars judged on the wall clock and on this process's CPU clock, side by side (a shared
    machine moves the first; the second shows what the code itself costs)."""
    table = Table(title=f"{title} (wall clock | this process's cpu clock)")
    for col in ("bar", "target", "wall", "result", "cpu", "result"):
        table.add_column(col)
    verdict = {True: "[green]pass", False: "[red]MISS", None: "[yellow]n/a"}
    for bar in bars.values():
        table.add_row(
            bar["what"],
            str(bar["target"]),
            fmt_or_dash(bar["value"], ".2f"),
            verdict[bar["pass"]],
            fmt_or_dash(bar["value_cpu"], ".2f"),
            verdict[bar["pass_cpu"]],
        )
    return table


def fmt_or_dash(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"
