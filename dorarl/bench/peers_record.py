"""The record of `dorarl bench peers`: its table (a row per side), the settings both sides
share and what could not be matched, as a docs/results record, and the table printed."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.table import Table

from dorarl.report.console import table_console

CONVERGED_WITHIN = 0.03
"""A TRL run converges when its last held-out accuracy is at most this far below the best
TRL run's: the fastest of those is TRL's figure (its best settings that keep accuracy)."""

COLUMNS = [
    "framework",
    {"name": "process wall s", "fmt": "{:,.0f}"},
    {"name": "run wall s", "fmt": "{:,.0f}"},
    {"name": "s/step", "fmt": "{:.1f}"},
    {"name": "tokens/s", "fmt": "{:.1f}"},
    "held-out by step",
]


def side_row(name: str, side: dict[str, Any]) -> list[Any]:
    curve = " / ".join(f"{v}: {a:.2f}" for v, a in sorted(side["held_out"].items()))
    return [name, side["process_wall_s"], side["run_wall_s"], side["s_per_step"],
            side["tokens_per_s"], curve]  # fmt: skip


def results_record(result: dict[str, Any], command: str) -> dict[str, Any]:
    """The run as a docs/results record (`dorarl report results` renders it)."""
    s, m = result["settings"], result["machine_before"]
    ratio = result["trl"]["run_wall_s"] / max(result["dorarl"]["run_wall_s"], 1e-9)
    return {
        "section": "learning",
        "title": f"dorarl against TRL's GRPOTrainer: {s['task']}, {s['steps']} steps",
        "bench": "peers",
        "command": command,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": f"{m['cores']} vCPUs ({m['cpu']})",
        "load": load_span(m, result["machine_after"]),
        "columns": COLUMNS,
        "rows": [side_row(dorarl_label(s), result["dorarl"]),
                 *(side_row(trl_label(p), side) for p, side in result["trl_runs"].items())],
        "notes": [
            settings_note(s),
            f"TRL's figure: its {precision_name(s['trl_precision'])} run (the fastest that "
            f"converges: last held-out within {CONVERGED_WITHIN:.2f} of its best run's). "
            f"TRL's run wall over dorarl's: {ratio:.2f}x. Prompt ids equal in dispatch order: "
            f"{result['prompts']['same_prompt_ids']}.",
            *unmatched_notes(result),
        ],
    }  # fmt: skip


def dorarl_label(settings: dict[str, Any]) -> str:
    s = settings
    return f"dorarl ({s['mode']} K={s['K']}, {precision_name(s['dorarl_autocast'])})"


def trl_label(precision: str) -> str:
    return f"TRL GRPOTrainer ({precision_name(precision)})"


def settings_note(s: dict[str, Any]) -> str:
    """What both sides were given, as one note."""
    return (
        f"{s['model']}; G={s['group_size']}, {s['tbs']} groups a step, lr {s['lr']}, "
        f"clip {s['eps_low']}/{s['eps_high']}, token-mean loss (TRL loss_type dapo), "
        f"KL {s['kl_coef']}, temperature {s['temperature']}, {s['max_new_tokens']} new "
        f"tokens; held-out: {s['eval_prompts']} prompts, greedy, our evaluator on both; "
        f"malloc of both: {s['allocator']}."
    )


def unmatched_notes(result: dict[str, Any]) -> list[str]:
    return ["Not matched: " + u for u in result["unmatched"]]


def load_span(before: dict[str, Any], after: dict[str, Any]) -> str:
    """The load averages before the first run and after the last."""
    loads = [", ".join(f"{x:.1f}" for x in m["load"]) for m in (before, after)]
    return f"{loads[0]} (1/5/15-min) before, {loads[1]} after"


def precision_name(name: str) -> str:
    return "fp32" if name in ("fp32", "none") else f"{name} autocast"


def print_result(result: dict[str, Any], path: Path) -> None:
    console = table_console()
    record = result["record"]
    table = Table(title=record["title"])
    for col in COLUMNS:
        table.add_column(col if isinstance(col, str) else col["name"], justify="right")
    for row in record["rows"]:
        cells = [c if isinstance(c, str) else f"{c:,.1f}" for c in row]
        table.add_row(*cells)
    console.print(table)
    for note in record["notes"]:
        console.print(f"- {note}")
    console.print(f"wrote {path}")
