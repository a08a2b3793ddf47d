"""`dorarl bench engine`: the rollout engine against Hugging Face peers on a long-tailed workload.

Contenders decode the same requests (same prompts, same forced lengths, temperature-1
sampling, the same maximum batch): `engine` (ours), `hf_static` (HF `generate` on static
batches), `hf_continuous` (HF's own continuous batching), and `floor` (our forward over a
dense KV cache at a perfectly packed full batch: an upper bound, not a system). Only useful
tokens count: a static batch runs to its longest member, its padding work earns nothing.
Writes DIR/engine.json and prints a table. Every contender runs with the same torch thread
count (default 1). Figures are given on the wall clock and on this process's CPU clock: on
a CPU shared with other jobs the wall clock also measures their load, the CPU clock does not.
A real model's shape is `dorarl bench engine-model`, a device `dorarl bench engine-device`.
"""

from __future__ import annotations

import argparse
import logging
import math
import pickle
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import transformers
from rich.console import Console
from rich.table import Table
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from dorarl.bench.cli_args import engine_bench_parser, write_json
from dorarl.bench.clock import Laps, Stopwatch, load_window, timed
from dorarl.bench.dense_attention import DenseAttention
from dorarl.bench.hf_peers import Workload, long_tail_workload, run_hf_continuous
from dorarl.bench.report import clock_bars_table, fmt_or_dash
from dorarl.data.lengths import length_stats
from dorarl.engine import Engine, EngineConfig, SamplingParams
from dorarl.engine.sampler import SampleRow, sample
from dorarl.report.console import table_console

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchSpec:
    num_requests: int
    max_batch: int
    prompt_len: int
    median_len: int
    sigma: float  # lognormal shape: p99 / median = exp(2.326 * sigma)
    migration_contexts: tuple[int, ...]
    step_context: int
    hidden: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 2
    intermediate: int = 768
    vocab: int = 8192
    block_size: int = 16
    prefill_chunk: int = 512
    step_repeats: int = 40
    migration_repeats: int = 3
    seed: int = 0


FULL = BenchSpec(
    num_requests=256,
    max_batch=64,
    prompt_len=64,
    median_len=32,
    sigma=1.05,
    migration_contexts=(256, 1024, 4096),
    step_context=256,
)
QUICK = BenchSpec(
    num_requests=96,
    max_batch=32,
    prompt_len=64,
    median_len=16,
    sigma=1.05,
    migration_contexts=(256, 1024, 4096),
    step_context=256,
    step_repeats=20,
    migration_repeats=1,
)
BARS = {  # name: (what, target)
    "engine_vs_hf_static": ("tokens_per_s engine / hf_static", 3.0),
    "engine_vs_hf_continuous": ("tokens_per_s engine / hf_continuous", 1.5),
    "step_vs_floor": ("step_ms_full_batch engine / floor (at most)", 1.3),
    "reprefill_vs_migration_4096": ("reprefill_ms / migration_ms at 4096 tokens", 10.0),
}


# --- workload ---------------------------------------------------------------------------
def make_workload(spec: BenchSpec) -> Workload:
    return long_tail_workload(spec.num_requests, spec.median_len, spec.sigma, spec.prompt_len,
                              spec.vocab, spec.seed)  # fmt: skip


def build_model(spec: BenchSpec) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        hidden_size=spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        intermediate_size=spec.intermediate,
        vocab_size=spec.vocab,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    torch.manual_seed(spec.seed)
    return Qwen2ForCausalLM(config).eval()


def _params(target: int, seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, target_len=target, seed=seed)


# --- contenders -------------------------------------------------------------------------
def make_engine(
    model: Qwen2ForCausalLM, spec: BenchSpec, max_len: int, max_seqs: int, chunk: int | None = None
) -> Engine:
    config = EngineConfig(
        max_num_seqs=max_seqs,
        block_size=spec.block_size,
        max_model_len=max_len,
        prefill_chunk_size=chunk or spec.prefill_chunk,
    )
    return Engine.from_hf_config(model.config, config, model.state_dict())


