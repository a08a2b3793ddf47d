"""`dorarl bench engine-device --device cuda|cpu --shape S`: the engine at a model's shape on a
device.

Random weights of the shape (no download), the engine with its defaults on that device
(on cuda: Triton paged attention, device sampling, CUDA graphs, bfloat16), against Hugging
Face in the same run:
- the long-tail workload (128 requests, 128-token prompts, forced lognormal
  lengths, p99 / median ~8, batch 64): the engine, HF `generate` on static batches of 64
  (each runs to its longest member) and HF's continuous batching; useful tokens per second;
- a decode step at batch 8 / 32 / 64 / 128 and context ~256: the engine's, HF's plain
  forward over a StaticCache (eager, and compiled with CUDA graphs on cuda where it
  compiles), and the floor: bytes a step must read (weights, then each row's K/V) over the
  device's copy bandwidth measured here;
- migration (export + pickle + import + next token, as over Ray) against re-prefill, at
  1k / 4k / 16k tokens, between two engines on one device.
`engine.json` keeps the CPU bench's top-level keys (tokens_per_s, step_ms_full_batch,
migration_ms, reprefill_ms, bars, ...) with these figures and adds everything under
`device_bench`. Bars (targets for an H200): step at batch 64 <= 4 ms and <= 1.2x
HF's fastest plain step; long tail >= 10x HF generate; migration at 16k >= 20x cheaper.
"""

from __future__ import annotations

import argparse
import pickle
import random
import statistics
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any

import torch
import transformers
from rich.console import Console
from rich.table import Table
from transformers import GenerationConfig, PreTrainedModel, StaticCache

from dorarl.bench.cli_args import engine_bench_parser, write_json
from dorarl.bench.clock import Stopwatch, load_window, timed
from dorarl.bench.hf_peers import Workload, long_tail_workload, run_hf_continuous
from dorarl.bench.report import fmt_or_dash
from dorarl.bench.shapes import SHAPES, random_llama
from dorarl.data.lengths import length_stats
from dorarl.engine import Engine, EngineConfig, SamplingParams
from dorarl.errors import UserInputError
from dorarl.report.console import table_console


@dataclass(frozen=True)
class DeviceSpec:
    num_requests: int = 128
    max_batch: int = 64
    prompt_len: int = 128
    median_len: int = 64
    sigma: float = 0.89  # p99 / median = exp(2.326 sigma) ~ 7.9
    step_batches: tuple[int, ...] = (8, 32, 64, 128)
    step_context: int = 256
    step_repeats: int = 30
    migration_contexts: tuple[int, ...] = (1024, 4096, 16384)
    block_size: int = 16
    prefill_chunk: int = 512
    hf_continuous: bool = True
    compile_hf: bool = True  # compile HF's StaticCache step at the bar's batch (cuda only)
    engine_set: tuple[tuple[str, str], ...] = ()  # engine.<key>=value for every engine here
    seed: int = 0


FULL = DeviceSpec()
QUICK = replace(
    FULL, num_requests=64, median_len=32, step_batches=(8, 64), step_repeats=10,
    migration_contexts=(1024, 4096, 16384), hf_continuous=False, compile_hf=False,
)  # fmt: skip
BAR_BATCH = 64


@dataclass
class Device:
    device: torch.device
    dtype: torch.dtype

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def timed(self, fn: Callable[[], Any]) -> float:
        """Seconds of `fn`, the device's queue drained before and after."""
        self.sync()
        watch = Stopwatch()
        fn()
        self.sync()
        return watch.wall_s()


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# --- workload -------------------------------------------------------------------------------
def make_workload(spec: DeviceSpec, vocab: int) -> tuple[list[list[int]], list[int]]:
    work = long_tail_workload(spec.num_requests, spec.median_len, spec.sigma, spec.prompt_len,
                              vocab, spec.seed)  # fmt: skip
    return work.prompts, work.lengths


ENGINE_SET_KEYS = ("attention", "sampler", "cuda_graphs", "dtype")


