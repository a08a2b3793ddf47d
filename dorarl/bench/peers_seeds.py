"""`dorarl bench peers --seeds`: both sides over several seeds, and the mean and spread of
their run wall times, of TRL's over dorarl's, and of their held-out accuracy at the last step.

One seed decides little on a 30-step run: the seed moves how long the answers get, so the wall
time, and the held-out gain by as much as the objectives differ. Each seed runs the whole bench
(dorarl, then TRL at every precision asked) in a process of its own, so no seed starts with
what an earlier one's TRL run left in memory, and writes `seed-N/peers.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from dorarl.bench.peers_record import (
    COLUMNS,
    dorarl_label,
    load_span,
    results_record,
    settings_note,
    side_row,
    trl_label,
    unmatched_notes,
)

SEED_TIMEOUT_S = 6 * 3600.0
"""The most one seed's bench may take by default: the 30-step SmolLM2 workload takes about
20 minutes a seed on two CPU cores (both sides)."""
STOP_GRACE_S = 30.0
"""After a seed's time is up: how long its process group has to stop on SIGTERM."""


class SeedFailed(RuntimeError):
    """A seed's bench exited with an error or ran past its time."""


def run_seeds(args: argparse.Namespace, seeds: list[int], command: str) -> dict[str, Any]:
    """The bench once per seed, each in its own process and out/seed-N, then both sides'
    mean and spread and one record of them all."""
    by_seed = {}
    for seed in seeds:
        folder = Path(args.out) / f"seed-{seed}"
        print(f"seed {seed}: dorarl bench peers --out {folder}", flush=True)
        run_one(seed_command(args, folder, seed), args.seed_timeout_s, f"seed {seed}")
        by_seed[seed] = json.loads((folder / "peers.json").read_text())
    summary = summarize(by_seed)
    return {
        "summary": summary,
        "by_seed": by_seed,
        "record": seeds_record(by_seed, summary, command),
    }


def seed_command(args: argparse.Namespace, folder: Path, seed: int) -> list[str]:
    """The one-seed bench: the same model, workload and precisions, `seed=N` last."""
    return [sys.executable, "-m", "dorarl", "bench", "peers", "--model", str(args.model),
            "--out", str(folder), "--config", str(args.config),
            "--trl-precision", args.trl_precision, *args.overrides, f"seed={seed}"]  # fmt: skip


def run_one(cmd: list[str], timeout_s: float, name: str) -> None:
    """Run `cmd` in a process group of its own (its Ray with it), its output on ours; stop
    the group when its time is up or this process is interrupted."""
    child = subprocess.Popen(cmd, start_new_session=True)
    try:
        code = child.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_group(child)
        raise SeedFailed(f"{name}: the bench ran past --seed-timeout-s={timeout_s:g}") from None
    except BaseException:
        stop_group(child)
        raise
    if code != 0:
        raise SeedFailed(f"{name}: the bench exited {code} (its output is above)")


def stop_group(child: subprocess.Popen) -> None:
    """SIGTERM to the child's process group, SIGKILL after STOP_GRACE_S."""
    for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, STOP_GRACE_S)):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            return
        try:
            child.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def parse_seeds(text: str) -> list[int]:
    """`--seeds 0,1,2` -> [0, 1, 2]; an empty or bad list raises ValueError naming it."""
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seeds: integers separated by commas, got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ValueError(f"--seeds: distinct integers >= 0, got {text!r}")
    return seeds


def spread(values: list[float]) -> dict[str, float]:
    """Mean, least, most and (two or more values) the sample standard deviation."""
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "sd": sd}


def held_out_curve(side: dict[str, Any]) -> dict[int, float]:
    """A side's held-out accuracy by version (JSON gives the versions as strings)."""
    return {int(v): a for v, a in side["held_out"].items()}


def last_held_out(side: dict[str, Any]) -> float:
    curve = held_out_curve(side)
    return curve[max(curve)]


def held_out_gain(side: dict[str, Any]) -> float:
    curve = held_out_curve(side)
    return curve[max(curve)] - curve[min(curve)]