def run_engine(model: Qwen2ForCausalLM, spec: BenchSpec, work: Workload) -> dict[str, Any]:
    engine = make_engine(model, spec, spec.prompt_len + max(work.lengths) + 1, spec.max_batch)

    def go() -> int:
        for i, (prompt, n) in enumerate(zip(work.prompts, work.lengths, strict=True)):
            engine.add_request(f"r{i}", prompt, _params(n, i))
        tokens = 0
        while engine.has_unfinished():
            tokens += sum(len(out.output_ids) for out in engine.step())
        return tokens

    tokens, took = timed(go)
    assert tokens == work.total_tokens, "forced lengths were not honoured"
    stats = engine.stats()
    return {
        "wall_s": took.wall_s,
        "cpu_s": took.cpu_s,
        "tokens": tokens,
        "steps": stats.steps,
        "tokens_per_step": tokens / stats.steps,
    }


def run_hf_static(model: Qwen2ForCausalLM, spec: BenchSpec, work: Workload) -> dict[str, Any]:
    """HF generate on static batches in arrival order; a batch decodes until its longest member."""
    padded = 0

    def go() -> None:
        nonlocal padded
        for lo in range(0, len(work.prompts), spec.max_batch):
            ids = torch.tensor(work.prompts[lo : lo + spec.max_batch])
            longest = max(work.lengths[lo : lo + spec.max_batch])
            padded += longest * len(ids)
            gen = GenerationConfig(
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=longest,
                min_new_tokens=longest,
                eos_token_id=None,
                pad_token_id=0,
            )
            with torch.inference_mode():
                model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)

    _, took = timed(go)
    return {
        "wall_s": took.wall_s,
        "cpu_s": took.cpu_s,
        "tokens": work.total_tokens,
        "decoded_tokens": padded,
    }


class Floor:
    """Our forward over a dense cache, one full batch at a fixed context: no paging, no scheduler."""

    def __init__(self, engine: Engine, batch: int, max_len: int) -> None:
        self.model = engine.model
        self.batch = batch
        self.dense = DenseAttention(engine.spec, batch, max_len, engine.device, engine.dtype)
        self.rows = [SampleRow(SamplingParams(temperature=1.0), seed, 0) for seed in range(batch)]
        self.ids = torch.zeros(batch, dtype=torch.long, device=engine.device)

    def prefill(self, prompt_len: int) -> None:
        ids = torch.zeros(self.batch * prompt_len, dtype=torch.long)
        positions = torch.arange(prompt_len).repeat(self.batch)
        self.dense.set_step(0, prompt_len)
        last = torch.arange(self.batch) * prompt_len + prompt_len - 1
        sample(self.model.forward(ids, positions, self.dense, last), self.rows)

    def decode(self, context: int, sampling: bool = True) -> None:
        """One decode step at `context` (overwrites that position: the context stays fixed)."""
        self.dense.set_step(context - 1, 1)
        positions = torch.full((self.batch,), context - 1, dtype=torch.long)
        logits = self.model.forward(self.ids, positions, self.dense)
        if sampling:
            sample(logits, self.rows)


def run_floor(engine: Engine, spec: BenchSpec, work: Workload) -> dict[str, Any]:
    """Prefill every prompt in full batches, then total/B decode steps at the token-weighted
    mean context: the time a perfectly packed batch would take, ignoring the tail."""
    lengths = work.lengths
    context = spec.prompt_len + round(sum(n * (n + 1) / 2 for n in lengths) / sum(lengths))
    floor = Floor(engine, spec.max_batch, spec.prompt_len + max(lengths) + 2)
    batches = math.ceil(len(lengths) / spec.max_batch)
    steps = math.ceil(work.total_tokens / spec.max_batch)

    def go() -> None:
        for _ in range(batches):
            floor.prefill(spec.prompt_len)
        for _ in range(steps):
            floor.decode(context)

    floor.decode(context)  # warm up
    _, took = timed(go)
    return {
        "wall_s": took.wall_s,
        "cpu_s": took.cpu_s,
        "tokens": work.total_tokens,
        "decode_steps": steps,
        "mean_context": context,
    }


