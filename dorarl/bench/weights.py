"""`dorarl bench weights`: how fast each weight transport carries a version, trainer to one
instance, trainer to all of them (the peer-first tree) and peer to peer.

A Qwen2-0.5B-shaped set of random weights (or `--params N` of the same family) in the
engines' dtype, moved by the runtime's own transports (`object_store`: Ray's object store;
`collective`: a torch.distributed group formed once, gloo on the CPU) between actors that
publish and load as the trainer and the engines do (dorarl.bench.weight_holders), every
load verified against the sender's fingerprints. The transports take turns, repeat by
repeat; each row gives the median wall seconds, GB/s and the CPU seconds all the actors
spent on it (the figure to trust on a loaded machine).
"""

from __future__ import annotations

import argparse
import os
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
from dorarl.bench.shapes import SHAPES
from dorarl.bench.weight_holders import SinkHolder, SourceHolder
from dorarl.errors import UserInputError
from dorarl.report.console import table_console
from dorarl.runtime.local_ray import start_local_ray
from dorarl.runtime.transfer.transports import make_transport
from dorarl.runtime.transfer.weight_endpoints import WEIGHTS_GROUP
from dorarl.runtime.transfer.weights_config import TransportSpec

TRANSPORTS = ("object_store", "collective")
MIN_PARAMS = 16_000_000
ROWS = ("publish", "trainer->one", "trainer->all", "peer->peer")


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
    """The actors and both transports, started once; each measurement moves a new version."""

    def __init__(self, shapes: dict, dtype: str, instances: int, bucket_mb: int) -> None:
        options = {"num_cpus": 0, "concurrency_groups": {WEIGHTS_GROUP: 1}}
        self.source = ray.remote(**options)(SourceHolder).remote(shapes, dtype, 1)
        self.sinks = [ray.remote(**options)(SinkHolder).remote(i, 1) for i in range(instances)]
        self.actors = [self.source, *self.sinks]
        ray.get([a.cpu_s.remote() for a in self.actors])
        self.transports = {
            kind: make_transport(TransportSpec(kind, dtype, bucket_mb << 20, 300.0, "gloo"), 0)
            for kind in TRANSPORTS
        }
        for transport in self.transports.values():
            transport.start(self.source, self.sinks)  # collective: the group, formed once

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


def run(shapes: dict, dtype: str, instances: int, repeats: int, bucket_mb: int) -> dict:
    bench = Bench(shapes, dtype, instances, bucket_mb)
    nbytes = (
        sum(_numel(s) for s in shapes.values())
        * torch.empty((), dtype=getattr(torch, dtype)).element_size()
    )
    runs: dict[str, list[dict]] = {kind: [] for kind in TRANSPORTS}
    for repeat in range(repeats):
        order = TRANSPORTS if repeat % 2 == 0 else TRANSPORTS[::-1]  # turns
        for kind in order:
            runs[kind].append(measure(bench, kind))
    results = {kind: _summarise(samples, nbytes, instances) for kind, samples in runs.items()}
    return {"bytes_per_version": nbytes, "results": results, "runs": runs}


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


def table(report: dict) -> Table:
    gb = report["bytes_per_version"] / 1e9
    title = (
        f"weights bench: {report['params'] / 1e6:.0f}M params, {report['dtype']}, "
        f"{gb:.2f} GB a version, {report['instances']} instances"
    )
    out = Table(title=title)
    for col in ("transfer", "transport", "s", "GB/s", "CPU s", "x object_store (s)"):
        out.add_column(col, justify="right")
    for row in ROWS:
        base = report["results"]["object_store"].get(row)
        for kind in TRANSPORTS:
            got = report["results"][kind].get(row)
            if got is None:
                continue
            speedup = f"{base['s'] / got['s']:.2f}" if base else "-"
            out.add_row(row if kind == TRANSPORTS[0] else "", kind, f"{got['s']:.2f}",
                        f"{got['gb_per_s']:.2f}", f"{got['cpu_s']:.2f}", speedup)  # fmt: skip
    out.caption = (
        f"median of {report['repeats']} (transports in turns); publish: the trainer's copy "
        f"and fingerprints at a step; trainer->all: GB/s of all {report['instances']} copies; "
        f"load average {report['load_average']}"
    )
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="dorarl bench weights", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", required=True, type=Path, help="folder for weights.json")
    parser.add_argument(
        "--quick", action="store_true", help="one repeat, 2 instances (under 2 minutes)"
    )
    parser.add_argument("--params", type=int, default=None, help="parameters (default: Qwen2-0.5B)")
    parser.add_argument("--dtype", default="bfloat16", help="the engines' dtype: what is sent")
    parser.add_argument("--instances", type=int, default=3, help="instances (>= 2)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats per transport")
    parser.add_argument("--bucket-mb", type=int, default=256, help="weights.bucket_mb")
    args = parser.parse_args(argv)
    if args.instances < 2:
        raise UserInputError(f"--instances: at least 2 (a peer), got {args.instances}")
    if args.dtype not in ("float32", "bfloat16", "float16"):
        raise UserInputError(f"--dtype: float32 | bfloat16 | float16, got {args.dtype!r}")
    shapes = qwen2_shapes(args.params)
    repeats = 1 if args.quick else args.repeats
    instances = 2 if args.quick else args.instances
    start_local_ray(num_cpus=os.cpu_count() or 2)
    try:
        report = run(shapes, args.dtype, instances, repeats, args.bucket_mb)
    finally:
        ray.shutdown()
    report.update(
        params=sum(_numel(s) for s in shapes.values()), dtype=args.dtype, repeats=repeats,
        instances=instances, quick=args.quick, bucket_mb=args.bucket_mb,
        load_average=" ".join(f"{x:.1f}" for x in load_average()),
    )  # fmt: skip
    write_json(args.out, "weights.json", report)
    table_console().print(table(report))
    return 0