def summarize(by_seed: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Both sides' figures over the seeds (TRL: each seed's figure run)."""
    seeds = sorted(by_seed)
    pairs = [(by_seed[s]["dorarl"], by_seed[s]["trl"]) for s in seeds]
    sides = {"dorarl": [d for d, _ in pairs], "trl": [t for _, t in pairs]}
    summary: dict[str, Any] = {"seeds": seeds}
    for name, runs in sides.items():
        summary[name] = {
            "run_wall_s": spread([r["run_wall_s"] for r in runs]),
            "s_per_step": spread([r["s_per_step"] for r in runs]),
            "last_held_out": spread([last_held_out(r) for r in runs]),
            "held_out_gain": spread([held_out_gain(r) for r in runs]),
        }
    ratios = [t["run_wall_s"] / max(d["run_wall_s"], 1e-9) for d, t in pairs]
    summary["trl_over_dorarl_per_seed"] = ratios
    summary["trl_over_dorarl"] = spread(ratios)
    walls = summary["trl"]["run_wall_s"]["mean"], summary["dorarl"]["run_wall_s"]["mean"]
    summary["trl_over_dorarl_of_means"] = walls[0] / max(walls[1], 1e-9)
    summary["held_out_lead"] = spread([last_held_out(d) - last_held_out(t) for d, t in pairs])
    summary["trl_precision_per_seed"] = [by_seed[s]["settings"]["trl_precision"] for s in seeds]
    return summary


def _mean_row(name: str, runs: list[dict[str, Any]]) -> list[Any]:
    curves = [held_out_curve(r) for r in runs]
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    curve = " / ".join(f"{v}: {statistics.fmean(c[v] for c in curves):.2f}" for v in steps)
    mean = statistics.fmean
    return [name, mean(r["process_wall_s"] for r in runs), mean(r["run_wall_s"] for r in runs),
            mean(r["s_per_step"] for r in runs), mean(r["tokens_per_s"] for r in runs),
            curve]  # fmt: skip


def seeds_record(by_seed: dict[int, dict[str, Any]], summary: dict[str, Any], command: str):
    """One results record: a row per side and seed (TRL: each seed's figure run), the means,
    and the ratio's and accuracy's spread in the notes; its load from before the first seed
    run (`by_seed` is in run order) to after the last."""
    seeds = summary["seeds"]
    ran = list(by_seed)
    first = results_record(by_seed[seeds[0]], command)
    s = by_seed[seeds[0]]["settings"]
    rows = []
    for seed in seeds:
        result = by_seed[seed]
        trl_name = trl_label(result["settings"]["trl_precision"])
        rows.append(side_row(f"{dorarl_label(s)}, seed {seed}", result["dorarl"]))
        rows.append(side_row(f"{trl_name}, seed {seed}", result["trl"]))
    rows.append(_mean_row(f"dorarl, mean of {len(seeds)}", [by_seed[x]["dorarl"] for x in seeds]))
    rows.append(_mean_row(f"TRL, mean of {len(seeds)}", [by_seed[x]["trl"] for x in seeds]))
    ratio, lead = summary["trl_over_dorarl"], summary["held_out_lead"]
    per_seed = ", ".join(f"{r:.2f}x" for r in summary["trl_over_dorarl_per_seed"])
    notes = [
        f"Seeds {', '.join(map(str, seeds))} (train.seed on both sides: prompts order, "
        f"sampling, TRL's seed). TRL's run wall over dorarl's: {per_seed} by seed; mean "
        f"{ratio['mean']:.2f}x (sd {ratio['sd']:.2f}), ratio of mean walls "
        f"{summary['trl_over_dorarl_of_means']:.2f}x.",
        f"Held-out at the last step, dorarl minus TRL: mean {lead['mean']:+.2f} (from "
        f"{lead['min']:+.2f} to {lead['max']:+.2f}); gains over step 0: dorarl "
        f"{summary['dorarl']['held_out_gain']['mean']:+.2f}, TRL "
        f"{summary['trl']['held_out_gain']['mean']:+.2f} on the mean.",
        settings_note(s),
        "Prompt ids equal in dispatch order on every seed: "
        f"{all(by_seed[x]['prompts']['same_prompt_ids'] for x in seeds)}.",
        *unmatched_notes(by_seed[seeds[0]]),
    ]
    return first | {
        "title": f"{first['title']}, {len(seeds)} seeds",
        "load": load_span(by_seed[ran[0]]["machine_before"], by_seed[ran[-1]]["machine_after"]),
        "columns": COLUMNS,
        "rows": rows,
        "notes": notes,
    }
