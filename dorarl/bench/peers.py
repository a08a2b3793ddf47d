"""`dorarl bench peers`: dorarl and TRL's GRPOTrainer on the same work, one after the other.

    dorarl bench peers --model DIR --out DIR [--config FILE.yaml] [--trl-precision fp32,bf16]
                       [--seeds 0,1,2] [--record FILE.json] [key=value ...]

The workload is a `dorarl train` config (default: configs/smollm2-arith.yaml), key=value
overrides applied. Both sides get the same model, prompts (TRL's data set is our task's
prompts in our dispatch order, its tokenization checked against our ids), reward (our
task's scorer), group size, batch, learning rate, clip, token-mean loss and held-out set:
TRL's weights at the evaluated versions are scored by our evaluator, greedy. TRL runs once
per precision asked; its figure is the fastest run that converges (its last held-out within
`CONVERGED_WITHIN` of the best TRL run's). Writes DIR/peers.json (with a results record, also
to --record) and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from dorarl.bench import peers_seeds, peers_trl
from dorarl.bench.cli_args import write_json
from dorarl.bench.clock import load_average
from dorarl.bench.peers_record import CONVERGED_WITHIN, print_result, results_record
from dorarl.config import load_config
from dorarl.engine.instance import open_engine
from dorarl.jobs.config import TrainConfig
from dorarl.jobs.evaluation import eval_versions
from dorarl.jobs.model_defaults import with_model_defaults
from dorarl.jobs.ray_run import run_ray
from dorarl.jobs.workload import build_task
from dorarl.record.evaluations import read_evaluations
from dorarl.report.run_curve import read_curve
from dorarl.run_layout import CHECKPOINTS, EVALUATIONS_FILE, TRAJECTORIES_FILE, checkpoint_name
from dorarl.runtime.malloc import describe, find_tcmalloc, preload_library, reexec_on
from dorarl.tasks import Task
from dorarl.tasks.evaluate import evaluate

log = logging.getLogger(__name__)

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "smollm2-arith.yaml"
PRECISIONS = {"fp32": False, "bf16": True}
"""TRL precision name -> GRPOConfig's bf16 (autocast on CPU; fp32 master weights)."""

UNMATCHED = [
    "behaviour policy: dorarl (dora, K=1) trains on samples up to one version old, with the "
    "engine's log-probs as the ratio's base; TRL samples with the weights it trains (on policy)",
    "sampling: dorarl's engine against TRL's model.generate (padded batch, same temperature, "
    "top-p, top-k, max new tokens and stop ids); the random streams differ",
    "dorarl's rollout batch (rbs) over-provisions the groups a step takes; TRL generates "
    "exactly tbs groups a step, so a step's prompts can differ within the first rbs",
    "advantage eps: dorarl adds trainer.loss.adv_eps to the group std, TRL adds 1e-4",
    "dorarl writes its checkpoints (checkpoint_every) inside its run wall; TRL's weight saves "
    "at the evaluated steps are taken out of its",
    "held-out evaluations lost by dorarl's run are redone from its checkpoints where it "
    "kept one (checkpoint_every); a version with neither is missing from its curve",
    "process wall: dorarl's includes Ray and its actors starting; TRL's its model loading and "
    "trainer set-up; neither includes the held-out evaluation",
]


def bench_config(args: argparse.Namespace) -> TrainConfig:
    """The `dorarl train` config both sides run: the file, overrides, --model, the model's
    defaults as `dorarl train` picks them."""
    overrides = [*args.overrides, f"model={args.model}"]
    train = load_config(TrainConfig, args.config, overrides)
    train, _ = with_model_defaults(train, str(train.model), None)
    every = train.eval.every if train.eval.every not in (0, "off") else train.steps
    return dataclasses.replace(
        train, progress=False, eval=dataclasses.replace(train.eval, every=every)
    )


def eval_steps(train: TrainConfig) -> list[int]:
    """The versions both sides evaluate: those `dorarl train` evaluates."""
    return sorted(eval_versions(train))


def run_dorarl(train: TrainConfig, out: Path) -> dict[str, Any]:
    """`dorarl train`'s job function, its evaluations deferred to after the run."""
    started = time.monotonic()
    summary = run_ray(train, None, out, defer_eval=True)
    took = time.monotonic() - started
    evals = read_evaluations(out / EVALUATIONS_FILE)
    eval_s = sum(e.get("eval_s", 0.0) for e in evals.values())
    curve = read_curve(out)
    return {
        "process_wall_s": took - eval_s,
        "run_wall_s": summary["wall_time_s"],
        "step_s": [
            b - a for a, b in zip([0.0, *curve["time_s"][:-1]], curve["time_s"], strict=True)
        ],
        "s_per_step": summary["mean_step_time_s"],
        "tokens": summary["consumed_tokens"],
        "tokens_per_s": summary["throughput_tokens_per_s"],
        "reward_errors": summary["reward_errors"],
        "reward_mean": curve["reward_mean"],
        "held_out": {int(v): e["accuracy"] for v, e in sorted(evals.items())},
    }


