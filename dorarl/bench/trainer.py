"""`dorarl bench trainer`: our trainer's forward+backward against a plain HF one, same tokens.

Both contenders run in this process on the same model and the same micro-batches (our
token-budget plan, same padding): `trainer` is `Trainer.accumulate_gradients` (GRPO loss,
chunked output layer, metrics), `hf` is `model(input_ids, labels=...)` then `loss.backward()`
per micro-batch, and `floor` is the time of the step's own matrix multiplications on their
shapes (dorarl.bench.matmul_floor). Tokens are real (unpadded) prompt + response tokens.
Two last full `train_step`s give the peak memory of a step: the first without AdamW state
(it is made at the first update), the second with it, as every later step. Writes
DIR/trainer.json and prints a table. Wall and CPU clocks are both given: on a CPU shared
with other jobs the wall clock also measures their load.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Any

import torch
import transformers
from rich.console import Console
from rich.table import Table
from transformers import PreTrainedModel

from dorarl.bench.matmul_floor import MicroShape, floor_ms
from dorarl.bench.shapes import SHAPES, random_llama
from dorarl.data import Group, Sample
from dorarl.trainer import Trainer, TrainerConfig, load_model
from dorarl.trainer.allocator import release_free_heap
from dorarl.trainer.batch import build_sequences, collate, plan_micro_batches
from dorarl.trainer.memory import PeakMemory

BARS = {  # name: (what, target)
    "trainer_vs_hf": ("tokens/s trainer / hf forward+backward (at least)", 0.8),
    "peak_memory_gb": ("peak memory of a full train_step with AdamW state, GB (at most)", 6.0),
}


@dataclass(frozen=True)
class Workload:
    """GRPO-shaped: groups of `group_size` responses to one prompt, long-tailed lengths."""

    groups: int
    group_size: int = 8
    prompt_len: int = 48
    median_len: int = 28
    sigma: float = 0.6
    max_len: int = 64
    repeats: int = 2
    seed: int = 0


FULL = Workload(groups=8)
QUICK = Workload(groups=1, repeats=1)


def make_groups(work: Workload, vocab: int) -> list[Group]:
    """Stratified lognormal response lengths (cut at max_len), rewards 0/1 within a group."""
    n, dist = work.groups * work.group_size, NormalDist()
    lengths = [
        min(work.max_len, max(1, round(work.median_len * math.exp(work.sigma * dist.inv_cdf(q)))))
        for q in ((i + 0.5) / n for i in range(n))
    ]
    rng = random.Random(work.seed)
    rng.shuffle(lengths)
    groups = []
    for g in range(work.groups):
        prompt = [rng.randrange(vocab) for _ in range(work.prompt_len)]
        samples = []
        for i in range(work.group_size):
            length = lengths[g * work.group_size + i]
            samples.append(
                Sample(
                    group_id=g,
                    sample_index=i,
                    prompt_id=g,
                    prompt_ids=prompt,
                    response_ids=[rng.randrange(vocab) for _ in range(length)],
                    logprobs=[-rng.uniform(8.0, 12.0) for _ in range(length)],
                    versions=[0] * length,
                    finish_reason="length" if length == work.max_len else "stop",
                    reward=float(i % 2),
                )
            )
        groups.append(Group(group_id=g, prompt_id=g, version=0, samples=samples))
    return groups


def build_model(shape: str, model_dir: str | None, seed: int = 0) -> PreTrainedModel:
    if model_dir is not None:
        return load_model(model_dir, "float32", "cpu")
    return random_llama(shape, seed)


# --- contenders ---------------------------------------------------------------------------
@dataclass
class Timing:
    wall_s: list[float]
    cpu_s: list[float]
    peak_memory_gb: float


def _measure(contenders: dict[str, Callable[[], Any]], repeats: int) -> dict[str, Timing]:
    """Contenders take turns within each repeat, so a change of load on a shared machine
    falls on both rather than on whichever ran during it."""
    timings = {name: Timing([], [], 0.0) for name in contenders}
    peak = PeakMemory("cpu")
    for _ in range(repeats):
        for name, fn in contenders.items():
            release_free_heap()
            peak.start()
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            timing = timings[name]
            timing.wall_s.append(time.perf_counter() - wall)
            timing.cpu_s.append(time.process_time() - cpu)
            timing.peak_memory_gb = max(timing.peak_memory_gb, peak.peak_gb())
    return timings


def hf_forward_backward(model: PreTrainedModel, trainer: Trainer, groups: list[Group]) -> None:
    """The plain peer: HF's own causal-LM loss on the response tokens of the same batches."""
    seqs = [s for s in build_sequences(groups, trainer.config.loss) if s.response_ids]
    plan = plan_micro_batches([s.length for s in seqs], trainer.micro_batch_tokens)
    for indices in plan:
        batch = collate([seqs[i] for i in indices], trainer.pad_id, trainer.device)
        labels = torch.full_like(batch.input_ids, -100)
        labels[:, 1:][batch.mask] = batch.targets[batch.mask]
        model(input_ids=batch.input_ids, labels=labels, use_cache=False).loss.backward()
    model.zero_grad(set_to_none=True)


