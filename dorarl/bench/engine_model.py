"""`dorarl bench engine-model --model DIR | --shape smollm2-135m`: the engine on a real model.

Static batches of B greedy requests (B = 32 and 64, random prompts, exactly `new_tokens` new
tokens each) decoded by our engine and by HF `generate` in the same run, with the floor: the
time of the decode step's own matrix multiplications (q|k|v, o, gate|up and down of every
layer and the lm_head, on the model's weights at M = B rows, on the kernel the engine runs
them on), timed right after each engine decode step so that both see the same outside load.
The same products on F.linear (what HF runs) are timed after every 4th step beside it. Wall
and this process's CPU clock both. Writes DIR/engine.json (under `real_model`).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from rich.console import Console
from rich.table import Table
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    PreTrainedModel,
)

from dorarl.bench.cli_args import engine_bench_parser, write_json
from dorarl.bench.clock import Laps, load_window
from dorarl.bench.engine_backends import (
    DTYPES,
    BackendSpec,
    parse_backends,
    print_backends,
    run_backends,
)
from dorarl.bench.report import clock_bars_table, fmt_or_dash
from dorarl.bench.shapes import SHAPES, random_llama
from dorarl.engine import Engine, EngineConfig, SamplingParams
from dorarl.engine.linear import Linear
from dorarl.engine.model_spec import read_hf_config
from dorarl.engine.weights import ModelWeights
from dorarl.errors import UserInputError
from dorarl.report.console import table_console

REAL_BARS = {  # name: (what, target, at most?)
    "step_vs_matmuls_32": ("decode step engine / its matmuls at batch 32 (at most)", 1.3, True),
    "engine_vs_hf_static_32": ("tokens_per_s engine / hf_static at batch 32", 1.2, False),
    "engine_tokens_per_s_64": ("engine tokens_per_s at batch 64", 100.0, False),
}


@dataclass(frozen=True)
class RealSpec:
    batches: tuple[int, ...] = (32, 64)
    prompt_len: int = 32
    new_tokens: int = 48
    seed: int = 0
    # 32-token KV blocks: on CPU, decode attention's cost is mostly per block (one small
    # product per block and kv head), so 32 beats the engine's default 16 at every context.
    block_size: int = 32


def load_model(model_dir: Path | None, shape: str | None, seed: int = 0) -> PreTrainedModel:
    """A local HF folder (safetensors only) or a seeded random model of a named shape."""
    if model_dir is not None:
        read_hf_config(model_dir)  # refuses a missing config or an unsupported architecture
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32, use_safetensors=True
        )
        return model.eval()
    return random_llama(shape, seed).eval()


def _median_ms(laps: Laps) -> dict[str, float]:
    median = laps.median()
    return {"ms": 1e3 * median.wall_s, "cpu_ms": 1e3 * median.cpu_s}


def _total(*laps: Laps) -> dict[str, float]:
    return {
        "wall_s": sum(lap.total().wall_s for lap in laps),
        "cpu_s": sum(lap.total().cpu_s for lap in laps),
    }


class StepMatmuls:
    """The decode step's matrix multiplications on the engine's own weights, at M = batch rows:
    on the engine's kernel (its `Linear`s), or with `plain` on F.linear with the same weights."""

    def __init__(
        self, weights: ModelWeights, batch: int, hidden: int, intermediate: int, plain: bool
    ) -> None:
        self.weights = weights
        self.plain = plain
        self.x = torch.randn(batch, hidden, dtype=weights.embed.dtype)
        self.h = torch.randn(batch, intermediate, dtype=weights.embed.dtype)

    @property
    def kernel(self) -> str:
        return "torch" if self.plain else self.weights.kernel

    def _product(self, linear: Linear, x: torch.Tensor) -> None:
        if self.plain:
            F.linear(x, linear.weight, linear.bias)
        else:
            linear(x)

    @torch.inference_mode()
    def __call__(self) -> None:
        for layer in self.weights.layers:
            self._product(layer.qkv, self.x)
            self._product(layer.o, self.x)
            self._product(layer.gate_up, self.x)
            self._product(layer.down, self.h)
        self._product(self.weights.lm_head, self.x)


