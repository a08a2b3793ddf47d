"""`dorarl bench prefix-cache`: shared prompts with the engine's prefix cache on and off.

Two workloads on one model, each run with `engine.prefix_cache=on` and `=off` one after the
other in the same process (same prompts, forced response lengths, seeded sampling at
temperature 1, the same engine keys otherwise):
- `group`: GRPO's G samples of each prompt (G=8, prompts of 512 tokens);
- `system`: episodes that each start with the same 1,024-token system prompt (instructions
  and tool descriptions) and go on with a task of their own (64 tokens).
For each: prompt tokens computed and saved, the hit rate, wall and CPU time, rollout tokens/s
(response tokens over the run's time), and whether every token and log-prob was the same
with the cache on and off. The prediction comes from the prefill share: a run of the same
requests with one response token each (cache off) takes the time their prefill takes, T_p;
the cache leaves a share r = computed(on) / computed(off) of it, so the predicted speedup is
T_off / (T_off - (1 - r) T_p), set beside the measured T_off / T_on (the bar: at least 0.85
of it; decode steps that read one shared copy of a prefix from the CPU's caches can add to
it, and `decode_on` against `decode_off` shows by how much). Both clocks are given; on a
shared machine the CPU clock is the one to read (other jobs on the cores move the wall).
On the tiny model of `bench engine` and, with `--model DIR | --shape S`, a real one; writes
DIR/prefix_cache.json.
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from rich.console import Console
from rich.table import Table
from transformers import PreTrainedModel

from dorarl.bench.cli_args import engine_bench_parser, write_json
from dorarl.bench.clock import load_window, timed
from dorarl.bench.report import clock_bars_table
from dorarl.bench.shapes import SHAPES
from dorarl.engine import Engine, EngineConfig, SamplingParams
from dorarl.report.console import table_console

BARS = {  # name: (what, target), each at least its target
    "group_prefill_reduction": ("prefill tokens computed, off / on, group workload", 7.0),
    "system_prefill_reduction": ("prefill tokens computed, off / on, system-prompt workload", 7.0),
    "group_speedup_vs_predicted": ("speedup on/off over its prediction, group", 0.85),
    "system_speedup_vs_predicted": ("speedup on/off over its prediction, system", 0.85),
}


@dataclass(frozen=True)
class PrefixSpec:
    prompts: int = 8  # group workload: prompts, each sampled group_size times
    group_size: int = 8
    prompt_len: int = 512
    episodes: int = 32  # system workload
    system_len: int = 1024
    task_len: int = 64
    response_len: int = 32  # tokens each request samples, forced
    max_num_seqs: int = 64
    block_size: int = 16
    prefill_chunk: int = 512
    seed: int = 0


QUICK = PrefixSpec(prompts=4, episodes=16, response_len=16)


@dataclass
class Request:
    prompt: list[int]
    seed: int


def group_workload(spec: PrefixSpec, vocab: int) -> list[Request]:
    rng = random.Random(spec.seed)
    prompts = [[rng.randrange(vocab) for _ in range(spec.prompt_len)] for _ in range(spec.prompts)]
    return [Request(p, i * spec.group_size + s) for i, p in enumerate(prompts)
            for s in range(spec.group_size)]  # fmt: skip


def system_workload(spec: PrefixSpec, vocab: int) -> list[Request]:
    rng = random.Random(spec.seed + 1)
    system = [rng.randrange(vocab) for _ in range(spec.system_len)]
    tasks = [[rng.randrange(vocab) for _ in range(spec.task_len)] for _ in range(spec.episodes)]
    return [Request(system + task, i) for i, task in enumerate(tasks)]


def run_workload(
    model: PreTrainedModel, spec: PrefixSpec, requests: list[Request], cache: str, tokens: int
) -> tuple[dict[str, Any], dict[str, tuple[list[int], list[float]]]]:
    """One run of `requests`, each sampling `tokens` tokens: its figures, and its outputs."""
    engine = _engine(model, spec, requests, cache)
    outputs: dict[str, tuple[list[int], list[float]]] = {}

    def go() -> None:
        for i, req in enumerate(requests):
            params = SamplingParams(temperature=1.0, target_len=tokens, seed=req.seed)
            engine.add_request(f"r{i}", req.prompt, params)
        while engine.has_unfinished():
            for out in engine.step():
                outputs[out.request_id] = (out.output_ids, out.logprobs)

    _, took = timed(go)
    wall, cpu = took.wall_s, took.cpu_s
    stats = engine.stats()
    generated = sum(len(ids) for ids, _ in outputs.values())
    return {
        "prefix_cache": cache,
        "wall_s": wall,
        "cpu_s": cpu,
        "response_tokens": generated,
        "tokens_per_s": generated / wall,
        "tokens_per_cpu_s": generated / cpu,
        "prefill_tokens": stats.prefill_tokens,
        "prefill_saved_tokens": stats.prefill_saved_tokens,
        "prefix_hit_rate": stats.prefix_hit_rate,
        "steps": stats.steps,
        "cached_blocks_at_end": stats.kv_blocks_cached,
    }, outputs


def _engine(model: PreTrainedModel, spec: PrefixSpec, requests: list[Request], cache: str):
    longest = max(len(r.prompt) for r in requests) + spec.response_len + 1
    max_len = spec.block_size * math.ceil(longest / spec.block_size)
    # Room for every request at once without the cache: no run is slowed by eviction.
    blocks = sum(math.ceil((len(r.prompt) + spec.response_len) / spec.block_size)
                 for r in requests)  # fmt: skip
    config = EngineConfig(
        max_num_seqs=spec.max_num_seqs, block_size=spec.block_size, max_model_len=max_len,
        prefill_chunk_size=spec.prefill_chunk, num_blocks=max(blocks, max_len // spec.block_size),
        prefix_cache=cache,
    )  # fmt: skip
    return Engine.from_hf_config(model.config, config, model.state_dict())


def compare(
    model: PreTrainedModel, spec: PrefixSpec, requests: list[Request], console: Console
) -> dict[str, Any]:
    """Cache off, its prefill alone, cache on: the figures, the prediction and the check."""
    console.log(f"  cache off ({len(requests)} requests)")
    off, off_out = run_workload(model, spec, requests, "off", spec.response_len)
    console.log("  prefill alone (one token each, cache off)")
    prefill, _ = run_workload(model, spec, requests, "off", 1)
    console.log("  cache on")
    on, on_out = run_workload(model, spec, requests, "on", spec.response_len)
    left = on["prefill_tokens"] / off["prefill_tokens"]
    report: dict[str, Any] = {"off": off, "prefill_only": prefill, "on": on}
    report["prefill_reduction"] = off["prefill_tokens"] / on["prefill_tokens"]
    for clock in ("wall_s", "cpu_s"):
        saved = (1 - left) * prefill[clock]
        report[f"prefill_share_{clock}"] = prefill[clock] / off[clock]
        report[f"predicted_speedup_{clock}"] = off[clock] / (off[clock] - saved)
        report[f"speedup_{clock}"] = off[clock] / on[clock]
        # what is not prefill: decode steps (and the rest of each run)
        report[f"decode_off_{clock}"] = off[clock] - prefill[clock]
        report[f"decode_on_{clock}"] = on[clock] - left * prefill[clock]
    report["identical"] = on_out == off_out
    return report


def prefix_report(model: PreTrainedModel, spec: PrefixSpec, console: Console) -> dict[str, Any]:
    vocab = model.config.vocab_size
    report: dict[str, Any] = {"spec": asdict(spec), "parameters": model.num_parameters()}
    for name, make in (("group", group_workload), ("system", system_workload)):
        console.log(f"prefix cache: {name} workload")
        report[name] = compare(model, spec, make(spec, vocab), console)
    report["bars"] = compute_bars(report)
    return report


def compute_bars(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    bars = {}
    for name, (what, target) in BARS.items():
        work = report[name.split("_")[0]]
        if name.endswith("prefill_reduction"):
            value = value_cpu = work["prefill_reduction"]
        else:
            value = work["speedup_wall_s"] / work["predicted_speedup_wall_s"]
            value_cpu = work["speedup_cpu_s"] / work["predicted_speedup_cpu_s"]
        bars[name] = {
            "what": what, "target": target, "value": value, "pass": value >= target,
            "value_cpu": value_cpu, "pass_cpu": value_cpu >= target,
        }  # fmt: skip
    return bars


def print_prefix_report(report: dict[str, Any], console: Console, title: str) -> None:
    table = Table(title=f"prefix cache, {title}")
    for col in ("workload", "cache", "prefill computed", "saved", "hit rate", "tokens/s",
                "tokens/cpu-s", "wall s", "cpu s"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("workload", "cache") else "right")
    for name in ("group", "system"):
        for run in ("off", "on"):
            r = report[name][run]
            table.add_row(
                name, run, f"{r['prefill_tokens']:,}", f"{r['prefill_saved_tokens']:,}",
                f"{r['prefix_hit_rate']:.1%}", f"{r['tokens_per_s']:,.0f}",
                f"{r['tokens_per_cpu_s']:,.0f}", f"{r['wall_s']:.2f}", f"{r['cpu_s']:.2f}",
            )  # fmt: skip
    console.print(table)
    for name in ("group", "system"):
        w = report[name]
        console.print(
            f"{name}: prefill {w['prefill_reduction']:.2f}x fewer tokens; prefill share "
            f"{w['prefill_share_cpu_s']:.0%} (cpu) -> predicted {w['predicted_speedup_cpu_s']:.2f}x, "
            f"measured {w['speedup_cpu_s']:.2f}x (wall: predicted "
            f"{w['predicted_speedup_wall_s']:.2f}x, measured {w['speedup_wall_s']:.2f}x); "
            f"the rest (decode) {w['decode_off_cpu_s']:.2f} -> {w['decode_on_cpu_s']:.2f} cpu s; "
            f"tokens and log-probs {'identical' if w['identical'] else 'DIFFER'} on and off"
        )
    console.print(clock_bars_table("prefix cache bars", report["bars"]))


def arguments() -> argparse.ArgumentParser:
    parser = engine_bench_parser("dorarl bench prefix-cache", __doc__, "prefix_cache.json")
    parser.add_argument(
        "--quick", action="store_true",
        help=f"{QUICK.prompts} prompts and {QUICK.episodes} episodes, {QUICK.response_len} "
        "response tokens each",
    )  # fmt: skip
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", type=Path, help="also a local Hugging Face model folder")
    source.add_argument(
        "--shape", choices=sorted(SHAPES), help="also random weights of a real model's shape"
    )
    parser.add_argument("--skip-tiny", action="store_true", help="only --model or --shape")
    return parser


def main(argv: list[str]) -> int:
    from dorarl.bench.engine import FULL, build_model
    from dorarl.bench.engine_model import load_model
    from dorarl.errors import UserInputError

    args = arguments().parse_args(argv)
    if args.skip_tiny and not (args.model or args.shape):
        raise UserInputError("--skip-tiny needs --model DIR or --shape NAME")
    torch.set_num_threads(args.threads)
    spec, log = QUICK if args.quick else PrefixSpec(), Console(stderr=True)
    report: dict[str, Any] = {
        "quick": args.quick, "threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }  # fmt: skip
    with load_window() as window:
        if not args.skip_tiny:
            report["tiny"] = prefix_report(build_model(FULL), spec, log) | {"source": "tiny"}
        if args.model or args.shape:
            model = load_model(args.model, args.shape)
            report["model"] = prefix_report(model, spec, log)
            report["model"]["source"] = str(args.model) if args.model else args.shape
    report |= window.fields()
    write_json(args.out, "prefix_cache.json", report)
    console = table_console()
    for name in ("tiny", "model"):
        if name in report:
            print_prefix_report(report[name], console, report[name]["source"])
    console.print(f"load average {report['load_average_start']} -> {report['load_average']}")
    return 0