def trainer_forward_backward(trainer: Trainer, groups: list[Group]) -> None:
    trainer.accumulate_gradients(groups)
    trainer.model.zero_grad(set_to_none=True)


def micro_shapes(trainer: Trainer, groups: list[Group]) -> list[MicroShape]:
    seqs = [s for s in build_sequences(groups, trainer.config.loss) if s.response_ids]
    plan = plan_micro_batches([s.length for s in seqs], trainer.micro_batch_tokens)
    return [
        MicroShape(
            rows=len(indices),
            width=max(seqs[i].length for i in indices),
            response_tokens=sum(len(seqs[i].response_ids) for i in indices),
        )
        for indices in plan
    ]


# --- run and report -----------------------------------------------------------------------
def run(
    model: PreTrainedModel, config: TrainerConfig, work: Workload, console: Console
) -> dict[str, Any]:
    groups = make_groups(work, model.config.vocab_size)
    trainer = Trainer(model, config)
    shapes = micro_shapes(trainer, groups)
    report = _header(model, config, work, groups, shapes, trainer.micro_batch_tokens)
    console.log("warm-up (one sample each)")
    warm = [Group(0, 0, 0, groups[0].samples[:1])]
    trainer_forward_backward(trainer, warm)
    hf_forward_backward(model, trainer, warm)
    console.log(f"trainer and hf, taking turns, x{work.repeats}")
    timings = _measure(
        {
            "trainer": lambda: trainer_forward_backward(trainer, groups),
            "hf": lambda: hf_forward_backward(model, trainer, groups),
        },
        work.repeats,
    )
    console.log("floor: the step's matrix multiplications")
    floor = floor_ms(model.config, shapes)
    console.log("two full train_steps (AdamW included) for their peak memory")
    steps = []
    for _ in range(2):
        release_free_heap()
        steps.append(trainer.train_step(groups))
    report.update(_results(report["workload"]["tokens"], timings, floor, steps))
    report["bars"] = compute_bars(report)
    report["load_average"] = [round(x, 2) for x in os.getloadavg()]
    return report


def _header(
    model: PreTrainedModel,
    config: TrainerConfig,
    work: Workload,
    groups: list[Group],
    shapes: list[MicroShape],
    trainer_tokens: int,
) -> dict[str, Any]:
    samples = [s for g in groups for s in g.samples]
    return {
        "workload_spec": asdict(work),
        "trainer_config": {
            "micro_batch_tokens": config.micro_batch_tokens,
            "micro_batch_tokens_used": trainer_tokens,
            "logits_chunk_tokens": config.logits_chunk_tokens,
            "activation_checkpointing": config.activation_checkpointing,
        },
        "threads": torch.get_num_threads(),
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "model": {
            "arch": model.config.model_type,
            "parameters": sum(p.numel() for p in model.parameters()),
            "vocab_size": model.config.vocab_size,
            "layers": model.config.num_hidden_layers,
        },
        "workload": {
            "samples": len(samples),
            "tokens": sum(len(s.prompt_ids) + len(s.response_ids) for s in samples),
            "response_tokens": sum(len(s.response_ids) for s in samples),
            "padded_tokens": sum(m.rows * m.width for m in shapes),
            "micro_batches": [asdict(m) for m in shapes],
            "response_len_mean": statistics.fmean(len(s.response_ids) for s in samples),
        },
    }


def _results(
    tokens: int, timings: dict[str, Timing], floor: dict[str, float], steps: list[dict[str, Any]]
) -> dict[str, Any]:
    wall = {n: statistics.median(t.wall_s) for n, t in timings.items()}
    cpu = {n: statistics.median(t.cpu_s) for n, t in timings.items()}
    wall["floor"] = floor["total"] / 1e3
    return {
        "ms_per_step": {n: s * 1e3 for n, s in wall.items()},
        "cpu_ms_per_step": {n: s * 1e3 for n, s in cpu.items()},
        "tokens_per_s": {n: tokens / s for n, s in wall.items()},
        "tokens_per_cpu_s": {n: tokens / s for n, s in cpu.items()},
        "wall_s_all": {n: t.wall_s for n, t in timings.items()},
        "peak_memory_gb": {n: t.peak_memory_gb for n, t in timings.items()},
        "floor_ms": floor,
        "train_step": {
            "ms": steps[-1]["step_seconds"] * 1e3,
            "peak_memory_gb": max(s["peak_memory_gb"] for s in steps),
            "peak_memory_gb_per_step": [s["peak_memory_gb"] for s in steps],
            "micro_batches": steps[-1]["micro_batches"],
        },
    }