def _prompts(batch: int, spec: RealSpec, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(spec.seed + batch)
    # Ids from 3 up: clear of the usual special ids (pad/bos/eos).
    return torch.randint(3, vocab, (batch, spec.prompt_len), generator=gen).tolist()


def _batch_engine(model: PreTrainedModel, batch: int, spec: RealSpec) -> Engine:
    max_len = spec.prompt_len + spec.new_tokens + 1
    config = EngineConfig(
        max_num_seqs=batch,
        max_model_len=max_len,
        # Room for the whole batch at once, prefilled in one step as HF generate does.
        num_blocks=batch * (-(-max_len // spec.block_size) + 1),
        block_size=spec.block_size,
        prefill_chunk_size=batch * spec.prompt_len,
    )
    return Engine.from_hf_config(model.config, config, model.state_dict())


def run_engine_batch(
    model: PreTrainedModel, prompts: list[list[int]], spec: RealSpec
) -> dict[str, Any]:
    batch = len(prompts)
    engine = _batch_engine(model, batch, spec)
    s = engine.spec
    matmuls, plain = (
        StepMatmuls(engine.model.weights, batch, s.hidden_size, s.intermediate_size, p)
        for p in (False, True)
    )
    matmuls(), plain()  # warm up
    params = SamplingParams(temperature=0.0, target_len=spec.new_tokens)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    steps, decode, floor, floor_plain = Laps(), Laps(), Laps(), Laps()
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        prefilling = engine.stats().tokens_generated < batch
        done = (steps if prefilling else decode).time(engine.step)
        outputs.update({out.request_id: out.output_ids for out in done})
        if not prefilling:
            floor.time(matmuls)  # right after the step it is the floor of: same load
            if len(decode) % 4 == 1:
                floor_plain.time(plain)
    total = _total(steps, decode)
    tokens = batch * spec.new_tokens
    return {
        "engine": {
            **total,
            "tokens": tokens,
            "tokens_per_s": tokens / total["wall_s"],
            "tokens_per_cpu_s": tokens / total["cpu_s"],
            "decode_steps": len(decode),
            "prefill": _total(steps),
            "step": _median_ms(decode),
            "kernel": engine.kernel,
        },
        "floor": {"step": _median_ms(floor), "kernel": matmuls.kernel},
        "floor_torch": {"step": _median_ms(floor_plain), "kernel": plain.kernel},
        "outputs": [outputs[f"r{i}"] for i in range(batch)],
    }


def run_hf_batch(
    model: PreTrainedModel, prompts: list[list[int]], spec: RealSpec
) -> dict[str, Any]:
    ids = torch.tensor(prompts)
    gen = GenerationConfig(
        do_sample=False,
        max_new_tokens=spec.new_tokens,
        min_new_tokens=spec.new_tokens,
        eos_token_id=None,
        pad_token_id=0,
    )
    laps = Laps()
    with torch.inference_mode():
        out = laps.time(
            lambda: model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
        )
    tokens = len(prompts) * spec.new_tokens
    total = _total(laps)
    return {
        "hf_static": {
            **total,
            "tokens": tokens,
            "tokens_per_s": tokens / total["wall_s"],
            "tokens_per_cpu_s": tokens / total["cpu_s"],
            # generate's time spread over its steps (prefill included)
            "step": {
                "ms": 1e3 * total["wall_s"] / spec.new_tokens,
                "cpu_ms": 1e3 * total["cpu_s"] / spec.new_tokens,
            },
        },
        "outputs": out[:, ids.shape[1] :].tolist(),
    }


def run_real(
    model: PreTrainedModel, spec: RealSpec, console: Console, skip_hf: bool = False
) -> dict[str, Any]:
    vocab = model.config.vocab_size
    report: dict[str, Any] = {
        "spec": asdict(spec),
        "arch": model.config.model_type,
        "parameters": sum(p.numel() for p in model.parameters()),
        "batches": {},
    }
    for batch in spec.batches:
        prompts = _prompts(batch, spec, vocab)
        console.log(f"real model: engine, batch {batch}")
        ours = run_engine_batch(model, prompts, spec)
        entry = {key: ours[key] for key in ("engine", "floor", "floor_torch")}
        if not skip_hf:
            console.log(f"real model: hf generate, batch {batch}")
            theirs = run_hf_batch(model, prompts, spec)
            entry["hf_static"] = theirs["hf_static"]
            same = sum(a == b for a, b in zip(ours["outputs"], theirs["outputs"], strict=True))
            entry["greedy_identical_requests"] = same
        report["batches"][str(batch)] = entry
    report["bars"] = real_bars(report["batches"])
    return report


def real_bars(batches: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each bar on the wall clock and on this process's CPU clock."""
    values = {name: (None, None) for name in REAL_BARS}
    if "32" in batches:
        b = batches["32"]
        values["step_vs_matmuls_32"] = tuple(
            b["engine"]["step"][k] / b["floor"]["step"][k] for k in ("ms", "cpu_ms")
        )
        if "hf_static" in b:
            values["engine_vs_hf_static_32"] = tuple(
                b["engine"][k] / b["hf_static"][k] for k in ("tokens_per_s", "tokens_per_cpu_s")
            )
    if "64" in batches:
        e = batches["64"]["engine"]
        values["engine_tokens_per_s_64"] = (e["tokens_per_s"], e["tokens_per_cpu_s"])
    bars = {}
    for name, (what, target, at_most) in REAL_BARS.items():
        wall, cpu = values[name]
        bars[name] = {
            "what": what,
            "target": target,
            "value": wall,
            "pass": None if wall is None else (wall <= target if at_most else wall >= target),
            "value_cpu": cpu,
            "pass_cpu": None if cpu is None else (cpu <= target if at_most else cpu >= target),
        }
    return bars


def _contender_name(name: str, row: dict[str, Any]) -> str:
    if name.startswith("floor"):
        kernel = "F.linear" if row["kernel"] == "torch" else row["kernel"]
        return f"matmuls on {kernel}" + (" (floor)" if name == "floor" else "")
    return name


def print_real(report: dict[str, Any], console: Console) -> None:
    table = Table(
        title=f"real model ({report['parameters'] / 1e6:.1f}M params, {report['arch']}): "
        f"prompt {report['spec']['prompt_len']}, {report['spec']['new_tokens']} new tokens, greedy, "
        f"KV blocks of {report['spec']['block_size']}"
    )
    for col in ("batch", "contender", "tokens/s", "tokens/cpu-s", "ms/step", "cpu ms/step"):
        table.add_column(col, justify="right")
    for batch, entry in report["batches"].items():
        for name in ("engine", "hf_static", "floor", "floor_torch"):
            if name not in entry:
                continue
            row = entry[name]
            table.add_row(
                batch,
                _contender_name(name, row),
                fmt_or_dash(row.get("tokens_per_s"), ",.1f"),
                fmt_or_dash(row.get("tokens_per_cpu_s"), ",.1f"),
                fmt_or_dash(row["step"]["ms"], ",.1f"),
                fmt_or_dash(row["step"]["cpu_ms"], ",.1f"),
            )
        if "greedy_identical_requests" in entry:
            console.print(
                f"batch {batch}: engine and HF greedy outputs identical for "
                f"{entry['greedy_identical_requests']}/{batch} requests"
            )
    console.print(table)
    console.print(clock_bars_table("real-model bars", report["bars"]))


def _sizes(text: str) -> tuple[int, ...]:
    sizes = tuple(int(x) for x in text.split(",") if x.strip().isdigit())
    if not sizes or min(sizes) < 1 or len(sizes) != len(text.split(",")):
        raise argparse.ArgumentTypeError(f"comma-separated positive integers, got {text!r}")
    return sizes


def arguments() -> argparse.ArgumentParser:
    parser = engine_bench_parser("dorarl bench engine-model", __doc__, "engine.json")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, help="a local Hugging Face model folder")
    source.add_argument(
        "--shape", choices=sorted(SHAPES), help="random weights of a real model's shape"
    )
    parser.add_argument("--skip-hf", action="store_true", help="skip HF generate")
    parser.add_argument(
        "--backend",
        help="engine backends side by side on the same requests instead (dorarl,vllm; needs "
        "--model; writes engine.json under `backends`)",
    )
    parser.add_argument("--batches", type=_sizes, default=RealSpec.batches, help="e.g. 32,64")
    parser.add_argument("--prompt-len", type=int, default=RealSpec.prompt_len)
    parser.add_argument("--new-tokens", type=int, default=RealSpec.new_tokens)
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="with --backend")
    parser.add_argument(
        "--vllm-compile", action="store_true", help="with --backend: vLLM compiles (not eager)"
    )
    return parser


def _versions(ran: dict[str, Any]) -> dict[str, str]:
    found = {"torch": torch.__version__, "transformers": transformers.__version__}
    if "vllm" in ran.get("backends", {}).get("order", ()):
        found["vllm"] = sys.modules["vllm"].__version__
    return found


def _run_backends(args: argparse.Namespace) -> dict[str, Any]:
    if args.model is None:
        raise UserInputError("--backend: needs --model DIR (every backend starts from the folder)")
    backends = parse_backends(args.backend)
    read_hf_config(args.model)  # refuses a missing config or an unsupported architecture
    spec = BackendSpec(
        args.model, args.batches, args.prompt_len, args.new_tokens, dtype=args.dtype,
        vllm_compile=args.vllm_compile,
    )  # fmt: skip
    return {"backends": run_backends(backends, spec, Console(stderr=True))}


def _run_real(args: argparse.Namespace) -> dict[str, Any]:
    spec = RealSpec(args.batches, args.prompt_len, args.new_tokens)
    model = load_model(args.model, args.shape)
    real = run_real(model, spec, Console(stderr=True), skip_hf=args.skip_hf)
    real["source"] = str(args.model) if args.model else args.shape
    return {"real_model": real}


def main(argv: list[str]) -> int:
    args = arguments().parse_args(argv)
    if args.backend is not None:
        parse_backends(args.backend)  # a bad list or a missing vLLM: refused before any work
    torch.set_num_threads(args.threads)
    with load_window() as window:
        ran = _run_backends(args) if args.backend is not None else _run_real(args)
    report = {
        "threads": torch.get_num_threads(),
        "versions": _versions(ran),
        **ran,
        **window.fields(),
    }
    write_json(args.out, "engine.json", report)
    console = table_console()
    if "real_model" in ran:
        print_real(ran["real_model"], console)
    else:
        print_backends(ran["backends"], console)
    console.print(f"load average {report['load_average_start']} -> {report['load_average']}")
    return 0
