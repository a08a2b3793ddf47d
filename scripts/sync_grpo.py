"""Synchronous GRPO on running_sum: engine rollouts, trainer step, weight sync, repeat.

Starts from the shipped base model and stops after `--minutes` of wall time (or
`--steps`). Every step samples `--prompts` training prompts with `--group-size` responses
each from the engine at the current version, scores them, trains one step and loads the
new weights into the engine (staleness 0). Held-out greedy accuracy is measured through
the same engine every `--eval-every` steps and at the end. Writes curve.jsonl, curve.png
and summary.json to `--out`.

    python scripts/sync_grpo.py --out runs/sync_grpo
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from pathlib import Path

import torch

from dorarl.data import Group, Sample
from dorarl.engine import Engine, EngineConfig, SamplingParams
from dorarl.report.plots import plot_training_curve
from dorarl.tasks import Prompt, Task, make_task, score
from dorarl.tasks.assets import BASE_MODEL_DIR
from dorarl.tasks.evaluate import evaluate
from dorarl.trainer import LossConfig, Trainer, TrainerConfig

log = logging.getLogger("sync_grpo")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=BASE_MODEL_DIR)
    ap.add_argument("--out", type=Path, default=Path("runs/sync_grpo"))
    ap.add_argument("--minutes", type=float, default=10.0, help="wall-time budget, eval included")
    ap.add_argument("--steps", type=int, default=10**9)
    ap.add_argument("--prompts", type=int, default=16, help="groups per step")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--eps-low", type=float, default=0.2)
    ap.add_argument("--eps-high", type=float, default=0.28)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-prompts", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    return ap.parse_args(argv)


class PromptStream:
    """Training prompts in a seeded random order, reshuffled every epoch."""

    def __init__(self, prompts: list[Prompt], seed: int):
        self.prompts, self.rng, self.order = prompts, random.Random(seed), []

    def take(self, n: int) -> list[Prompt]:
        batch = []
        while len(batch) < n:
            if not self.order:
                self.order = list(range(len(self.prompts)))
                self.rng.shuffle(self.order)
            batch.append(self.prompts[self.order.pop()])
        return batch


def rollout(engine: Engine, task: Task, prompts: list[Prompt], args, step: int) -> list[Group]:
    """Sample `group_size` responses per prompt at the engine's version and score them."""
    samples: dict[str, Sample] = {}
    for g, prompt in enumerate(prompts):
        for i in range(args.group_size):
            request_id = f"s{step}-g{g}-{i}"
            params = SamplingParams(
                temperature=args.temperature,
                max_new_tokens=task.max_new_tokens,
                stop_token_ids=list(task.stop_token_ids),
                seed=hash((args.seed, step, g, i)) & (2**62 - 1),
            )
            engine.add_request(request_id, prompt.prompt_ids, params)
            samples[request_id] = Sample(g, i, prompt.prompt_id, list(prompt.prompt_ids))
    while engine.has_unfinished():
        for out in engine.step():
            _fill(samples[out.request_id], out, task, prompts)
    return _groups(samples, prompts, engine.version)


def _fill(sample: Sample, out, task: Task, prompts: list[Prompt]) -> None:
    sample.response_ids, sample.logprobs = list(out.output_ids), list(out.logprobs)
    sample.versions, sample.finish_reason = list(out.versions), out.finish_reason
    sample.reward, sample.reward_error = score(task, prompts[sample.group_id], out.output_ids)


def _groups(samples: dict[str, Sample], prompts: list[Prompt], version: int) -> list[Group]:
    groups = [Group(g, p.prompt_id, version) for g, p in enumerate(prompts)]
    for s in samples.values():
        groups[s.group_id].samples.append(s)
    for group in groups:
        group.samples.sort(key=lambda s: s.sample_index)
    return groups


