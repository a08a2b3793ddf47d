"""`dorarl bench trainer`: our trainer's forward+backward against a plain HF one, same samples.

The contenders run in this process on the same model, samples and token budget: `trainer`
is `Trainer.accumulate_gradients` (GRPO loss, chunked output layer, metrics) with shared-
prompt packing (each prompt once per row, then its group's responses), `trainer_padded` the
same with one right-padded row per response, `hf` is `model(input_ids, labels=...)` then
`loss.backward()` on the padded rows, as HF users do it, `trainer_torch_ops` the packed
trainer without its fused CPU kernels (`trainer.kernels=torch`; where they are on), and
`floor` is the time of the packed
step's own matrix multiplications on its shapes (dorarl.bench.matmul_floor). Tokens/s counts
the samples' real prompt + response tokens (each prompt once per sample) for every
contender, so packing's saving shows as a higher rate; `positions` is what each computes.
The two trainer modes' loss and gradient norm are compared (they must agree). Two last full
`train_step`s (packed) give the peak memory of a step: the first without AdamW state (it is
made at the first update), the second with it, as every later step. Writes
DIR/trainer.json and prints a table. Wall and CPU clocks are both given: on a CPU shared
with other jobs the wall clock also measures their load. `--profile` adds the packed
trainer's time by torch op over one more forward+backward (dorarl.bench.op_profile).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import statistics
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import Any

import torch
import transformers
from rich.console import Console
from rich.table import Table
from transformers import PreTrainedModel

from dorarl.bench.cli_args import write_json
from dorarl.bench.clock import Laps, load_window
from dorarl.bench.matmul_floor import MicroShape, floor_ms
from dorarl.bench.op_profile import profile_ops
from dorarl.bench.shapes import SHAPES, random_llama
from dorarl.data import Group, Sample
from dorarl.errors import UserInputError
from dorarl.report.console import table_console
from dorarl.trainer import Trainer, TrainerConfig, load_model
from dorarl.trainer.allocator import release_free_heap
from dorarl.trainer.autocast import autocast_context
from dorarl.trainer.batch import build_sequences, collate, plan_micro_batches
from dorarl.trainer.kernels import own_forwards
from dorarl.trainer.memory import PeakMemory
from dorarl.trainer.packing import Packing, micro_batches

BARS = {  # name: (what, target)
    "trainer_vs_hf": ("tokens/s trainer / hf forward+backward (at least)", 0.8),
    "packed_vs_padded": ("tokens/s trainer packed / trainer padded (at least)", 1.0),
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
    min_len: int = 1
    repeats: int = 2
    seed: int = 0


FULL = Workload(groups=8)
QUICK = Workload(groups=1, repeats=1)
# The arith task on SmolLM2's ChatML template: ~45-token prompts, answers of 10-48 tokens.
ARITH = Workload(groups=4, prompt_len=45, median_len=24, sigma=0.45, min_len=10, max_len=48)


def make_groups(work: Workload, vocab: int) -> list[Group]:
    """Stratified lognormal response lengths (cut at max_len), rewards 0/1 within a group."""
    n, dist = work.groups * work.group_size, NormalDist()
    lengths = [
        min(
            work.max_len,
            max(work.min_len, round(work.median_len * math.exp(work.sigma * dist.inv_cdf(q)))),
        )
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
    laps: Laps = field(default_factory=Laps)
    peak_memory_gb: float = 0.0


def _measure(contenders: dict[str, Callable[[], Any]], repeats: int) -> dict[str, Timing]:
    """Contenders take turns within each repeat, so a change of load on a shared machine
    falls on both rather than on whichever ran during it."""
    timings = {name: Timing() for name in contenders}
    peak = PeakMemory("cpu")
    for _ in range(repeats):
        for name, fn in contenders.items():
            release_free_heap()
            peak.start()
            timing = timings[name]
            timing.laps.time(fn)
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
        # HF's own forward (not the trainer's fused kernels), autocast as the trainer's
        with own_forwards(model), autocast_context(trainer.config.autocast, trainer.device):
            loss = model(input_ids=batch.input_ids, labels=labels, use_cache=False).loss
        loss.backward()
    model.zero_grad(set_to_none=True)


def trainer_forward_backward(
    trainer: Trainer, groups: list[Group], packing: Packing
) -> dict[str, float]:
    """One accumulation in `packing` mode; its loss metrics and gradient norm."""
    trainer.packing = packing
    metrics = trainer.accumulate_gradients(groups)
    grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
    metrics["grad_norm"] = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
    trainer.model.zero_grad(set_to_none=True)
    return metrics


def micro_shapes(trainer: Trainer, groups: list[Group], packing: Packing) -> list[MicroShape]:
    seqs = build_sequences(groups, trainer.config.loss)
    batches = micro_batches(
        seqs, trainer.micro_batch_tokens, packing, trainer.pad_id, "cpu", trainer.model.config
    )
    return [
        MicroShape(
            rows=b.input_ids.shape[0],
            width=b.input_ids.shape[1],
            response_tokens=int(b.mask.sum()),
        )
        for b in batches
    ]


# --- run and report -----------------------------------------------------------------------
def run(
    model: PreTrainedModel,
    config: TrainerConfig,
    work: Workload,
    console: Console,
    profile: bool = False,
) -> dict[str, Any]:
    """Every contender on the workload's groups, the floor and two full steps: trainer.json;
    with `profile`, the packed trainer's ops over one more forward+backward."""
    with load_window() as window:
        groups = make_groups(work, model.config.vocab_size)
        trainer = _packing_trainer(model, config)
        modes: tuple[Packing, ...] = ("shared_prompt", "padded")
        shapes = {mode: micro_shapes(trainer, groups, mode) for mode in modes}
        report = _header(model, config, work, groups, shapes, trainer.micro_batch_tokens)
        timings, step_metrics = _take_turns(model, trainer, groups, work.repeats, console)
        console.log("floor: the packed step's matrix multiplications")
        body_dtype = torch.bfloat16 if config.autocast == "bf16" else torch.float32
        floor = floor_ms(model.config, shapes["shared_prompt"], body_dtype=body_dtype)
        if profile:
            console.log("profile: the packed trainer's ops over one forward+backward")
            report["profile"] = profile_ops(
                lambda: trainer_forward_backward(trainer, groups, "shared_prompt")
            )
        console.log("two full train_steps (AdamW included) for their peak memory")
        steps = _full_steps(trainer, groups)
        report.update(_results(report["workload"]["tokens"], timings, floor, steps))
        report["agreement"] = _agreement(step_metrics["shared_prompt"], step_metrics["padded"])
        report["bars"] = compute_bars(report)
    return report | window.fields()


