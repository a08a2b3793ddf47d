"""`dorarl bench migration --device D --shape S`: a migration between two engine actors
through the runtime's own path, by transport, against re-prefill on the destination.

Two `EngineWorker` actors on one device (on cuda: half a GPU each, so the KV crosses by CUDA
IPC; on the CPU: gloo over loopback) hold a model of the shape with random weights (saved
once as a folder, which the actors load). At each context a request prefills on the source
and samples one token; then, taking turns in the same run:
- `object_store`: `export` (snapshots with their KV, pickled into Ray's object store) and
  `import_` on the destination, as `EngineFleet.migrate` does with that transport;
- `collective`: `export_kv` and `import_parcel` (metadata through Ray, KV over the group);
- `reprefill`: the destination continues from the tokens alone (`resume`).
Each is timed from the source's export to the destination's next token (wall clock; the
actors' work, so give the load average). Written to `actor_migration.json`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from dataclasses import asdict, dataclass, replace
from typing import Any

import ray
import torch
from rich.console import Console
from rich.table import Table

from dorarl.bench.cli_args import engine_bench_parser, write_json
from dorarl.bench.clock import Stopwatch, load_window
from dorarl.bench.engine_device import (
    ENGINE_SET_KEYS,
    add_device_args,
    default_shape,
    parse_engine_set,
    resolve_device,
)
from dorarl.bench.shapes import SHAPES, random_llama
from dorarl.engine import EngineConfig, SamplingParams
from dorarl.errors import UserInputError
from dorarl.report.console import table_console
from dorarl.runtime.transfer.weight_endpoints import WEIGHTS_GROUP
from dorarl.runtime.transfer.weight_group import GroupAddress, open_store, route
from dorarl.runtime.workers.engine_worker import EngineWorker, NewRequest
from dorarl.sim.cost import kv_bytes_per_token

CONTENDERS = ("object_store", "collective", "reprefill")
ENGINE_KEYS = (*ENGINE_SET_KEYS, "linear_kernel")
"""The engine keys `--engine-set` takes: its actors' memory may call for linear_kernel=torch
on a CPU."""


@dataclass(frozen=True)
class ActorMigrationSpec:
    contexts: tuple[int, ...] = (1024, 4096, 16384)
    repeats: int = 3
    block_size: int = 16
    prefill_chunk: int = 512
    threads: int = 1
    seed: int = 0
    engine_set: tuple[tuple[str, str], ...] = ()  # other engine keys, e.g. linear_kernel


def _save_model(shape: str, dtype: torch.dtype, seed: int, folder: str) -> None:
    """The shape's random weights as a Hugging Face folder (the actors load folders)."""
    model = random_llama(shape, seed, "cpu", dtype)
    model.save_pretrained(folder)
    del model


def _actors(folder: str, config: EngineConfig, threads: int) -> list[Any]:
    """Two engine actors, made one after the other (one load's transient memory at a time)."""
    gpus = 0.5 if config.device.startswith("cuda") else 0
    worker = ray.remote(num_cpus=0, num_gpus=gpus, concurrency_groups={WEIGHTS_GROUP: 1})
    actors = []
    for i in range(2):
        actors.append(worker(EngineWorker).remote(i, folder, config, threads))
        ray.get(actors[-1].stats.remote())
    return actors


def _join(actors: list[Any], backend: str) -> tuple[Any, tuple[int, str]]:
    """A two-engine group (the store hosted here, as the trainer does in a run); returns
    the store (kept alive) and the route from actor 0 to actor 1."""
    store, port = open_store("127.0.0.1", 120.0)
    address = GroupAddress("127.0.0.1", port, 2, backend, 120.0)
    members = ray.get([a.join_weights.remote(address, rank) for rank, a in enumerate(actors)])
    return store, route(members[0], members[1])