def compute_bars(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    tps, cps = report["tokens_per_s"], report["tokens_per_cpu_s"]
    values = {
        "trainer_vs_hf": (tps["trainer"] / tps["hf"], cps["trainer"] / cps["hf"]),
        "peak_memory_gb": (report["train_step"]["peak_memory_gb"], None),
    }
    bars = {}
    for name, (what, target) in BARS.items():
        value, value_cpu = values[name]
        at_least = name != "peak_memory_gb"
        bars[name] = {
            "what": what,
            "target": target,
            "value": value,
            "pass": value >= target if at_least else value <= target,
            "value_cpu": value_cpu,
            "pass_cpu": None if value_cpu is None else value_cpu >= target,
        }
    return bars


def print_report(report: dict[str, Any], console: Console) -> None:
    model, work = report["model"], report["workload"]
    table = Table(
        title=f"trainer bench ({model['parameters'] / 1e6:.1f}M params, {work['samples']} "
        f"samples, {work['tokens']} tokens, {report['threads']} threads)"
    )
    for col in ("contender", "ms/step", "tokens/s", "vs hf", "cpu ms", "cpu vs hf", "peak GB"):
        table.add_column(col, justify="left" if col == "contender" else "right")
    ms, cpu_ms, tps = report["ms_per_step"], report["cpu_ms_per_step"], report["tokens_per_s"]
    for name in ms:
        table.add_row(
            name,
            f"{ms[name]:,.0f}",
            f"{tps[name]:,.1f}",
            f"{tps[name] / tps['hf']:.2f}x",
            f"{cpu_ms[name]:,.0f}" if name in cpu_ms else "-",
            f"{cpu_ms['hf'] / cpu_ms[name]:.2f}x" if name in cpu_ms else "-",
            f"{report['peak_memory_gb'][name]:.2f}" if name in report["peak_memory_gb"] else "-",
        )
    console.print(table)
    floor, step = report["floor_ms"], report["train_step"]
    console.print(
        f"floor {floor['total']:,.0f} ms = linear {floor['linear']:,.0f} + attention "
        f"{floor['attention']:,.0f} + output layer {floor['output_layer']:,.0f}; padded tokens "
        f"{work['padded_tokens']} for {work['tokens']} ({len(work['micro_batches'])} micro-batches)"
    )
    per_step = " / ".join(f"{gb:.2f}" for gb in step["peak_memory_gb_per_step"])
    console.print(
        f"full train_step (AdamW included): {step['ms']:,.0f} ms, {step['micro_batches']:.0f} "
        f"micro-batches, peak memory {per_step} GB (first step / with AdamW state); "
        f"load average {report['load_average_start']} -> {report['load_average']}"
    )
    _print_bars(report["bars"], console)


def _print_bars(bars: dict[str, dict[str, Any]], console: Console) -> None:
    table = Table(title="bars (wall clock | this process's cpu clock)")
    for col in ("bar", "target", "wall", "result", "cpu", "result"):
        table.add_column(col)
    verdict = {True: "[green]pass", False: "[red]MISS", None: "[yellow]n/a"}
    for bar in bars.values():
        cpu = bar["value_cpu"]
        table.add_row(
            bar["what"],
            str(bar["target"]),
            f"{bar['value']:.2f}",
            verdict[bar["pass"]],
            "-" if cpu is None else f"{cpu:.2f}",
            verdict[bar["pass_cpu"]],
        )
    console.print(table)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="dorarl bench trainer", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", required=True, type=Path, help="folder for trainer.json")
    parser.add_argument("--model", help="HF model folder (default: random weights of --shape)")
    parser.add_argument(
        "--shape", default="smollm2-135m", help=f"random-weight shape: {', '.join(SHAPES)}"
    )
    parser.add_argument("--quick", action="store_true", help="1 group of 8, one repeat")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument(
        "--micro-batch-tokens", type=int, default=None, help="trainer.micro_batch_tokens"
    )
    parser.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="trainer.activation_checkpointing=true (on the shared model: both contenders recompute)",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = TrainerConfig(activation_checkpointing=args.activation_checkpointing)
    if args.micro_batch_tokens:
        config.micro_batch_tokens = args.micro_batch_tokens
    model = build_model(args.shape, args.model)
    report = run(model, config, QUICK if args.quick else FULL, Console(stderr=True))
    report["quick"] = args.quick
    report["source"] = args.model or f"random {args.shape}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "trainer.json").write_text(json.dumps(report, indent=2))
    print_report(report, Console())
    return 0