def _packing_trainer(model: PreTrainedModel, config: TrainerConfig) -> Trainer:
    trainer = Trainer(model, config)
    if trainer.packing != "shared_prompt":
        raise UserInputError(
            f"{type(model).__name__} cannot train on packed rows (see the warning above); "
            "this bench compares packed with padded"
        )
    return trainer


def _take_turns(
    model: PreTrainedModel, trainer: Trainer, groups: list[Group], repeats: int, console: Console
) -> tuple[dict[str, Timing], dict[str, dict[str, float]]]:
    """The trainer packed and padded and HF, after a warm-up: their timings, and each
    trainer mode's loss metrics."""
    step_metrics: dict[str, dict[str, float]] = {}

    def trainer_contender(mode: Packing) -> Callable[[], None]:
        return lambda: step_metrics.update({mode: trainer_forward_backward(trainer, groups, mode)})

    def torch_ops_contender() -> None:
        with torch_ops(trainer):
            trainer_forward_backward(trainer, groups, "shared_prompt")

    contenders = {
        "trainer": trainer_contender("shared_prompt"),
        "trainer_padded": trainer_contender("padded"),
        "hf": lambda: hf_forward_backward(model, trainer, groups),
    }
    if trainer.fused:
        contenders["trainer_torch_ops"] = torch_ops_contender
    console.log("warm-up (two samples each)")
    warm = [Group(0, 0, 0, groups[0].samples[:2])]
    trainer_forward_backward(trainer, warm, "shared_prompt")
    trainer_forward_backward(trainer, warm, "padded")
    hf_forward_backward(model, trainer, warm)
    console.log(f"{', '.join(contenders)}, taking turns, x{repeats}")
    return _measure(contenders, repeats), step_metrics