def _engine(
    model: PreTrainedModel, dev: Device, spec: DeviceSpec, max_seqs: int, max_len: int, **kw: Any
) -> Engine:
    settings = {**kw, **dict(spec.engine_set)}
    config = EngineConfig(
        device=str(dev.device), max_num_seqs=max_seqs, max_model_len=max_len, **settings
    )
    return Engine.from_hf_config(model.config, config, model.state_dict())


def _forced(n: int, seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, target_len=n, seed=seed)


def long_tail(model, dev: Device, spec: DeviceSpec, console: Console) -> dict[str, Any]:
    prompts, lengths = make_workload(spec, model.config.vocab_size)
    total = sum(lengths)
    max_len = spec.prompt_len + max(lengths) + 1
    out: dict[str, Any] = {"total_tokens": total, "lengths": length_stats(lengths)}
    console.log("long tail: engine")
    engine = _engine(
        model, dev, spec, spec.max_batch, max_len,
        block_size=spec.block_size, prefill_chunk_size=spec.prefill_chunk,
    )  # fmt: skip

    wall = dev.timed(partial(_drain, engine, prompts, lengths))
    out["engine"] = _contender(wall, total, steps=engine.stats().steps)
    # what it ran: the fast paths as checked on the device (fallbacks named), its KV pool
    out["engine_setup"] = engine.setup().as_dict()
    del engine  # its pool and graphs go before HF's models run
    console.log("long tail: HF generate, static batches")
    wall, decoded = hf_static(model, dev, spec, prompts, lengths)
    out["hf_static"] = _contender(wall, total, decoded_tokens=decoded)
    if spec.hf_continuous:
        console.log("long tail: HF continuous batching")
        out["hf_continuous"] = _try(lambda: _hf_continuous(model, dev, spec, prompts, lengths))
    return out


def _drain(engine: Engine, prompts: list[list[int]], lengths: list[int]) -> None:
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        engine.add_request(f"r{i}", p, _forced(n, i))
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(o.output_ids) for o in engine.step())
    assert tokens == sum(lengths), "forced lengths were not honoured"


def _contender(wall: float, tokens: int, **extra: Any) -> dict[str, Any]:
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, **extra}


def _try(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A peer that cannot run here is reported with why, not fatal."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - any failure of a peer is a figure to report
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}


def hf_static(model, dev: Device, spec: DeviceSpec, prompts, lengths) -> tuple[float, int]:
    """HF generate on static batches in arrival order; a batch decodes until its longest."""
    batches = range(0, len(prompts), spec.max_batch)
    decoded = sum(max(lengths[lo : lo + spec.max_batch]) * len(prompts[lo : lo + spec.max_batch])
                  for lo in batches)  # fmt: skip

    def go() -> None:
        for lo in batches:
            ids = torch.tensor(prompts[lo : lo + spec.max_batch], device=dev.device)
            longest = max(lengths[lo : lo + spec.max_batch])
            gen = GenerationConfig(
                do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=longest,
                min_new_tokens=longest, eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
            with torch.inference_mode():
                model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)

    return dev.timed(go), decoded


def _hf_continuous(model, dev: Device, spec: DeviceSpec, prompts, lengths) -> dict[str, Any]:
    result = run_hf_continuous(model, spec, Workload(prompts, lengths))
    return _contender(result["wall_s"], result["tokens"])