def evaluate_folders(train: TrainConfig, task: Task, folders: dict[int, Path]) -> dict[int, float]:
    """Held-out greedy accuracy of each step's model folder by our evaluator and engine."""
    scores = {}
    for step, folder in sorted(folders.items()):
        engine = open_engine(folder, train.engine)
        scores[step] = evaluate(engine, task, max_prompts=train.eval.max_prompts)["accuracy"]
        del engine
    return scores


def fill_held_out(train: TrainConfig, task: Task, run: Path, held_out: dict[int, float]) -> None:
    """Evaluate, from the run's checkpoints (version 0: the model folder), the versions whose
    evaluation the run lost (an evaluator killed for memory on a shared machine)."""
    folders = {0: Path(str(train.model))} | {
        v: run / CHECKPOINTS / checkpoint_name(v) for v in eval_steps(train)
    }
    missing = {
        v: folders[v] for v in eval_steps(train) if v not in held_out and folders[v].is_dir()
    }
    if missing:
        log.warning("dorarl: versions %s evaluated from checkpoints", sorted(missing))
        held_out.update(evaluate_folders(train, task, missing))


def consumed_prompts(out: Path, steps: int) -> list[list[int]]:
    """The prompt ids each of dorarl's steps trained on, one per group, sorted."""
    by_step: list[set[int]] = [set() for _ in range(steps)]
    for line in (out / TRAJECTORIES_FILE).read_text().splitlines():
        row = json.loads(line)
        if 0 <= row["train_version"] < steps:
            by_step[row["train_version"]].add(row["prompt_id"])
    return [sorted(s) for s in by_step]


def prompt_check(train: TrainConfig, task: Task, trl_ids: list[list[list[int]]], dorarl_steps):
    """TRL's tokenized prompts against our ids in dispatch order, and the share of the
    prompts dorarl trained on that TRL trained on too."""
    prompts = task.train_prompts()
    ours = [
        [prompts[(s * train.tbs + j) % len(prompts)].prompt_ids for j in range(train.tbs)]
        for s in range(train.steps)
    ]
    by_id = {p.prompt_id: i for i, p in enumerate(prompts)}
    trl_prompts = {i % len(prompts) for i in range(train.steps * train.tbs)}
    dorarl_all = [by_id[pid] for step in dorarl_steps for pid in step]
    shared = sum(i in trl_prompts for i in dorarl_all) / max(1, len(dorarl_all))
    return {
        "same_prompt_ids": trl_ids == ours,
        "trl_batches": len(trl_ids),
        "dorarl_prompts_also_in_trl": shared,
        "dorarl_prompt_ids": dorarl_steps,
    }


def machine() -> dict[str, Any]:
    """CPU model, cores and the load when the bench ran."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "load": load_average()}


def trl_figure(runs: dict[str, dict[str, Any]]) -> str:
    """The precision whose TRL run is TRL's figure: the fastest of those that converge."""
    last = {p: side["held_out"][max(side["held_out"])] for p, side in runs.items()}
    best = max(last.values())
    converged = [p for p in runs if last[p] >= best - CONVERGED_WITHIN - 1e-9]
    return min(converged, key=lambda p: runs[p]["run_wall_s"])


def run_trl_side(train, task, model_folder: str, out: Path, precision: str, say=print):
    """One TRL run at `precision`, its held-out curve scored by our evaluator."""
    saves = eval_steps(train)
    say(f"TRL GRPOTrainer: {train.steps} steps ({precision})")
    trl, record = peers_trl.run_trl(train, task, model_folder, out, saves, PRECISIONS[precision])
    say("our evaluator on TRL's weights at steps " + ", ".join(map(str, saves)))
    folders = {s: peers_trl.step_folder(out, s) for s in saves}
    trl["held_out"] = evaluate_folders(train, task, folders)
    return trl, record


def run_bench(train: TrainConfig, out: Path, *, precisions: list[str], say=print) -> dict[str, Any]:
    model_folder = str(train.model)
    task = build_task(train, model_folder)
    load_before = machine()
    say(f"dorarl: {train.steps} steps ({train.mode}, K={train.K})")
    dorarl = run_dorarl(train, out / "dorarl")
    fill_held_out(train, task, out / "dorarl", dorarl["held_out"])
    dorarl_steps = consumed_prompts(out / "dorarl", train.steps)
    runs, records = {}, {}
    for precision in precisions:
        folder = out / ("trl" if precision == "fp32" else f"trl-{precision}")
        runs[precision], records[precision] = run_trl_side(
            train, task, model_folder, folder, precision, say
        )
    figure = trl_figure(runs)
    result = {
        "settings": _settings(train, figure),
        "dorarl": dorarl,
        "trl": runs[figure],
        "trl_runs": runs,
        "prompts": prompt_check(train, task, records[figure].prompt_ids, dorarl_steps),
        "machine_before": load_before,
        "machine_after": machine(),
        "unmatched": unmatched(train),
    }
    return result