@contextlib.contextmanager
def torch_ops(trainer: Trainer) -> Iterator[None]:
    """The trainer as `trainer.kernels=torch` would run it, inside the block."""
    split, fused = trainer.split, trainer.split is not None and trainer.split.fused
    with own_forwards(trainer.model):
        if split is not None:
            split.fused = False
        try:
            yield
        finally:
            if split is not None:
                split.fused = fused


def _full_steps(trainer: Trainer, groups: list[Group]) -> list[dict[str, Any]]:
    """Two packed train_steps (the trainer's own packing, as `_packing_trainer` checked):
    the first without AdamW state, the second with it."""
    trainer.packing = "shared_prompt"
    steps = []
    for _ in range(2):
        release_free_heap()
        steps.append(trainer.train_step(groups))
    return steps


def _agreement(packed: dict[str, float], padded: dict[str, float]) -> dict[str, float]:
    """Relative differences of the packed step's numbers from the padded step's."""
    keys = ("loss", "pg_loss", "grad_norm", "entropy", "kl_behavior", "ratio_mean")
    return {
        key: abs(packed[key] - padded[key]) / max(abs(padded[key]), 1e-12)
        for key in keys
        if key in packed
    }


def _header(
    model: PreTrainedModel,
    config: TrainerConfig,
    work: Workload,
    groups: list[Group],
    shapes: dict[str, list[MicroShape]],
    trainer_tokens: int,
) -> dict[str, Any]:
    samples = [s for g in groups for s in g.samples]
    return {
        "workload_spec": asdict(work),
        "trainer_config": {
            "micro_batch_tokens": config.micro_batch_tokens,
            "micro_batch_tokens_used": trainer_tokens,
            "packing": config.packing,
            "logits_chunk_tokens": config.logits_chunk_tokens,
            "activation_checkpointing": config.activation_checkpointing,
            "autocast": config.autocast,
        },
        "threads": torch.get_num_threads(),
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
            "positions": {
                mode: sum(m.rows * m.width for m in micro) for mode, micro in shapes.items()
            },
            "micro_batches": {mode: [asdict(m) for m in micro] for mode, micro in shapes.items()},
            "response_len_mean": statistics.fmean(len(s.response_ids) for s in samples),
        },
    }