# --- step time and migration ----------------------------------------------------------------
def step_ms_full_batch(model: Qwen2ForCausalLM, spec: BenchSpec) -> dict[str, float]:
    """Median decode step with a full batch at the same context, engine and floor interleaved."""
    batch, ctx, repeats = spec.max_batch, spec.step_context, spec.step_repeats
    # One prefill step for the whole batch, so every row then decodes at the same context.
    engine = make_engine(model, spec, ctx + repeats + 8, batch, chunk=batch * ctx)
    for i in range(batch):
        engine.add_request(f"s{i}", [i % spec.vocab] * ctx, _params(repeats + 4, i))
    while min(engine.progress(f"s{i}") for i in range(batch)) == 0:
        engine.step()  # prefill every request
    floor = Floor(engine, batch, ctx + 2)
    floor.decode(ctx + 1)
    steps = {
        "engine": engine.step,
        "floor": lambda: floor.decode(ctx + 1),
        "floor_forward_only": lambda: floor.decode(ctx + 1, sampling=False),
    }
    laps = {name: Laps() for name in steps}
    for _ in range(repeats):  # interleaved, so a burst of outside load hits all of them
        for name, fn in steps.items():
            laps[name].time(fn)
    medians = {name: lap.median() for name, lap in laps.items()}
    wall = {n: 1e3 * m.wall_s for n, m in medians.items()}
    cpu = {n: 1e3 * m.cpu_s for n, m in medians.items()}
    return {"batch": batch, "context": ctx, **wall, "cpu_ms": cpu}


def migration_vs_reprefill(model: Qwen2ForCausalLM, spec: BenchSpec) -> dict[str, Any]:
    """Time from leaving engine A to the next token on engine B: KV migration vs re-prefill."""
    max_len = max(spec.migration_contexts) + 16
    a, b = make_engine(model, spec, max_len, 4), make_engine(model, spec, max_len, 4)
    out: dict[str, dict[str, float]] = {
        "migration_ms": {},
        "reprefill_ms": {},
        "transfer_ms": {},
        "kv_mb": {},
    }
    for ctx in spec.migration_contexts:
        runs = [_one_migration(a, b, ctx, spec, rep) for rep in range(spec.migration_repeats)]
        for key in out:
            out[key][str(ctx)] = statistics.median(r[key] for r in runs)
    return out


def _one_migration(a: Engine, b: Engine, ctx: int, spec: BenchSpec, rep: int) -> dict[str, float]:
    prompt = [(7 * i + rep) % spec.vocab for i in range(ctx - 1)]
    request = f"m{ctx}-{rep}"
    a.add_request(request, prompt, _params(8, rep))
    while not a.progress(request):
        a.step()
    watch = Stopwatch()
    snap = pickle.loads(pickle.dumps(a.export_request(request)))
    b.import_request(snap)
    transfer = watch.wall_s()
    _step_to_next_token(b, request, 2)
    migration = watch.wall_s()
    tokens_only = b.abort(request)
    watch = Stopwatch()
    a.resume_request(tokens_only)
    _step_to_next_token(a, request, 3)
    reprefill = watch.wall_s()
    a.abort(request)
    kv_mb = snap.kv_bytes / 2**20
    return {
        "migration_ms": 1e3 * migration,
        "reprefill_ms": 1e3 * reprefill,
        "transfer_ms": 1e3 * transfer,
        "kv_mb": kv_mb,
    }


def _step_to_next_token(engine: Engine, request: str, num_output: int) -> None:
    while engine.progress(request) < num_output:
        engine.step()