def unmatched(train: TrainConfig) -> list[str]:
    """What differs between the two sides under `train`."""
    skipped = (
        ["dorarl's trainer computes no sequence whose advantage is 0 (trainer."
         "skip_zero_advantage: the same gradient and update); TRL computes every completion"]
        if train.trainer.skip_zero_advantage else []
    )  # fmt: skip
    return UNMATCHED + skipped


def _allocators(train: TrainConfig) -> str:
    """The malloc of both sides: dorarl's actors', and this process's, where TRL trains."""
    ours = preload_library(train.ray.allocator) or "glibc malloc"
    here = describe(find_tcmalloc())
    return ours if ours == here else f"{ours} (dorarl's actors), {here} (TRL)"


def _settings(train: TrainConfig, trl_precision: str) -> dict[str, Any]:
    """The settings both sides share, as the table's notes name them."""
    loss, s = train.trainer.loss, train.sampling
    return {
        "model": str(train.model), "task": train.task.name, "steps": train.steps,
        "group_size": train.group_size, "tbs": train.tbs, "rbs": train.rbs, "mode": train.mode,
        "K": train.K, "lr": train.trainer.lr, "eps_low": loss.eps_low,
        "eps_high": loss.eps_high, "aggregation": loss.aggregation, "trl_loss_type": "dapo",
        "kl_coef": loss.kl_coef, "normalize_std": loss.normalize_std,
        "max_grad_norm": train.trainer.max_grad_norm, "temperature": s.temperature,
        "top_p": s.top_p, "top_k": s.top_k, "max_new_tokens": s.max_new_tokens,
        "eval_prompts": train.eval.max_prompts, "eval_steps": eval_steps(train),
        "seed": train.seed, "trl_precision": trl_precision,
        "dorarl_autocast": train.trainer.autocast,
        "allocator": _allocators(train),
    }  # fmt: skip


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="dorarl bench peers", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", required=True, help="Hugging Face model folder")
    parser.add_argument("--out", required=True, type=Path, help="output folder")
    parser.add_argument(
        "--config", default=str(DEFAULT_CONFIG), help="a `dorarl train` YAML (the workload)"
    )
    parser.add_argument(
        "--trl-precision",
        default="fp32",
        help="TRL's precisions, comma-separated (fp32, bf16: autocast): one run each",
    )
    parser.add_argument(
        "--seeds",
        help="several seeds, comma-separated (train.seed on both sides): the whole bench once "
        "each, in DIR/seed-N, and the mean and spread of both sides",
    )
    parser.add_argument(
        "--seed-timeout-s",
        type=float,
        default=peers_seeds.SEED_TIMEOUT_S,
        help="--seeds: the most one seed's bench may take (its process is stopped after)",
    )
    parser.add_argument("--record", type=Path, help="also write the results record here")
    parser.add_argument("overrides", nargs="*", help="dotted key=value `dorarl train` keys")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    missing = peers_trl.trl_missing()
    if missing is not None:
        print(missing, file=sys.stderr)
        return 2
    args = _parse(argv)
    precisions = [p.strip() for p in args.trl_precision.split(",") if p.strip()]
    unknown = sorted(set(precisions) - set(PRECISIONS))
    if unknown or not precisions:
        given = unknown or ["(none)"]
        print(f"--trl-precision: unknown {given}; choose from {sorted(PRECISIONS)}",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        seeds = None if args.seeds is None else peers_seeds.parse_seeds(args.seeds)
        if not args.seed_timeout_s > 0:
            raise ValueError(f"--seed-timeout-s: must be > 0, got {args.seed_timeout_s:g}")
    except ValueError as refused:
        print(refused, file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    train = bench_config(args)
    # TRL trains in this process: it starts again on the malloc dorarl's actors get, so
    # neither side has an allocator the other lacks. Several seeds run one process each.
    command = shlex.join(["dorarl", "bench", "peers", *argv])
    if seeds is None:
        reexec_on(preload_library(train.ray.allocator))
        result = run_seed(train, args.out, list(dict.fromkeys(precisions)), command)
    else:
        try:
            result = peers_seeds.run_seeds(args, seeds, command)
        except peers_seeds.SeedFailed as failed:
            print(failed, file=sys.stderr)
            return 1
    path = write_json(args.out, "peers.json", result)
    if args.record is not None:
        args.record.write_text(json.dumps(result["record"], indent=1) + "\n")
    print_result(result, path)
    return 0


def run_seed(train: TrainConfig, out: Path, precisions: list[str], command: str):
    """The bench on train.seed, its record inside."""
    result = run_bench(train, out, precisions=precisions)
    result["record"] = results_record(result, command)
    return result
