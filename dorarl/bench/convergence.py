"""`dorarl bench convergence`: held-out accuracy and reward against step and wall time, for
sync and dora (K values), or for objectives under dora, trained the same number of steps by
`dorarl train`'s machinery.

    dorarl bench convergence --out DIR [--quick] [--config FILE.yaml] [key=value ...]
    dorarl bench convergence --out DIR --objectives grpo,gspo,cispo,dr_grpo,rloo steps=60

Built-in task (running_sum), the shipped base model, real sampling (no forced lengths).
Wall time is on emulated devices: the same calibration and pacing as `dorarl bench modes`,
with the synchronous rollout estimated from a batch the base model really samples.
Evaluation (greedy, held-out) runs after each training run on the versions kept, so it
takes no CPU from the timed run. Writes DIR/<mode>/ (the `dorarl train` run folder),
DIR/convergence.json and DIR/convergence.png; prints a table and the bars.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

from dorarl.bench.bars import makespan_steps
from dorarl.bench.calibrate import (
    PaceRule,
    calibrate,
    choose_pace,
    quiet_model_loading,
    sample_lengths,
)
from dorarl.bench.cli_args import parse_bench_args
from dorarl.bench.clock import Stopwatch
from dorarl.config import ConfigError, load_config
from dorarl.data.lengths import length_stats
from dorarl.engine import SamplingParams
from dorarl.jobs.config import EvalSection, TrainConfig
from dorarl.jobs.model_defaults import with_model_defaults
from dorarl.jobs.ray_run import run_ray
from dorarl.jobs.workload import build_task
from dorarl.record.pacing import DeviceModel
from dorarl.report.console import table_console
from dorarl.report.convergence_plot import plot_convergence
from dorarl.report.run_curve import read_curve
from dorarl.runtime.actor_pool import kept_ray
from dorarl.tasks import Task
from dorarl.tasks.assets import shipped_base_model
from dorarl.trainer.objective_presets import check_objectives, objective_loss

log = logging.getLogger(__name__)

QUICK = ["steps=8", "eval_every=4", "eval_prompts=200"]
"""`--quick`: a short run (applied before the user's overrides)."""


@dataclass(kw_only=True)
class ConvergenceConfig:
    steps: int = field(default=40, metadata={"help": "training steps of every mode", "ge": 1})
    eval_every: int = field(
        default=5, metadata={"help": "held-out evaluation every N versions", "ge": 1}
    )
    eval_prompts: int = field(
        default=500, metadata={"help": "held-out prompts per evaluation", "ge": 1}
    )
    dora_k: list[int] = field(default_factory=lambda: [1, 3], metadata={"help": "dora K values"})
    objectives: list[str] = field(
        default_factory=list,
        metadata={
            "help": "objectives to compare, each a dora run at K = dora_k's first (names in "
            "dorarl.trainer.objective_presets; empty: sync against dora per K)"
        },
    )
    reach: float = field(
        default=0.9,
        metadata={"help": "objectives: the held-out accuracy each should reach", "gt": 0},
    )
    train: TrainConfig = field(default_factory=TrainConfig)
    pace: PaceRule = field(default_factory=PaceRule)

    def validate(self) -> None:
        if not self.dora_k or min(self.dora_k) < 1:
            raise ConfigError("dora_k: needs K values >= 1")
        if self.train.task.name != "running_sum" or self.train.forced_lengths.enabled:
            raise ConfigError("train.task: the convergence bench trains running_sum, real lengths")
        check_objectives(self.objectives, "objectives")

    def runs(self) -> list[tuple[str, TrainConfig]]:
        """(name, the `dorarl train` config of that run) in run order."""
        if self.objectives:
            k = self.dora_k[0]
            return [(name, self._train_config("dora", k, name)) for name in self.objectives]
        modes = [("sync", "sync", 0)] + [(f"dora_k{k}", "dora", k) for k in self.dora_k]
        return [(name, self._train_config(mode, k)) for name, mode, k in modes]

    def _train_config(self, mode: str, k: int, objective: str = "grpo") -> TrainConfig:
        trainer = dataclasses.replace(
            self.train.trainer, loss=objective_loss(objective, self.train.trainer.loss)
        )
        config = dataclasses.replace(
            self.train,
            trainer=trainer,
            mode=mode,
            K=k if mode == "dora" else self.train.K,
            steps=self.steps,
            progress=False,
            eval=EvalSection(every=self.eval_every, max_prompts=self.eval_prompts),
        )
        if mode == "sync":  # the mode fixes these; set them so nothing is reported ignored
            config = dataclasses.replace(config, K=0, rbs=config.tbs)
        config.validate()
        return config


# ---- calibration -------------------------------------------------------------------------
def calibrate_pace(
    cfg: ConvergenceConfig, model_folder: str, task: Task
) -> tuple[DeviceModel, dict[str, Any]]:
    """Pace from real compute, the synchronous rollout from one batch the base model samples."""
    train = cfg.train
    prompts = [p.prompt_ids for p in task.train_prompts()[: train.tbs]]
    params = SamplingParams(
        temperature=train.sampling.temperature,
        top_p=train.sampling.top_p,
        top_k=train.sampling.top_k,
        max_new_tokens=train.sampling.max_new_tokens or task.max_new_tokens,
        stop_token_ids=list(task.stop_token_ids),
    )
    lengths = sample_lengths(
        model_folder, train.engine, prompts, train.group_size, params, train.seed
    )
    flat = [n for group in lengths for n in group]
    longest_prompt = max(len(p) for p in prompts)
    decode_len = max(8, min(max(flat), train.engine.max_model_len - longest_prompt))
    cal = calibrate(model_folder, train.engine, train.trainer, prompts, lengths,
                    len(task.tokenizer), decode_len, train.seed)  # fmt: skip
    sync_steps = makespan_steps(flat, train.instances * train.engine.max_num_seqs) + 1
    kv_tokens = train.engine.kv_blocks * train.engine.block_size
    device, derivation = choose_pace(cal, cfg.pace, num_instances=train.instances,
                                     kv_pool_tokens=kv_tokens, sync_rollout_steps=sync_steps)  # fmt: skip
    emulation = {
        "calibration_real": cal.to_dict(),
        "device": device.to_dict(),
        "derivation": derivation,
        "rule": asdict(cfg.pace),
        "base_model_lengths": length_stats(flat),
    }
    return device, emulation


# ---- curves ------------------------------------------------------------------------------
def time_to_reach(curve: dict[str, Any], accuracy: float) -> float | None:
    """Wall time at which the first version with held-out accuracy >= `accuracy` was made."""
    for point in curve["eval"]:
        if point["accuracy"] >= accuracy:
            return point["time_s"]
    return None


def check_bars(curves: dict[str, dict[str, Any]], dora: str = "dora_k1") -> list[dict[str, Any]]:
    """Final accuracy within 5 points of sync's; sync's final accuracy reached in <= 0.7x sync's
    wall time. The second is void (met None) when sync ended no better than the base model:
    every run then "reaches" it at version 0."""
    sync, other = curves["sync"], curves[dora]
    base, final_sync = sync["eval"][0]["accuracy"], sync["eval"][-1]["accuracy"]
    gap = final_sync - other["eval"][-1]["accuracy"]
    reach = time_to_reach(other, final_sync)
    share = reach / sync["wall_time_s"] if reach is not None and sync["wall_time_s"] else None
    improved = final_sync > base
    return [
        {"bar": f"{dora} final accuracy >= sync's - 0.05", "value": gap, "target": "<= 0.05",
         "met": gap <= 0.05},
        {"bar": f"{dora} time to sync's final accuracy / sync wall time", "value": share,
         "target": "<= 0.7", "met": (share is not None and share <= 0.7) if improved else None,
         "note": "" if improved else f"void: sync ended at {final_sync:.3f}, base {base:.3f}"},
    ]  # fmt: skip


def version_to_reach(curve: dict[str, Any], accuracy: float) -> int | None:
    """The first evaluated version with held-out accuracy >= `accuracy`."""
    for point in curve["eval"]:
        if point["accuracy"] >= accuracy:
            return point["version"]
    return None


def check_objective_bars(
    curves: dict[str, dict[str, Any]], reach: float, steps: int
) -> list[dict[str, Any]]:
    """Each objective's held-out accuracy reaches `reach` within the run's `steps`."""
    bars = []
    for name, curve in curves.items():
        version = version_to_reach(curve, reach)
        bars.append({"bar": f"{name} reaches held-out >= {reach:g}", "value": version,
                     "target": f"<= {steps} steps", "met": version is not None})  # fmt: skip
    return bars


def _bars(cfg: ConvergenceConfig, curves: dict[str, dict[str, Any]]) -> dict[str, Any]:
    if cfg.objectives:
        return {"objectives": check_objective_bars(curves, cfg.reach, cfg.steps)}
    return {f"dora_k{k}": check_bars(curves, f"dora_k{k}") for k in cfg.dora_k}


def _with_response_cap(train: TrainConfig, task: Task) -> TrainConfig:
    """The task's response cap set as sampling.max_new_tokens (what every run samples at),
    so an objective whose normaliser is the cap (Dr. GRPO) has it."""
    if train.sampling.max_new_tokens is not None:
        return train
    sampling = dataclasses.replace(train.sampling, max_new_tokens=task.max_new_tokens)
    return dataclasses.replace(train, sampling=sampling)


# ---- the bench ---------------------------------------------------------------------------
def run_bench(cfg: ConvergenceConfig, out: Path, *, say=print) -> dict[str, Any]:
    model_folder = str(cfg.train.model or shipped_base_model())
    train, chosen = with_model_defaults(
        dataclasses.replace(cfg.train, model=model_folder), model_folder, None
    )  # as `dorarl train` chooses them, so every run of the bench trains with the same
    cfg = dataclasses.replace(cfg, train=train)
    for line in chosen:
        say(line)
    task = build_task(cfg.train, model_folder)
    cfg = dataclasses.replace(cfg, train=_with_response_cap(cfg.train, task))
    out.mkdir(parents=True, exist_ok=True)
    watch = Stopwatch()
    device, emulation = calibrate_pace(cfg, model_folder, task)
    say(f"calibrated: decode step pace {device.decode_step_s * 1e3:.1f} ms, training step "
        f"{emulation['derivation']['train_step_s']:.2f} s")  # fmt: skip
    curves, summaries = {}, {}
    with kept_ray(cfg.train.ray.address, cfg.train.ray.host):  # one start for all runs
        for name, train_config in cfg.runs():
            summaries[name] = run_ray(train_config, None, out / name, pace=device, defer_eval=True)
            curves[name] = read_curve(out / name)
            say(f"{name}: {cfg.steps} steps in {curves[name]['wall_time_s']:.1f}s, final "
                f"held-out accuracy {curves[name]['eval'][-1]['accuracy']:.3f}")  # fmt: skip
    result = {
        "config": asdict(cfg),
        "emulation": emulation,
        "curves": curves,
        "summary": {name: _summary(curves[name], summaries[name]) for name in curves},
        "bars": _bars(cfg, curves),
        "bench_wall_s": watch.wall_s(),
    }
    (out / "convergence.json").write_text(json.dumps(result, indent=2) + "\n")
    plot_convergence(curves, out / "convergence.png")
    return result


def _summary(curve: dict[str, Any], summary: dict[str, Any]) -> dict[str, Any]:
    pace = summary.get("pace", {})
    return {
        "wall_time_s": curve["wall_time_s"],
        "final_accuracy": curve["eval"][-1]["accuracy"],
        "first_accuracy": curve["eval"][0]["accuracy"],
        "final_reward_mean": curve["reward_mean"][-1],
        "mean_step_time_s": summary.get("mean_step_time_s"),
        "dropped_total": summary.get("dropped_total", 0),
        "pace": pace,
    }


def _pace_cells(pace: dict[str, dict[str, float]]) -> list[str]:
    if not pace:
        return ["-", "-", "-"]
    eng, tr = pace["engine"], pace["train"]
    per = [
        (p["paced_s"] / max(1, p["steps"]), p["compute_s"] / max(1, p["steps"])) for p in (eng, tr)
    ]
    return [f"{per[0][0] * 1e3:.1f}/{per[0][1] * 1e3:.1f} ms", f"{per[1][0]:.2f}/{per[1][1]:.2f} s",
            f"{eng['over_share']:.1%}/{tr['over_share']:.0%}"]  # fmt: skip


def print_result(result: dict[str, Any], out: Path) -> None:
    console = table_console()
    table = Table(title="convergence (paced wall time; held-out greedy accuracy)")
    reference = next(iter(result["summary"]))  # sync, or the first objective
    for col in ("run", "steps", "wall s", "step s", "acc first", "acc final", "reward final",
                f"time to {reference}'s final acc", f"to {reference}'s final - 2 pts",
                "engine step paced/real",
                "train paced/real",
                "over pace eng/train"):  # fmt: skip
        table.add_column(col, justify="right")
    final_ref = result["summary"][reference]["final_accuracy"]
    for name, s in result["summary"].items():
        reach = time_to_reach(result["curves"][name], final_ref)
        near = time_to_reach(result["curves"][name], final_ref - 0.02)
        table.add_row(name, str(result["config"]["steps"]), f"{s['wall_time_s']:.1f}",
                      f"{s['mean_step_time_s']:.2f}", f"{s['first_accuracy']:.3f}",
                      f"{s['final_accuracy']:.3f}", f"{s['final_reward_mean']:.3f}",
                      "-" if reach is None else f"{reach:.1f}s",
                      "-" if near is None else f"{near:.1f}s", *_pace_cells(s["pace"]))  # fmt: skip
    console.print(table)
    bars = Table(title="bars")
    for col in ("bar", "value", "target", "met"):
        bars.add_column(col, justify="right")
    for rows in result["bars"].values():
        for b in rows:
            value = "-" if b["value"] is None else f"{b['value']:.3f}".rstrip("0").rstrip(".")
            met = {True: "yes", False: "NO", None: b.get("note", "void")}[b["met"]]
            bars.add_row(b["bar"], value, b["target"], met)
    console.print(bars)
    der = result["emulation"]["derivation"]
    console.print(f"emulation: decode step {result['emulation']['device']['decode_step_s'] * 1e3:.1f} ms "
                  f"({der['decode_pace_over_real']:.1f}x real), training step "
                  f"{der['train_step_s']:.2f} s ({der['train_pace_over_real']:.1f}x real)")  # fmt: skip
    for name, s in result["summary"].items():
        for kind, stats in (s["pace"] or {}).items():
            if stats["over"]:
                console.print(f"[yellow]WARNING {name}: {stats['over']} of {stats['steps']} "
                              f"{kind} steps ({stats['over_share']:.1%}) took longer than their "
                              "pace: real compute set those steps' time[/yellow]")  # fmt: skip
    console.print(f"wrote {out / 'convergence.json'} and {out / 'convergence.png'}")


# ---- command line ------------------------------------------------------------------------
def _parse(argv: list[str]) -> argparse.Namespace:
    argv = _objectives_flag(argv)
    return parse_bench_args(argv, "dorarl bench convergence", __doc__, ConvergenceConfig, QUICK)


def _objectives_flag(argv: list[str]) -> list[str]:
    """`--objectives a,b` (or `--objectives=a,b`) as the override `objectives=[a,b]`."""
    out, args = [], iter(argv)
    for arg in args:
        if arg == "--objectives":
            arg = "--objectives=" + next(args, "")
        if arg.startswith("--objectives="):
            names = [n.strip() for n in arg.split("=", 1)[1].split(",") if n.strip()]
            arg = f"objectives=[{','.join(names)}]"
        out.append(arg)
    return out


def main(argv: list[str]) -> int:
    args = _parse(argv)
    cfg = load_config(
        ConvergenceConfig, args.config, (QUICK if args.quick else []) + args.overrides
    )
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    quiet_model_loading()
    out = Path(args.out)
    result = run_bench(cfg, out)
    print_result(result, out)
    dropped = sum(s["dropped_total"] for s in result["summary"].values())
    return 0 if dropped == 0 else 1