def build(args) -> tuple[Task, Engine, Trainer]:
    task = make_task("running_sum", seed=0)
    max_len = max(len(p.prompt_ids) for p in task.train_prompts() + task.eval_prompts())
    engine = Engine.from_pretrained(
        args.model,
        EngineConfig(
            max_num_seqs=args.prompts * args.group_size,
            max_model_len=max_len + task.max_new_tokens,
            seed=args.seed,
        ),
        version=0,
    )
    trainer = Trainer.from_pretrained(
        args.model,
        TrainerConfig(
            lr=args.lr,
            temperature=args.temperature,
            max_grad_norm=1.0,
            micro_batch_tokens=4096,
            loss=LossConfig(eps_low=args.eps_low, eps_high=args.eps_high),
        ),
    )
    return task, engine, trainer


def run(args) -> list[dict]:
    task, engine, trainer = build(args)
    stream = PromptStream(task.train_prompts(), args.seed)
    eval_set = task.eval_prompts()[: args.eval_prompts]
    start = time.time()
    rows = [_eval_row(engine, task, eval_set, 0, start)]
    step = 0
    while step < args.steps and time.time() - start < args.minutes * 60:
        step += 1
        groups = rollout(engine, task, stream.take(args.prompts), args, step)
        metrics = trainer.train_step(groups)
        engine.load_weights(trainer.named_tensors(), trainer.version)
        row = {"step": step, "wall_s": round(time.time() - start, 1), **_scalars(metrics)}
        if step % args.eval_every == 0:
            row.update(_eval_row(engine, task, eval_set, step, start))
        rows.append(row)
        _log_row(row)
    if "eval_accuracy" not in rows[-1]:
        rows[-1].update(_eval_row(engine, task, eval_set, step, start))
    return rows


def _eval_row(engine, task, prompts, step, start) -> dict:
    result = evaluate(engine, task, prompts)
    log.info(
        "step %d: held-out greedy accuracy %.3f (%d prompts)", step, result["accuracy"], result["n"]
    )
    return {
        "step": step,
        "eval_accuracy": result["accuracy"],
        "eval_mean_len": result["mean_len"],
        "wall_s": round(time.time() - start, 1),
    }


def _scalars(metrics: dict) -> dict:
    return {k: (round(v, 5) if isinstance(v, float) else v) for k, v in metrics.items()}


def _log_row(row: dict) -> None:
    log.info(
        "step %d %.0fs reward %.3f len %.1f loss %.4f clip %.3f/%.3f kl %.5f gnorm %.3f",
        row["step"],
        row["wall_s"],
        row["reward_mean"],
        row["response_len_mean"],
        row["loss"],
        row["clip_frac_low"],
        row["clip_frac_high"],
        row["kl_behavior"],
        row["grad_norm"],
    )


def _curve(rows: list[dict]) -> dict:
    """The rows as dorarl.report.run_curve's curve: step s made version s, the row of step s
    carries the evaluation of version s (step 0's: the base model's)."""
    trained = [r for r in rows if "reward_mean" in r]
    evals = [{"version": r["step"], "accuracy": r["eval_accuracy"]} for r in rows
             if "eval_accuracy" in r]  # fmt: skip
    return {"steps": [r["step"] for r in trained],
            "reward_mean": [r["reward_mean"] for r in trained], "eval": evals}  # fmt: skip


def write_outputs(rows: list[dict], args) -> dict:
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "curve.jsonl").open("w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    plot_training_curve(_curve(rows), args.out / "curve.png", title="sync GRPO on running_sum")
    evals = [r for r in rows if "eval_accuracy" in r]
    summary = {
        "start_accuracy": evals[0]["eval_accuracy"],
        "end_accuracy": evals[-1]["eval_accuracy"],
        "gain": evals[-1]["eval_accuracy"] - evals[0]["eval_accuracy"],
        "steps": rows[-1]["step"],
        "wall_s": rows[-1]["wall_s"],
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rows = run(args)
    summary = write_outputs(rows, args)
    print(
        f"held-out greedy accuracy {summary['start_accuracy']:.3f} -> "
        f"{summary['end_accuracy']:.3f} ({summary['gain']:+.3f}) in {summary['steps']} steps, "
        f"{summary['wall_s']:.0f}s; curve in {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