# --- one decode step --------------------------------------------------------------------
def bandwidth(dev: Device) -> float:
    """Bytes per second of a large device copy (read + write), median of five."""
    n = (1 << 30) if dev.device.type == "cuda" else (1 << 27)
    src = torch.empty(n, dtype=torch.uint8, device=dev.device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * n / statistics.median(dev.timed(lambda: dst.copy_(src)) for _ in range(5))


def step_bytes(model: PreTrainedModel, batch: int, context: int, dtype: torch.dtype) -> int:
    """What a decode step must read: every weight once (the embedding only B rows unless
    the head is tied to it) and every row's K/V at `context`."""
    c = model.config
    weights = sum(p.numel() for p in model.parameters())
    if not c.tie_word_embeddings:
        weights -= model.get_input_embeddings().weight.numel()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = batch * context * c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim
    return (weights + kv) * _elem(dtype)


def decode_steps(model, dev: Device, spec: DeviceSpec, console: Console) -> dict[str, Any]:
    ctx, reps = spec.step_context, spec.step_repeats
    biggest = max(spec.step_batches)
    max_len = ctx + reps + 16
    engine = _engine(  # the whole batch prefills in one step: then every row is at ctx
        model, dev, spec, biggest, max_len, block_size=spec.block_size,
        prefill_chunk_size=biggest * ctx,
        num_blocks=biggest * -(-max_len // spec.block_size),
    )  # fmt: skip
    bw = bandwidth(dev)
    rows = {}
    for batch in spec.step_batches:
        console.log(f"decode step at batch {batch}")
        row = {"engine": _engine_step_ms(engine, batch, spec)}
        row.update(_hf_step_ms(model, dev, batch, spec))
        row["floor"] = 1e3 * step_bytes(model, batch, ctx, dev.dtype) / bw
        rows[str(batch)] = row
    return {"context": ctx, "bandwidth_gb_s": bw / 1e9, "ms": rows}


def _engine_step_ms(engine: Engine, batch: int, spec: DeviceSpec) -> float:
    ctx, vocab = spec.step_context, engine.spec.vocab_size
    ids = [f"s{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        # each batch's own prompts: one the prefix cache kept from an earlier batch would
        # skip its prefill and hold a copy source as the batch is admitted
        draw = random.Random(batch * 1_000_003 + i)
        prompt = [draw.randrange(vocab) for _ in range(ctx)]
        engine.add_request(rid, prompt, _forced(spec.step_repeats + 8, i))
    while min(engine.progress(r) for r in ids) == 0:
        engine.step()  # prefill every request; then each step decodes the whole batch
    engine.step()  # warm up
    # each step ends in the host sync of its sampled tokens
    times = [timed(engine.step)[1].wall_s for _ in range(spec.step_repeats)]
    for rid in set(ids) & set(engine.request_ids()):
        engine.abort(rid)
    return 1e3 * statistics.median(times)


def _hf_step_ms(model, dev: Device, batch: int, spec: DeviceSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"hf_static_cache": _hf_cache_step(model, dev, batch, spec, None)}
    if spec.compile_hf and dev.device.type == "cuda" and batch == BAR_BATCH:
        out["hf_compiled"] = _try_ms(lambda: _hf_cache_step(model, dev, batch, spec, "compile"))
    return out


def _try_ms(fn: Callable[[], float]) -> float | str:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - reported beside the figures
        return f"error: {type(exc).__name__}: {exc}"[:300]


def _hf_cache_step(model, dev: Device, batch: int, spec: DeviceSpec, mode: str | None) -> float:
    """Median ms of HF's decode forward over a StaticCache at the step context."""
    ctx, reps = spec.step_context, spec.step_repeats
    cache = StaticCache(config=model.config, max_cache_len=ctx + reps + 8)
    forward = model.forward
    if mode == "compile":
        forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    prompt = torch.randint(0, model.config.vocab_size, (batch, ctx), device=dev.device)
    times = []
    # transformers >= 5.2x renames past_key_values; 5.17 (the GPU machine's) knows only it
    warnings.filterwarnings(
        "ignore", message=".*past_key_values.*deprecated", category=FutureWarning
    )
    with torch.inference_mode():
        model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1,
              cache_position=torch.arange(ctx, device=dev.device))  # fmt: skip
        token = prompt[:, -1:].clone()
        for k in range(reps + 3):  # the first three warm up (and compile)
            position = torch.tensor([ctx + k], device=dev.device)
            took = dev.timed(
                lambda position=position: forward(
                    input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1,
                    cache_position=position,
                )
            )  # fmt: skip
            if k >= 3:
                times.append(took)
    return 1e3 * statistics.median(times)


# --- migration ------------------------------------------------------------------------------
def migration(model, dev: Device, spec: DeviceSpec, console: Console) -> dict[str, Any]:
    contexts = spec.migration_contexts
    max_len = max(contexts) + 16
    kw = dict(
        block_size=spec.block_size, prefill_chunk_size=spec.prefill_chunk, cuda_graphs="off",
        num_blocks=2 * -(-max_len // spec.block_size),
    )  # fmt: skip
    a, b = (_engine(model, dev, spec, 2, max_len, **kw) for _ in range(2))
    _one_migration(a, b, min(contexts), 0)  # warm up both paths
    out: dict[str, dict[str, float]] = {}
    for ctx in contexts:
        console.log(f"migration vs re-prefill at {ctx} tokens")
        for key, value in _one_migration(a, b, ctx, 1).items():
            out.setdefault(key, {})[str(ctx)] = value
    return out


def _one_migration(a: Engine, b: Engine, ctx: int, rep: int) -> dict[str, float]:
    vocab = a.spec.vocab_size
    request = f"m{ctx}-{rep}"
    a.add_request(request, [(7 * i + rep) % vocab for i in range(ctx - 1)], _forced(8, rep))
    while not a.progress(request):
        a.step()
    watch = Stopwatch()
    snap = a.export_request(request)
    exported = watch.wall_s()
    snap = pickle.loads(pickle.dumps(snap))
    pickled = watch.wall_s()
    b.import_request(snap)
    while b.progress(request) < 2:
        b.step()
    migrated = watch.wall_s()
    tokens_only = b.abort(request)
    watch = Stopwatch()
    a.resume_request(tokens_only)
    while a.progress(request) < 3:
        a.step()
    reprefill = watch.wall_s()
    a.abort(request)
    return {
        "migration_ms": 1e3 * migrated,
        "reprefill_ms": 1e3 * reprefill,
        "export_ms": 1e3 * exported,
        "transfer_ms": 1e3 * pickled,
        "kv_mb": snap.kv_bytes / 2**20,
    }


# --- report -------------------------------------------------------------------------------
def bars(bench: dict[str, Any]) -> dict[str, dict[str, Any]]:
    step = bench["steps"]["ms"].get(str(BAR_BATCH), {})
    hf = [v for k, v in step.items() if k.startswith("hf_") and isinstance(v, float)]
    tail, mig = bench["long_tail"], bench["migration"]
    top = str(max(int(c) for c in mig["migration_ms"]))
    values = {
        "step_ms_64": (step.get("engine"), 4.0, True, "engine decode step ms at batch 64"),
        "step_vs_hf_fastest_64": (
            _ratio(step.get("engine"), min(hf, default=None)), 1.2, True,
            "engine step / HF's fastest plain step at batch 64",
        ),
        "long_tail_vs_hf_static": (
            _ratio(tail["engine"]["tokens_per_s"], tail["hf_static"]["tokens_per_s"]), 10.0,
            False, "long-tail tokens/s engine / HF generate",
        ),
        f"reprefill_vs_migration_{top}": (
            _ratio(mig["reprefill_ms"][top], mig["migration_ms"][top]), 20.0, False,
            f"re-prefill ms / migration ms at {top} tokens",
        ),
    }  # fmt: skip
    return {
        name: {"what": what, "target": target, "value": value,
               "pass": None if value is None else (value <= target if at_most else value >= target)}
        for name, (value, target, at_most, what) in values.items()
    }  # fmt: skip


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


def todays_keys(bench: dict[str, Any]) -> dict[str, Any]:
    """The CPU bench's top-level keys, filled from this run (its readers keep working)."""
    tail, steps = bench["long_tail"], bench["steps"]
    names = ("engine", "hf_static", "hf_continuous")
    row = steps["ms"].get(str(BAR_BATCH)) or steps["ms"][max(steps["ms"], key=int)]
    mig = bench["migration"]
    return {
        "tokens_per_s": {n: tail.get(n, {}).get("tokens_per_s") for n in names},
        "wall_s": {n: tail[n]["wall_s"] for n in names if "wall_s" in tail.get(n, {})},
        "step_ms_full_batch": {
            "batch": BAR_BATCH if str(BAR_BATCH) in steps["ms"] else max(map(int, steps["ms"])),
            "context": steps["context"],
            **{k: v for k, v in row.items() if isinstance(v, float)},
        },
        **{k: mig[k] for k in ("migration_ms", "reprefill_ms", "transfer_ms", "kv_mb")},
        "bars": bench["bars"],
    }


def print_device_report(bench: dict[str, Any], console: Console) -> None:
    tail = bench["long_tail"]
    batch = bench["spec"]["max_batch"]
    title = f"long tail ({bench['shape']}, {bench['device']}, {bench['dtype']}, batch {batch})"
    table = Table(title=title)
    for col in ("contender", "tokens/s", "wall s", "engine is"):
        table.add_column(col, justify="left" if col == "contender" else "right")
    for name in ("engine", "hf_static", "hf_continuous"):
        r = tail.get(name)
        if r is None:
            continue
        if "error" in r:
            table.add_row(name, "-", "-", r["error"][:60])
            continue
        ratio = _ratio(tail["engine"]["tokens_per_s"], r["tokens_per_s"])
        table.add_row(name, f"{r['tokens_per_s']:,.0f}", f"{r['wall_s']:.2f}",
                      fmt_or_dash(ratio, ".2f", "x"))  # fmt: skip
    console.print(table)
    _print_steps(bench["steps"], console)
    _print_migration(bench["migration"], console)
    _print_bars(bench["bars"], console)


def _print_steps(steps: dict[str, Any], console: Console) -> None:
    title = f"decode step ms, context {steps['context']} (copy {steps['bandwidth_gb_s']:.0f} GB/s)"
    table = Table(title=title)
    cols = ("batch", "engine", "hf_static_cache", "hf_compiled", "floor", "engine / floor")
    for col in cols:
        table.add_column(col, justify="right")
    for batch, row in steps["ms"].items():
        cells = [row.get(c) for c in cols[1:5]]
        table.add_row(batch, *(f"{c:.3f}" if isinstance(c, float) else (c or "-")[:40]
                               for c in cells),
                      fmt_or_dash(_ratio(row["engine"], row["floor"]), ".1f", "x"))  # fmt: skip
    console.print(table)


def _print_migration(mig: dict[str, Any], console: Console) -> None:
    table = Table(title="migration (export + pickle + import + next token) vs re-prefill")
    for col in ("tokens", "KV MB", "export ms", "migration ms", "reprefill ms", "ratio"):
        table.add_column(col, justify="right")
    for ctx, ms in mig["migration_ms"].items():
        re = mig["reprefill_ms"][ctx]
        table.add_row(ctx, f"{mig['kv_mb'][ctx]:.1f}", f"{mig['export_ms'][ctx]:.1f}",
                      f"{ms:.1f}", f"{re:.1f}", f"{re / ms:.2f}x")  # fmt: skip
    console.print(table)


def _print_bars(bars_: dict[str, dict[str, Any]], console: Console) -> None:
    table = Table(title="GPU bars (targets for an H200)")
    for col in ("bar", "what", "target", "value", "pass"):
        table.add_column(col)
    for name, b in bars_.items():
        table.add_row(name, b["what"], f"{b['target']:g}", fmt_or_dash(b["value"], ".2f"),
                      "-" if b["pass"] is None else ("yes" if b["pass"] else "NO"))  # fmt: skip
    console.print(table)


# --- entry point ----------------------------------------------------------------------------
def resolve_device(name: str) -> Device:
    try:
        device = torch.device(name)
    except RuntimeError:  # not a device torch knows ("gpu", "cuda:x")
        device = None
    if device is None or device.type not in ("cuda", "cpu"):
        raise UserInputError(f"--device: cpu or cuda, got {name!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserInputError("--device cuda: torch sees no GPU here")
    return Device(device, torch.bfloat16 if device.type == "cuda" else torch.float32)


def add_device_args(
    parser: argparse.ArgumentParser, engine_keys: tuple[str, ...], quick: str
) -> None:
    """`--device`, `--shape`, `--quick` and `--engine-set`: what the device benches share."""
    parser.add_argument("--device", required=True, help="cuda | cpu")
    parser.add_argument(
        "--shape", choices=sorted(SHAPES),
        help="random weights of this shape (default: qwen2-0.5b on cuda, tiny on cpu)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument(
        "--engine-set", action="append", default=[], metavar="KEY=VALUE",
        help=f"an engine key ({', '.join(engine_keys)}) for every engine of the bench, "
        "e.g. cuda_graphs=off",
    )  # fmt: skip


def default_shape(device: str, shape: str | None) -> str:
    return shape or ("qwen2-0.5b" if device.startswith("cuda") else "tiny")


def parse_engine_set(
    items: list[str], keys: tuple[str, ...] = ENGINE_SET_KEYS
) -> tuple[tuple[str, str], ...]:
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        key = key.removeprefix("engine.")
        if not sep or key not in keys:
            raise UserInputError(f"--engine-set: {item!r} is not KEY=VALUE with KEY one of {keys}")
        pairs.append((key, value))
    return tuple(pairs)


def run_device_bench(
    shape: str,
    dev: Device,
    spec: DeviceSpec,
    console: Console,
    on_section: Callable[[dict], None] = lambda bench: None,
) -> dict:
    """Every section at one shape; returns the `device_bench` dict (`on_section` sees it
    after each section, so a run cut short still leaves what it measured)."""
    model = random_llama(shape, spec.seed, str(dev.device), dev.dtype).eval()
    bench: dict[str, Any] = {
        "shape": shape, "device": str(dev.device), "dtype": str(dev.dtype).removeprefix("torch."),
        "spec": asdict(spec), "parameters": sum(p.numel() for p in model.parameters()),
    }  # fmt: skip
    if dev.device.type == "cuda":
        bench["gpu"] = torch.cuda.get_device_name()
    # Steps last: compiling HF's step is the part most likely to run long.
    sections = (("long_tail", long_tail), ("migration", migration), ("steps", decode_steps))
    for name, section in sections:
        bench[name] = section(model, dev, spec, console)
        on_section(bench)
    bench["bars"] = bars(bench)
    return bench


def device_report(
    shape: str,
    device: str,
    quick: bool,
    console: Console,
    engine_set: tuple[tuple[str, str], ...] = (),
    on_section: Callable[[dict], None] = lambda bench: None,
) -> dict[str, Any]:
    """engine.json: header, today's keys from this run, `device_bench`."""
    dev = resolve_device(device)
    spec = replace(QUICK if quick else FULL, engine_set=engine_set)
    with load_window() as window:
        bench = run_device_bench(shape, dev, spec, console, on_section)
    return {
        "threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        **todays_keys(bench),
        "model": {"shape": shape, "parameters": bench["parameters"]},
        "workload": {"lengths": bench["long_tail"]["lengths"]},
        "device_bench": bench,
        **window.fields(),
    }


def arguments() -> argparse.ArgumentParser:
    parser = engine_bench_parser("dorarl bench engine-device", __doc__, "engine.json")
    add_device_args(
        parser, ENGINE_SET_KEYS, "64 requests, batches 8 and 64, no HF continuous batching "
        "and no compiled HF step",
    )  # fmt: skip
    return parser


def main(argv: list[str]) -> int:
    args = arguments().parse_args(argv)
    torch.set_num_threads(args.threads)
    engine_set = parse_engine_set(args.engine_set)
    partial_json = args.out / "engine.partial.json"  # what a run cut short had measured

    def save(bench: dict) -> None:
        write_json(args.out, partial_json.name, bench)

    shape = default_shape(args.device, args.shape)
    report = device_report(shape, args.device, args.quick, Console(stderr=True), engine_set, save)
    report["quick"] = args.quick
    write_json(args.out, "engine.json", report)
    partial_json.unlink(missing_ok=True)
    console = table_console()
    print_device_report(report["device_bench"], console)
    console.print(f"load average {report['load_average_start']} -> {report['load_average']}")
    return 0
