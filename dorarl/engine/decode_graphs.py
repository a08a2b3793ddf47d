"""CUDA graphs of the decode step: one per batch-size bucket, replayed over static inputs.

A decode step of n rows runs the graph of the smallest bucket >= n. Every input the graph
reads lives in one static int64 device buffer (token ids, positions, pool write rows,
context lengths, each row's first split-K partition, block tables `[max_batch,
max_blocks]`), filled each step from a pinned
host mirror by one non-blocking copy; rows n..bucket are padding: context length 0 (the
decode kernel gives 0 and reads nothing) and their K/V written to a scratch block the
block manager never hands out. Logits come back in the graph's static output; sampling
runs after it, eagerly (`device_sampler`: its filtered path depends on the rows).

Invariants of the captured region (the model's decode forward + `TritonPagedAttention`):
no host sync (`.item()`, `.tolist()`, `torch.tensor(list)` onto the device, `nonzero`,
data-dependent shapes or Python branches on device values), no CPU tensors, no tensor
whose address changes between steps: the KV pool, the weights, the RoPE tables and the
static buffer are allocated once. Allocations inside are fine (they come from the graph's
private pool, shared by all buckets, largest captured first). Triton kernels compile in
the warm-up before capture; the decode grid depends only on shapes, so a bucket's graph
serves any contexts up to `max_blocks` blocks.
The split-K partials of long contexts are packed row after row (each row's first
partition is in the static buffer), in a buffer sized for what the pool can hold: its tokens
in partitions plus one per row (`memory.split_partitions`), not `max_batch` full tables.

Weights: a graph bakes in the addresses of the weights it read, so a new version must be
copied into the same storage, never swapped for new tensors (`Engine.load_weights` copies
each tensor into its place, `weights.load_in_place`; `load_weights_in_place` here copies a
whole packed set); then no recapture is needed. Without a GPU (`graphs=False`) `run` executes the same
forward over the same static buffers eagerly, which is what the CPU tests check.

Wiring (in `engine.py` and `device_runner.py`): the engine, on cuda,
builds `KVCache` with `kv_blocks + 1` blocks and passes the last as `scratch_block`;
`device_runner.build_graphs` builds `DecodeGraphs(forward, cache, max_num_seqs,
ceil(max_model_len / block_size), scratch_block)`, calls `capture()` and checks a replay
against `eager` at start-up (preflight.py; where either fails, `auto` decodes eagerly); in
`DeviceRunner.run`, a batch of decode rows only goes to `graphs.run(token_ids, rows)` (a
batch with prefill chunks runs eagerly on `TritonPagedAttention`); `Engine.load_weights`
copies the new tensors into the live ones (`weights.load_in_place`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from dorarl.engine.kv_cache import KVCache
from dorarl.engine.linear import Linear
from dorarl.engine.memory import default_buckets, split_partitions
from dorarl.engine.triton_attention import (
    PARTITION_TOKENS,
    PagedStep,
    SplitLayout,
    StepRows,
    TritonPagedAttention,
)
from dorarl.engine.weights import ModelWeights

__all__ = ["DecodeGraphs", "default_buckets", "load_weights_in_place"]

# forward(input_ids, positions, attention) -> logits [rows, vocab]
DecodeForward = Callable[[torch.Tensor, torch.Tensor, TritonPagedAttention], torch.Tensor]


class DecodeGraphs:
    """Decode forwards of up to `max_batch` rows over static buffers, as CUDA graphs on cuda."""

    def __init__(
        self,
        forward: DecodeForward,
        cache: KVCache,
        max_batch: int,
        max_blocks: int,
        scratch_block: int,
        buckets: Sequence[int] | None = None,
        graphs: bool | None = None,
    ) -> None:
        self.forward = forward
        self.cache = cache
        self.buckets = sorted(buckets or default_buckets(max_batch))
        assert self.buckets[-1] == max_batch, "the largest bucket must be max_batch"
        self.max_batch, self.max_blocks, self.scratch_block = max_batch, max_blocks, scratch_block
        # The split-K partials of a step, for what the pool holds (its blocks below the
        # scratch block), not max_batch tables of max_blocks each.
        table = max_blocks * cache.shape.block_size
        self.split_parts = split_partitions(
            scratch_block * cache.shape.block_size, max_batch, table
        )
        self.use_graphs = cache.device.type == "cuda" if graphs is None else graphs
        self.layout = _Layout(max_batch, cache.shape.num_kv_heads, max_blocks)
        pin = cache.device.type == "cuda"
        self.host = torch.zeros(self.layout.size, dtype=torch.long, pin_memory=pin)
        self.host_np = self.host.numpy()  # the same memory, written without torch overhead
        self.static = torch.zeros(self.layout.size, dtype=torch.long, device=cache.device)
        self.uploaded = torch.cuda.Event() if pin else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._fill_padding(0)  # all rows padding until a step fills them

    def bucket_for(self, rows: int) -> int:
        for b in self.buckets:
            if b >= rows:
                return b
        raise ValueError(f"decode batch of {rows} rows exceeds max_batch={self.max_batch}")

    # --- capture ----------------------------------------------------------------------
    def capture(self) -> None:
        """Warm up and capture every bucket, largest first (its memory serves the others)."""
        if not self.use_graphs:
            return
        self.static.copy_(self.host)
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for b in self.buckets:
                self._forward(b)  # compiles the Triton kernels, sets up cuBLAS
        torch.cuda.current_stream().wait_stream(side)
        for b in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self._forward(b)
            self.graphs[b] = graph

    def _forward(self, bucket: int) -> torch.Tensor:
        v = self.layout.views(self.static, bucket)
        split = SplitLayout(v["part_starts"], max(1, self.split_parts))
        step = PagedStep(v["write_rows"], bucket, v["tables"], v["lens"], None, split)
        return self.forward(v["ids"], v["positions"], TritonPagedAttention(self.cache, step))

    # --- a step -----------------------------------------------------------------------
    def run(self, token_ids: Sequence[int], rows: Sequence[StepRows]) -> torch.Tensor:
        """Logits `[len(rows), vocab]` of one decode row per sequence (q_len 1, the new
        token at position `start`); a view of the static output, valid until the next run."""
        n = len(rows)
        bucket = self.bucket_for(n)
        if self.uploaded is not None:
            self.uploaded.synchronize()  # the mirror is free again (done long ago, normally)
        self._fill(token_ids, rows)
        self._fill_padding(n)
        self.static.copy_(self.host, non_blocking=True)
        if self.uploaded is not None:
            self.uploaded.record()
        if bucket in self.graphs:
            self.graphs[bucket].replay()
            return self.outputs[bucket][:n]
        return self._forward(bucket)[:n]

    def eager(self, rows: int) -> torch.Tensor:
        """The eager forward of the latest `run`'s inputs, still in the static buffer (what a
        replay must equal: the start-up check, preflight.py)."""
        return self._forward(self.bucket_for(rows))[:rows]

    def _fill(self, token_ids: Sequence[int], rows: Sequence[StepRows]) -> None:
        """Write the step into the host mirror (numpy: a few array writes, no torch ops)."""
        n = len(rows)
        v = self.layout.views(self.host_np, self.max_batch)
        bs, kv_heads = self.cache.shape.block_size, self.cache.shape.num_kv_heads
        starts = np.fromiter((r.start for r in rows), dtype=np.int64, count=n)
        assert all(r.q_len == 1 for r in rows), "decode rows only"
        assert n == 0 or starts.max() < self.max_blocks * bs, "a context beyond max_blocks"
        v["ids"][:n] = token_ids
        v["positions"][:n] = starts
        v["lens"][:n] = starts + 1
        for i, r in enumerate(rows):
            v["tables"][i, : r.start // bs + 1] = r.table[: r.start // bs + 1]
        blocks = v["tables"][np.arange(n), starts // bs]
        tiles = blocks[:, None] * kv_heads + np.arange(kv_heads)[None, :]
        v["write_rows"][: n * kv_heads] = (tiles * bs + (starts % bs)[:, None]).reshape(-1)
        parts = -(-(starts + 1) // PARTITION_TOKENS)
        v["part_starts"][:n] = np.cumsum(parts) - parts
        used = int(parts.sum())
        v["part_starts"][n:] = used  # padding rows have no partitions
        assert not self.split_parts or used <= self.split_parts, "partials beyond their bound"

    def _fill_padding(self, first: int) -> None:
        """Rows first.. attend to nothing and write their K/V into the scratch block."""
        v = self.layout.views(self.host_np, self.max_batch)
        kv_heads, bs = self.cache.shape.num_kv_heads, self.cache.shape.block_size
        v["ids"][first:] = 0
        v["positions"][first:] = 0
        v["lens"][first:] = 0
        if first == 0:
            v["part_starts"][:] = 0
        scratch = (self.scratch_block * kv_heads + np.arange(kv_heads)) * bs
        v["write_rows"].reshape(-1, kv_heads)[first:] = scratch


class _Layout:
    """Sections of the static buffer; each is sized for max_batch, a bucket uses a prefix."""

    def __init__(self, max_batch: int, kv_heads: int, max_blocks: int) -> None:
        self.shapes = {
            "ids": (max_batch,),
            "positions": (max_batch,),
            "lens": (max_batch,),
            "part_starts": (max_batch,),
            "write_rows": (max_batch * kv_heads,),
            "tables": (max_batch, max_blocks),
        }
        self.kv_heads = kv_heads
        self.size = sum(_numel(s) for s in self.shapes.values())

    def views(self, buffer, bucket: int) -> dict:
        """Views of a torch tensor or a numpy array holding the layout."""
        out, at = {}, 0
        for name, shape in self.shapes.items():
            n = _numel(shape)
            full = buffer[at : at + n].reshape(shape)
            out[name] = full[: bucket * (self.kv_heads if name == "write_rows" else 1)]
            at += n
        return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _tensors(w: ModelWeights) -> Iterator[torch.Tensor]:
    yield w.embed
    for layer in w.layers:
        for part in vars(layer).values():
            yield from _parts(part)
    yield w.norm
    yield from _parts(w.lm_head)


def _parts(part: torch.Tensor | Linear | None) -> Iterator[torch.Tensor]:
    """The tensors a layer field holds: itself, or a product's weight, bias and packed copy
    (the packed copy exists on CPU only, where no graph is captured)."""
    if isinstance(part, Linear):
        yield from (t for t in (part.weight, part.bias, part.packed) if t is not None)
    elif part is not None:
        yield part


def load_weights_in_place(live: ModelWeights, new: ModelWeights) -> None:
    """Copy a new version into the live weights' storage (captured graphs stay valid).

    Every shape and dtype is checked before the first copy, so a mismatch changes nothing."""
    pairs = list(zip(_tensors(live), _tensors(new), strict=True))
    for dst, src in pairs:
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(
                f"weights differ: {tuple(src.shape)} {src.dtype} for {tuple(dst.shape)} {dst.dtype}"
            )
    for dst, src in pairs:
        dst.copy_(src, non_blocking=True)