def _results(
    tokens: int, timings: dict[str, Timing], floor: dict[str, float], steps: list[dict[str, Any]]
) -> dict[str, Any]:
    medians = {n: t.laps.median() for n, t in timings.items()}
    wall = {n: m.wall_s for n, m in medians.items()}
    cpu = {n: m.cpu_s for n, m in medians.items()}
    wall["floor"] = floor["total"] / 1e3
    return {
        "ms_per_step": {n: s * 1e3 for n, s in wall.items()},
        "cpu_ms_per_step": {n: s * 1e3 for n, s in cpu.items()},
        "tokens_per_s": {n: tokens / s for n, s in wall.items()},
        "tokens_per_cpu_s": {n: tokens / s for n, s in cpu.items()},
        "wall_s_all": {n: t.laps.wall_s for n, t in timings.items()},
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
        "packed_vs_padded": (
            tps["trainer"] / tps["trainer_padded"],
            cps["trainer"] / cps["trainer_padded"],
        ),
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


# Which micro-batch plan each contender computes.
CONTENDER_PLAN = {
    "trainer": "shared_prompt",
    "trainer_padded": "padded",
    "hf": "padded",
    "trainer_torch_ops": "shared_prompt",
}
CONTENDER_PLAN["floor"] = "shared_prompt"


def print_report(report: dict[str, Any], console: Console) -> None:
    model, work = report["model"], report["workload"]
    table = Table(
        title=f"trainer bench ({model['parameters'] / 1e6:.1f}M params, {work['samples']} "
        f"samples, {work['tokens']} tokens, {report['threads']} threads)"
    )
    columns = ("contender", "positions", "ms/step", "tokens/s", "vs hf", "cpu ms", "cpu vs hf")
    for col in (*columns, "peak GB"):
        table.add_column(col, justify="left" if col == "contender" else "right")
    ms, cpu_ms, tps = report["ms_per_step"], report["cpu_ms_per_step"], report["tokens_per_s"]
    for name in ms:
        plan = CONTENDER_PLAN[name]
        table.add_row(
            name,
            f"{work['positions'][plan]:,} in {len(work['micro_batches'][plan])}",
            f"{ms[name]:,.0f}",
            f"{tps[name]:,.1f}",
            f"{tps[name] / tps['hf']:.2f}x",
            f"{cpu_ms[name]:,.0f}" if name in cpu_ms else "-",
            f"{cpu_ms['hf'] / cpu_ms[name]:.2f}x" if name in cpu_ms else "-",
            f"{report['peak_memory_gb'][name]:.2f}" if name in report["peak_memory_gb"] else "-",
        )
    table.caption = (
        f"positions: tokens computed (rows x width, padding included) in N micro-batches, for "
        f"{work['tokens']:,} sample tokens; tokens/s counts the sample tokens for all"
    )
    console.print(table)
    _print_footer(report, console)
    if "profile" in report:
        _print_profile(report["profile"], console)
    _print_bars(report["bars"], console)


def _print_footer(report: dict[str, Any], console: Console) -> None:
    floor, step = report["floor_ms"], report["train_step"]
    worst = max(report["agreement"].items(), key=lambda kv: kv[1])
    console.print(
        f"floor {floor['total']:,.0f} ms = linear {floor['linear']:,.0f} + attention "
        f"{floor['attention']:,.0f} + output layer {floor['output_layer']:,.0f} (packed shapes)"
    )
    console.print(
        f"packed vs padded trainer: largest relative difference {worst[1]:.1e} ({worst[0]}) "
        f"over {', '.join(report['agreement'])}"
    )
    per_step = " / ".join(f"{gb:.2f}" for gb in step["peak_memory_gb_per_step"])
    console.print(
        f"full train_step (AdamW included): {step['ms']:,.0f} ms, {step['micro_batches']:.0f} "
        f"micro-batches, peak memory {per_step} GB (first step / with AdamW state); "
        f"load average {report['load_average_start']} -> {report['load_average']}"
    )


def _print_profile(profile: dict[str, Any], console: Console) -> None:
    table = Table(
        title=f"packed trainer by op: {profile['self_ms']:,.0f} ms, matrix products "
        f"{profile['matrix_products_share']:.0%}"
    )
    for col in ("op", "own ms", "share", "calls"):
        table.add_column(col, justify="left" if col == "op" else "right")
    for op in profile["ops"]:
        table.add_row(op["op"], f"{op['self_ms']:,.0f}", f"{op['share']:.1%}", str(op["calls"]))
    console.print(table)


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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dorarl bench trainer", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", required=True, type=Path, help="folder for trainer.json")
    parser.add_argument("--model", help="HF model folder (default: random weights of --shape)")
    parser.add_argument(
        "--shape", default="smollm2-135m", help=f"random-weight shape: {', '.join(SHAPES)}"
    )
    parser.add_argument("--quick", action="store_true", help="1 group of 8, one repeat")
    parser.add_argument(
        "--arith",
        action="store_true",
        help="4 groups of 8 shaped like the arith task on SmolLM2's chat template "
        "(45-token prompts, responses of 10-48 tokens)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also profile one packed forward+backward by torch op (each op's own time)",
    )
    parser.add_argument(
        "--micro-batch-tokens", type=int, default=None, help="trainer.micro_batch_tokens"
    )
    parser.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="trainer.activation_checkpointing=true (on the shared model: every contender "
        "recomputes)",
    )
    parser.add_argument(
        "--autocast",
        choices=("none", "bf16"),
        default="none",
        help="trainer.autocast (bf16: every contender's decoder products in bfloat16, and "
        "the floor's)",
    )
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = TrainerConfig(
        activation_checkpointing=args.activation_checkpointing, autocast=args.autocast
    )
    if args.micro_batch_tokens:
        config.micro_batch_tokens = args.micro_batch_tokens
    model = build_model(args.shape, args.model)
    work = QUICK if args.quick else ARITH if args.arith else FULL
    report = run(model, config, work, Console(stderr=True), profile=args.profile)
    report["quick"] = args.quick
    report["source"] = args.model or f"random {args.shape}"
    write_json(args.out, "trainer.json", report)
    print_report(report, table_console())
    return 0