# --- report -------------------------------------------------------------------------------
def compute_bars(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each bar on the wall clock and on this process's CPU clock (immune to other load)."""
    step = report["step_ms_full_batch"]
    wall = _bar_values(report, report["tokens_per_s"], step)
    cpu = _bar_values(report, report["tokens_per_cpu_s"], step["cpu_ms"])
    bars = {}
    for name, (what, target) in BARS.items():
        bars[name] = {
            "what": what,
            "target": target,
            "value": wall[name],
            "pass": _passes(name, wall[name], target),
            "value_cpu": cpu[name],
            "pass_cpu": _passes(name, cpu[name], target),
        }
    return bars


def _bar_values(
    report: dict[str, Any], tps: dict[str, float | None], step: dict[str, float]
) -> dict[str, float | None]:
    return {
        "engine_vs_hf_static": _ratio(tps["engine"], tps["hf_static"]),
        "engine_vs_hf_continuous": _ratio(tps["engine"], tps["hf_continuous"]),
        "step_vs_floor": _ratio(step["engine"], step["floor"]),
        "reprefill_vs_migration_4096": _ratio(
            report["reprefill_ms"].get("4096"), report["migration_ms"].get("4096")
        ),
    }


def _passes(name: str, value: float | None, target: float) -> bool | None:
    if value is None:
        return None
    return value <= target if name == "step_vs_floor" else value >= target


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


def print_report(report: dict[str, Any], console: Console) -> None:
    params, batch = report["model"]["parameters"] / 1e6, report["workload"]["max_batch"]
    table = Table(
        title=f"engine bench ({params:.1f}M params, batch {batch}, {report['threads']} thread)"
    )
    for col in ("contender", "tokens/s", "wall s", "speedup", "tokens/cpu-s", "cpu speedup"):
        table.add_column(col, justify="left" if col == "contender" else "right")
    tps, cps = report["tokens_per_s"], report["tokens_per_cpu_s"]
    for name in tps:
        table.add_row(
            name,
            fmt_or_dash(tps[name], ",.0f"),
            fmt_or_dash(report["wall_s"].get(name), ".2f"),
            fmt_or_dash(_ratio(tps["engine"], tps[name]), ".2f", "x"),
            fmt_or_dash(cps[name], ",.0f"),
            fmt_or_dash(_ratio(cps["engine"], cps[name]), ".2f", "x"),
        )
    console.print(table)
    if report.get("hf_continuous_error"):
        console.print(f"hf_continuous did not run: {report['hf_continuous_error']}")
    lens, step = report["workload"]["lengths"], report["step_ms_full_batch"]
    console.print(
        f"lengths: median {lens['median']}, p99 {lens['p99']}, max {lens['max']} "
        f"(p99/median {lens['p99_over_median']:.1f}); load average "
        f"{report['load_average_start']} -> {report['load_average']}"
    )
    console.print(
        f"decode step, batch {step['batch']}, context {step['context']}: engine {step['engine']:.2f} ms "
        f"(cpu {step['cpu_ms']['engine']:.2f}), floor {step['floor']:.2f} ms (cpu {step['cpu_ms']['floor']:.2f}), "
        f"floor forward only {step['floor_forward_only']:.2f} ms"
    )
    _print_migration(report, console)
    _print_bars(report["bars"], console)


def _print_migration(report: dict[str, Any], console: Console) -> None:
    table = Table(title="migration (export + pickle + import + next token) vs re-prefill")
    for col in ("context", "KV MB", "transfer ms", "migration ms", "reprefill ms", "ratio"):
        table.add_column(col, justify="right")
    for ctx, mig in report["migration_ms"].items():
        re = report["reprefill_ms"][ctx]
        table.add_row(
            ctx,
            f"{report['kv_mb'][ctx]:.1f}",
            f"{report['transfer_ms'][ctx]:.1f}",
            f"{mig:.1f}",
            f"{re:.1f}",
            f"{re / mig:.1f}x",
        )
    console.print(table)


def _print_bars(bars: dict[str, dict[str, Any]], console: Console) -> None:
    console.print(clock_bars_table("bars", bars))


# --- entry point ----------------------------------------------------------------------------
def run(spec: BenchSpec, console: Console, skip_hf: bool = False) -> dict[str, Any]:
    """Every contender, the step at full batch and migration: what engine.json holds."""
    with load_window() as window:
        model, work = build_model(spec), make_workload(spec)
        report = _header(spec, model, work)
        report.update(_throughput(model, spec, work, console, skip_hf))
        console.log("step time at full batch")
        report["step_ms_full_batch"] = step_ms_full_batch(model, spec)
        console.log("migration vs re-prefill")
        report.update(migration_vs_reprefill(model, spec))
        report["bars"] = compute_bars(report)
    return report | window.fields()


def _throughput(
    model: Qwen2ForCausalLM, spec: BenchSpec, work: Workload, console: Console, skip_hf: bool
) -> dict[str, Any]:
    results, error = _run_contenders(model, spec, work, console, skip_hf)
    names = ("engine", "hf_static", "hf_continuous", "floor")
    return {
        "hf_continuous_error": error,
        "tokens_per_s": {n: _per(results.get(n), "wall_s") for n in names},
        "tokens_per_cpu_s": {n: _per(results.get(n), "cpu_s") for n in names},
        "wall_s": {n: r["wall_s"] for n, r in results.items()},
        "details": results,
    }


def _per(result: dict[str, Any] | None, clock: str) -> float | None:
    return None if result is None else result["tokens"] / result[clock]


def _header(spec: BenchSpec, model: Qwen2ForCausalLM, work: Workload) -> dict[str, Any]:
    return {
        "spec": asdict(spec),
        "threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "model": {"arch": "qwen2", "parameters": sum(p.numel() for p in model.parameters())},
        "workload": {
            "num_requests": spec.num_requests,
            "prompt_len": spec.prompt_len,
            "max_batch": spec.max_batch,
            "total_tokens": work.total_tokens,
            "lengths": length_stats(work.lengths),
        },
    }


def _run_contenders(
    model: Qwen2ForCausalLM, spec: BenchSpec, work: Workload, console: Console, skip_hf: bool
) -> tuple[dict[str, dict[str, Any]], str | None]:
    weights_only = make_engine(model, spec, spec.prompt_len + max(work.lengths) + 2, 1)
    runs: dict[str, Callable[[], dict[str, Any]]] = {
        "engine": lambda: run_engine(model, spec, work),
        "floor": lambda: run_floor(weights_only, spec, work),
    }
    if not skip_hf:
        runs["hf_static"] = lambda: run_hf_static(model, spec, work)
        runs["hf_continuous"] = lambda: run_hf_continuous(model, spec, work)
    results, error = {}, None
    for name, fn in runs.items():
        console.log(f"running {name}")
        try:
            results[name] = fn()
        except Exception as exc:
            if name != "hf_continuous":
                raise
            logger.exception("hf_continuous failed")  # report why the peer could not run, go on
            error = f"{type(exc).__name__}: {exc}"
    return results, error


def arguments() -> argparse.ArgumentParser:
    parser = engine_bench_parser("dorarl bench engine", __doc__, "engine.json")
    parser.add_argument("--quick", action="store_true", help="reduced workload, under a minute")
    parser.add_argument("--skip-hf", action="store_true", help="skip the Hugging Face contenders")
    return parser


def main(argv: list[str]) -> int:
    args = arguments().parse_args(argv)
    torch.set_num_threads(args.threads)
    report = run(QUICK if args.quick else FULL, Console(stderr=True), args.skip_hf)
    report["quick"] = args.quick
    write_json(args.out, "engine.json", report)
    print_report(report, table_console())
    return 0
