"""`dorarl bench weights`: how fast each weight transport carries a version, trainer to one
instance, trainer to all of them (the peer-first tree) and peer to peer, as full weights and
as a LoRA adapter alone.

Random weights of the SmolLM2-135M and Qwen2-0.5B shapes (`--shapes`; or `--params N`, a
Qwen2 of about N parameters) in the engines' dtype, and a rank-`--rank` adapter on every
dense projection of the same shape, as peft names its A and B (what a LoRA run whose engines
hold adapters sends: dorarl.runtime.transfer.weight_layout). Each is moved by the runtime's
own transports (`object_store`: Ray's object store; `collective`: a torch.distributed group
formed once, gloo on the CPU) between actors that publish and load as the trainer and the
engines do (dorarl.bench.weight_holders), every load verified against the sender's
fingerprints. The transports take turns, repeat by repeat; each row gives the bytes a
version is, the median wall seconds, GB/s and the CPU seconds all the actors spent on it
(the figure to trust on a loaded machine). The engine's own copy of what arrived (its
weights, or an adapter slot) is not in the figures.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import torch
from rich.table import Table
from transformers import Qwen2Config, Qwen2ForCausalLM

from dorarl.bench.cli_args import write_json
from dorarl.bench.clock import load_average, timed
from dorarl.bench.shapes import SHAPES, meta_model
from dorarl.bench.weight_holders import SinkHolder, SourceHolder
from dorarl.errors import UserInputError
from dorarl.report.console import table_console
from dorarl.runtime.local_ray import start_local_ray
from dorarl.runtime.transfer.transports import make_transport
from dorarl.runtime.transfer.weight_endpoints import WEIGHTS_GROUP
from dorarl.runtime.transfer.weight_layout import AdapterSpec
from dorarl.runtime.transfer.weights_config import TransportSpec

TRANSPORTS = ("object_store", "collective")
PAYLOADS = ("full", "adapter")
DEFAULT_SHAPES = ("smollm2-135m", "qwen2-0.5b")
MIN_PARAMS = 16_000_000
ROWS = ("publish", "trainer->one", "trainer->all", "peer->peer")
# a dense decoder projection's weight, what a LoRA adapter on every linear layer targets
_PROJECTION = re.compile(r"^(model\.layers\.\d+\.(?:self_attn|mlp)\.\w+_proj)\.weight$")


def qwen2_shapes(params: int | None) -> dict[str, tuple[int, ...]]:
    """HF names and shapes of a Qwen2 with about `params` parameters (None: Qwen2-0.5B):
    its layer count, or below one layer and the embeddings its vocabulary, scaled."""
    keys = dict(SHAPES["qwen2-0.5b"])
    if params is not None:
        if params < MIN_PARAMS:  # one Qwen2-0.5B layer and a small vocabulary
            raise UserInputError(f"--params: at least {MIN_PARAMS}, got {params}")
        layer = _count(dict(keys, num_hidden_layers=1, vocab_size=1))
        embed = keys["vocab_size"] * keys["hidden_size"]
        layers = round((params - embed) / layer)
        if layers < 1:
            keys["vocab_size"] = max(256, (params - layer) // keys["hidden_size"])
        keys["num_hidden_layers"] = max(1, layers)
    return _shapes(keys)


def model_shapes(shape: str) -> dict[str, tuple[int, ...]]:
    """HF names and shapes of `shape`'s weights (dorarl.bench.shapes) as a version sends
    them: a tied output layer once, as its embedding."""
    model = meta_model(shape)
    tied = model.config.tie_word_embeddings
    return {
        name: tuple(t.shape)
        for name, t in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }


def adapter_shapes(full: dict[str, tuple[int, ...]], rank: int) -> dict[str, tuple[int, ...]]:
    """peft's A `[rank, in]` and B `[out, rank]` by name (get_peft_model_state_dict's) on
    every dense decoder projection of a model whose weights are `full`."""
    out: dict[str, tuple[int, ...]] = {}
    for name, (rows, cols) in ((n, s) for n, s in full.items() if len(s) == 2):
        match = _PROJECTION.match(name)
        if match:
            out[f"base_model.model.{match[1]}.lora_A.weight"] = (rank, cols)
            out[f"base_model.model.{match[1]}.lora_B.weight"] = (rows, rank)
    return out


def _shapes(keys: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**keys))
    tied = keys["tie_word_embeddings"]
    return {
        name: tuple(t.shape)
        for name, t in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }


def _count(keys: dict[str, Any]) -> int:
    return sum(_numel(s) for s in _shapes(keys).values())


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


class Bench:
    """One payload's actors and both transports, started once; each measurement moves a
    new version."""

    def __init__(
        self,
        shapes: dict,
        dtype: str,
        instances: int,
        bucket_mb: int,
        adapter: AdapterSpec | None = None,
    ) -> None:
        options = {"num_cpus": 0, "concurrency_groups": {WEIGHTS_GROUP: 1}}
        source = ray.remote(**options)(SourceHolder)
        self.source = source.remote(shapes, dtype, 1, adapter)
        self.sinks = [ray.remote(**options)(SinkHolder).remote(i, 1) for i in range(instances)]
        self.actors = [self.source, *self.sinks]
        ray.get([a.cpu_s.remote() for a in self.actors])
        adapters = adapter is not None
        self.transports = {
            kind: make_transport(
                TransportSpec(kind, dtype, bucket_mb << 20, 300.0, "gloo", adapters), 0
            )
            for kind in TRANSPORTS
        }
        for transport in self.transports.values():
            transport.start(self.source, self.sinks)  # collective: the group, formed once

    def close(self) -> None:
        """Free the actors' copies before the next payload's are made."""
        for actor in self.actors:
            ray.kill(actor)

    def new_version(self, kind: str) -> tuple[int, dict[str, float]]:
        """Publish a new version through `kind`: (version, its publish timing)."""
        version = ray.get(self.source.advance.remote())
        transport = self.transports[kind]
        _, figures = self.timed(lambda: self._publish(transport, version))
        return version, figures

    def _publish(self, transport: Any, version: int) -> Any:
        handle = transport.initial(self.source)
        ray.get(handle.manifest)
        transport.publish(version, handle)
        return handle

    def timed(self, work: Callable[[], Any]) -> tuple[Any, dict[str, float]]:
        """`work()`, its wall seconds and the CPU seconds all the actors spent on it."""
        result, took = timed(work, cpu_clock=self.actors_cpu_s)
        return result, {"s": took.wall_s, "cpu_s": took.cpu_s}

    def actors_cpu_s(self) -> float:
        return sum(ray.get([a.cpu_s.remote() for a in self.actors]))

    def drop(self) -> None:
        ray.get([s.drop.remote() for s in self.sinks])

    def tree(self, kind: str, version: int) -> None:
        """Every instance loads `version`: each round, every holder serves one instance
        that lacks it, all at once, peers before the trainer (DORA's peer-first loads)."""
        transport = self.transports[kind]
        peers: list[Any] = []
        missing = list(self.sinks)
        while missing:
            pairs = list(zip([*peers, None], missing, strict=False))  # peers first
            ray.get([transport.load(sink, version, peer) for peer, sink in pairs])
            peers += [sink for _, sink in pairs]
            missing = missing[len(pairs) :]


def measure(bench: Bench, kind: str) -> dict[str, dict[str, float]]:
    """One repeat of every row for `kind`."""
    transport = bench.transports[kind]
    first, second = bench.sinks[0], bench.sinks[1 % len(bench.sinks)]
    rows: dict[str, dict[str, float]] = {}
    version, rows["publish"] = bench.new_version(kind)
    bench.drop()
    _, rows["trainer->one"] = bench.timed(lambda: ray.get(transport.load(first, version, None)))
    if second is not first:
        _, rows["peer->peer"] = bench.timed(lambda: ray.get(transport.load(second, version, first)))
    bench.drop()  # the same version again: every byte moves again, nothing is re-published
    _, rows["trainer->all"] = bench.timed(lambda: bench.tree(kind, version))
    bench.drop()
    return rows


def run(
    shapes: dict,
    dtype: str,
    instances: int,
    repeats: int,
    bucket_mb: int,
    adapter: AdapterSpec | None = None,
) -> dict:
    """Every row of both transports for one payload (`adapter`: `shapes` are its A and B)."""
    bench = Bench(shapes, dtype, instances, bucket_mb, adapter)
    try:
        nbytes = sum(_numel(s) for s in shapes.values()) * _element_size(dtype)
        runs: dict[str, list[dict]] = {kind: [] for kind in TRANSPORTS}
        for repeat in range(repeats):
            order = TRANSPORTS if repeat % 2 == 0 else TRANSPORTS[::-1]  # turns
            for kind in order:
                runs[kind].append(measure(bench, kind))
    finally:
        bench.close()
    results = {kind: _summarise(samples, nbytes, instances) for kind, samples in runs.items()}
    return {"bytes_per_version": nbytes, "tensors": len(shapes), "results": results, "runs": runs}


def _element_size(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _summarise(samples: list[dict], nbytes: int, instances: int) -> dict[str, dict]:
    summary: dict[str, dict] = {}
    for row in ROWS:
        taken = [s[row] for s in samples if row in s]
        if not taken:
            continue
        wall = statistics.median(t["s"] for t in taken)
        moved = nbytes * (instances if row == "trainer->all" else 1)
        summary[row] = {
            "s": wall,
            "gb_per_s": moved / wall / 1e9,
            "cpu_s": statistics.median(t["cpu_s"] for t in taken),
            "repeats": len(taken),
        }
    return summary


def cases(args: argparse.Namespace) -> list[tuple[str, str, dict[str, tuple[int, ...]]]]:
    """(shape, payload, tensor shapes) for every shape and payload asked for."""
    if args.params is not None:
        shaped = {f"qwen2-{args.params / 1e6:.0f}m": qwen2_shapes(args.params)}
    else:
        shaped = {name: model_shapes(name) for name in args.shapes}
    out = []
    for name, full in shaped.items():
        for payload in args.payloads:
            out.append(
                (name, payload, full if payload == "full" else adapter_shapes(full, args.rank))
            )
    return out


def table(report: dict) -> Table:
    out = Table(
        title=f"weights bench: {report['dtype']}, {report['instances']} instances, full weights "
        f"against a rank-{report['rank']} adapter (alpha {report['alpha']:g})"
    )
    columns = ("shape", "version", "MB", "transfer", "object_store s", "collective s",
               "CPU s (store / coll.)", "full / adapter s (store / coll.)")  # fmt: skip
    for col in columns:
        out.add_column(col, justify="right")
    for case in report["cases"]:
        full = _full_of(report, case)
        for i, row in enumerate(ROWS):
            got = [case["results"][kind].get(row) for kind in TRANSPORTS]
            if None in got:
                continue
            head = (case["shape"], case["payload"], f"{case['bytes_per_version'] / 1e6:.1f}")
            ratio = "-"
            if full is not case and all(full["results"][k].get(row) for k in TRANSPORTS):
                ratio = " / ".join(
                    f"{full['results'][k][row]['s'] / g['s']:.1f}x"
                    for k, g in zip(TRANSPORTS, got, strict=True)
                )
            out.add_row(*(head if i == 0 else ("", "", "")), row,
                        *(f"{g['s']:.3f}" for g in got),
                        " / ".join(f"{g['cpu_s']:.2f}" for g in got), ratio)  # fmt: skip
    out.caption = (
        f"median of {report['repeats']} (transports in turns); publish: the trainer's copy and "
        f"fingerprints at a step; trainer->all: all {report['instances']} instances, peers "
        f"first; load average {report['load_average']}"
    )
    return out


def _full_of(report: dict, case: dict) -> dict:
    """The full-weight case of `case`'s shape (itself when none was run)."""
    for other in report["cases"]:
        if other["shape"] == case["shape"] and other["payload"] == "full":
            return other
    return case


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="dorarl bench weights", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", required=True, type=Path, help="folder for weights.json")
    parser.add_argument(
        "--quick", action="store_true", help="one repeat, 2 instances (a few minutes)"
    )
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES),
                        choices=sorted(SHAPES), help="model shapes (dorarl.bench.shapes)")  # fmt: skip
    parser.add_argument("--params", type=int, default=None,
                        help="instead of --shapes: a Qwen2 of about N parameters")  # fmt: skip
    parser.add_argument("--payloads", nargs="+", default=list(PAYLOADS), choices=PAYLOADS,
                        help="full weights, a LoRA adapter alone, or both")  # fmt: skip
    parser.add_argument("--rank", type=int, default=16, help="the adapter's LoRA rank")
    parser.add_argument("--alpha", type=float, default=32.0, help="the adapter's LoRA alpha")
    parser.add_argument("--dtype", default="bfloat16", help="the engines' dtype: what is sent")
    parser.add_argument("--instances", type=int, default=3, help="instances (>= 2)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats per transport")
    parser.add_argument("--bucket-mb", type=int, default=256, help="weights.bucket_mb")
    args = parser.parse_args(argv)
    _check(args)
    repeats = 1 if args.quick else args.repeats
    instances = 2 if args.quick else args.instances
    adapter = AdapterSpec(args.alpha, args.rank)
    start_local_ray(num_cpus=os.cpu_count() or 2)
    report: dict[str, Any] = {"cases": []}
    try:
        for shape, payload, shapes in cases(args):
            on_wire = adapter if payload == "adapter" else None
            result = run(shapes, args.dtype, instances, repeats, args.bucket_mb, on_wire)
            params = sum(_numel(s) for s in shapes.values())
            report["cases"].append({"shape": shape, "payload": payload, "params": params, **result})
    finally:
        ray.shutdown()
    report.update(
        dtype=args.dtype, rank=args.rank, alpha=args.alpha, repeats=repeats,
        instances=instances, quick=args.quick, bucket_mb=args.bucket_mb,
        load_average=" ".join(f"{x:.1f}" for x in load_average()),
    )  # fmt: skip
    write_json(args.out, "weights.json", report)
    table_console().print(table(report))
    return 0


def _check(args: argparse.Namespace) -> None:
    if args.instances < 2:
        raise UserInputError(f"--instances: at least 2 (a peer), got {args.instances}")
    if args.dtype not in ("float32", "bfloat16", "float16"):
        raise UserInputError(f"--dtype: float32 | bfloat16 | float16, got {args.dtype!r}")
    if args.rank < 1:
        raise UserInputError(f"--rank: at least 1, got {args.rank}")