def _prefilled(src: Any, rid: str, ctx: int, vocab: int, spec: ActorMigrationSpec) -> None:
    """`rid` on `src` with `ctx - 1` prompt tokens, prefilled and one token sampled (it
    finishes at its second: the destination's next token)."""
    prompt = [(7 * i + 3) % vocab for i in range(ctx - 1)]
    params = SamplingParams(temperature=1.0, target_len=2, seed=spec.seed)
    ray.get(src.add.remote([NewRequest(rid, prompt, params)]))
    steps = -(-(ctx - 1) // spec.prefill_chunk)
    assert not ray.get(src.run.remote(steps, False)).finished


def _next_token(dst: Any, rid: str) -> Any:
    finished = ray.get(dst.run.remote(1 << 20)).finished
    assert [out.request_id for out in finished] == [rid], finished
    return finished[0]


def _one(kind: str, src: Any, dst: Any, route, rid: str) -> tuple[float, float, Any]:
    """(ms to the destination's next token, ms until the import returned, tokens-only snapshot)."""
    watch = Stopwatch()
    if kind == "object_store":
        _, snapshots = src.export.options(num_returns=2).remote([rid])
        ray.get(dst.import_.remote(snapshots))
    else:
        _, snapshots = src.export_kv.options(num_returns=2).remote([rid])
        ray.get(dst.import_parcel.remote(snapshots, src, *route))
    imported = watch.wall_s()
    out = _next_token(dst, rid)
    done = watch.wall_s()
    got = ray.get(snapshots)
    snap = (got[0] if kind == "object_store" else got.snapshots[0]).tokens_only()
    assert len(snap.output_ids) == 1, "moved before its first token"  # KV of ctx tokens moved
    assert out.migrations == 1 and len(out.output_ids) == 2
    return 1e3 * done, 1e3 * imported, snap


def _reprefill(dst: Any, snap: Any) -> float:
    watch = Stopwatch()
    ray.get(dst.resume.remote([snap.request_id], [snap]))
    _next_token(dst, snap.request_id)
    return 1e3 * watch.wall_s()


def _at_context(actors, route, ctx: int, vocab: int, spec: ActorMigrationSpec, rep: int):
    """One turn of every contender at `ctx` tokens."""
    src, dst = actors
    row: dict[str, float] = {}
    for kind in ("object_store", "collective"):
        rid = f"{kind}-{ctx}-{rep}"
        _prefilled(src, rid, ctx, vocab, spec)
        row[kind], row[f"{kind}_import"], snap = _one(kind, src, dst, route, rid)
    row["reprefill"] = _reprefill(dst, snap)
    return row


def run_actor_migration(
    shape: str, device: str, dtype: torch.dtype, spec: ActorMigrationSpec, console: Console
) -> dict[str, Any]:
    """Every context, `repeats` turns each (medians), after one warm-up turn."""
    owns_ray = not ray.is_initialized()
    if owns_ray:
        from dorarl.runtime.local_ray import start_local_ray

        start_local_ray(num_cpus=2, num_gpus=1 if device.startswith("cuda") else 0)
    try:
        return _measure(shape, device, dtype, spec, console)
    finally:
        if owns_ray:
            ray.shutdown()


def _measure(shape, device, dtype, spec: ActorMigrationSpec, console: Console) -> dict:
    max_len = max(spec.contexts) + 16
    dtype_name = str(dtype).removeprefix("torch.")
    config = EngineConfig(
        device=device, max_num_seqs=2, max_model_len=max_len, block_size=spec.block_size,
        prefill_chunk_size=spec.prefill_chunk, num_blocks=2 * -(-max_len // spec.block_size),
        dtype=dtype_name, **{"cuda_graphs": "off", **dict(spec.engine_set)},
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="dorarl-actor-migration-") as folder:
        _save_model(shape, dtype, spec.seed, folder)
        actors = _actors(folder, config, spec.threads)  # both loaded the folder: it can go
    vocab = SHAPES[shape]["vocab_size"]
    store, route = _join(actors, "nccl" if device.startswith("cuda") else "gloo")
    console.log(f"actor migration ({shape}, {device}): KV route {route[1]}")
    _at_context(actors, route, min(spec.contexts), vocab, spec, rep=-1)  # warm-up
    rows: dict[str, dict[str, float]] = {}
    for ctx in spec.contexts:
        console.log(f"actor migration at {ctx} tokens")
        turns = [_at_context(actors, route, ctx, vocab, spec, rep) for rep in range(spec.repeats)]
        rows[str(ctx)] = {k: statistics.median(t[k] for t in turns) for k in turns[0]}
    del store
    return {"shape": shape, "device": device, "dtype": dtype_name, "route": route[1],
            "spec": asdict(spec), "ms": rows, "kv_mb": _kv_mb(shape, dtype, spec.contexts)}  # fmt: skip


def _kv_mb(shape: str, dtype: torch.dtype, contexts) -> dict[str, float]:
    s = SHAPES[shape]
    head_dim = s.get("head_dim") or s["hidden_size"] // s["num_attention_heads"]
    size = torch.empty((), dtype=dtype).element_size()
    per_token = kv_bytes_per_token(s["num_hidden_layers"], s["num_key_value_heads"], head_dim, size)
    return {str(c): c * per_token / 2**20 for c in contexts}


def actor_migration_report(
    shape: str,
    device: str,
    quick: bool,
    threads: int,
    console: Console,
    contexts: tuple[int, ...] | None = None,
    engine_set: tuple[tuple[str, str], ...] = (),
) -> dict[str, Any]:
    """What actor_migration.json holds (`quick`: one turn per context, not three;
    `engine_set`: engine keys for both actors, as `--engine-set` gives them)."""
    settings = dict(engine_set)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    dtype = getattr(torch, settings.pop("dtype", str(dtype).removeprefix("torch.")))
    spec = ActorMigrationSpec(
        repeats=1 if quick else 3, threads=threads, engine_set=tuple(settings.items())
    )
    if contexts:
        spec = replace(spec, contexts=contexts)
    with load_window() as window:
        report = run_actor_migration(shape, device, dtype, spec, console)
    return report | window.fields()


def print_actor_migration(report: dict[str, Any], console: Console) -> None:
    title = (f"migration between two engine actors ({report['shape']}, {report['device']}, "
             f"{report['dtype']}, KV route {report['route']}), ms to the next token")  # fmt: skip
    table = Table(title=title)
    cols = ("tokens", "KV MB", "object_store", "collective", "re-prefill", "re-prefill / collective",
            "object_store / collective")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="right")
    for ctx, row in report["ms"].items():
        table.add_row(
            ctx, f"{report['kv_mb'][ctx]:.1f}", f"{row['object_store']:.1f}",
            f"{row['collective']:.1f}", f"{row['reprefill']:.1f}",
            f"{row['reprefill'] / row['collective']:.2f}x",
            f"{row['object_store'] / row['collective']:.2f}x",
        )  # fmt: skip
    console.print(table)


def _contexts(text: str) -> tuple[int, ...]:
    try:
        contexts = tuple(int(x) for x in text.split(","))
    except ValueError:
        contexts = ()
    if not contexts or min(contexts) < 2:
        raise UserInputError(f"--contexts: comma-separated token counts >= 2, got {text!r}")
    return contexts


def arguments() -> argparse.ArgumentParser:
    parser = engine_bench_parser("dorarl bench migration", __doc__, "actor_migration.json")
    add_device_args(parser, ENGINE_KEYS, "one turn per context, not three")
    parser.add_argument(
        "--contexts", help="comma-separated token counts instead of 1024,4096,16384"
    )
    return parser


def main(argv: list[str]) -> int:
    args = arguments().parse_args(argv)
    torch.set_num_threads(args.threads)
    resolve_device(args.device)  # one line for a device that is not here
    engine_set = parse_engine_set(args.engine_set, ENGINE_KEYS)
    contexts = _contexts(args.contexts) if args.contexts else None
    shape = default_shape(args.device, args.shape)
    report = actor_migration_report(
        shape, args.device, args.quick, args.threads, Console(stderr=True), contexts, engine_set
    )
    write_json(args.out, "actor_migration.json", report)
    console = table_console()
    print_actor_migration(report, console)
    console.print(f"load average {report['load_average_start']} -> {report['load_average']}")
    return 0
