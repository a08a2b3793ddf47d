"""What an engine's share of a GPU holds: its weights and workspace, then whole KV blocks.

Pure arithmetic on byte counts, no device: tests give the totals (an H200's 141 GB, a 24 GB
card). On cuda the engine sizes its pool with `plan_kv` from `torch.cuda.mem_get_info`, as
vLLM's gpu_memory_utilization does: share x total memory - weights - workspace, rounded down
to blocks, and never more than `max_num_seqs` full-length sequences can use (an explicit
`engine.num_blocks` wins). On the CPU the same, `HOST_SHARE` of the host memory the
process may use (dorarl.engine.host_memory). The driver and `dorarl train --print-placement`
run the same arithmetic with a stated total before any actor starts. Torch-free, so the
simulator's cost model takes `kv_bytes_per_token` from here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dorarl.engine.config import DECODE_PARTITION_TOKENS, TRITON_MIN, EngineConfig

if TYPE_CHECKING:
    from dorarl.engine.model_spec import ModelSpec

GB = 1e9
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DEFAULT_SHARE = 0.9  # an engine on cuda outside a placement: vLLM's default utilization
# An engine on the CPU shares the host with the trainer and its peer engines: its pool, weights
# and workspace take at most this share of the memory the process may use (host_memory.py).
HOST_SHARE = 0.25
# The CUDA context, cuBLAS workspaces and loaded kernels: device memory outside torch's
# allocator, which mem_get_info counts as used (measured by the device check).
CONTEXT_BYTES = 1 << 30
# Bytes per logit of a row that samples: the 16-bit logits, their float32 copy, the scaled
# logits, log-softmax, exp and CDF, and the filtered path's sorted values, int64 order and
# float64 probabilities and sums (device_sampler.py).
LOGIT_BYTES = 64


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """K and V of one token across all layers."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def weight_bytes(spec: ModelSpec, dtype_bytes: int) -> int:
    """The packed weights on the device (fused q|k|v and gate|up hold the same elements)."""
    return spec.num_parameters() * dtype_bytes


def activation_bytes_per_token(spec: ModelSpec, dtype_bytes: int) -> int:
    """The most one token's pass through a layer keeps live at once (each layer's
    temporaries go before the next): the residual and its norm (computed in float32), q|k|v
    and its roped copies, the attention output, and the MLP's gate|up, activation and product;
    in an expert layer also its router's float32 probabilities and, per routed expert, the
    token's gathered copy, that expert's output and its weighted copy."""
    h, qkv = spec.hidden_size, spec.q_size + 2 * spec.kv_size
    values = 3 * h + 3 * qkv + spec.q_size + 4 * spec.mlp_width
    routing = 0 if spec.moe is None else 3 * spec.moe.top_k * h * dtype_bytes
    routing += 0 if spec.moe is None else 8 * spec.moe.num_experts
    return dtype_bytes * values + 8 * h + routing


def default_buckets(max_batch: int) -> list[int]:
    """The decode graphs' batch buckets: 1, 2, 4, 8, then every multiple of 8, up to and
    including max_batch."""
    sizes = {b for b in (1, 2, 4) if b < max_batch} | set(range(8, max_batch, 8)) | {max_batch}
    return sorted(sizes)


def split_partitions(
    pool_tokens: int, max_batch: int, table_tokens: int, partition: int = DECODE_PARTITION_TOKENS
) -> int:
    """Partitions a decode step's split-K partials need room for, at most: none when a table
    of `table_tokens` keys fits one partition; else each row's own partitions, packed one
    after another, which is never more than the pool's tokens in partitions plus one
    rounding per row (rows hold distinct blocks), nor `max_batch` full tables."""
    per_row = math.ceil(table_tokens / partition)
    if per_row <= 1:
        return 0
    return min(max_batch * per_row, math.ceil(pool_tokens / partition) + max_batch)


def partition_bytes(spec: ModelSpec) -> int:
    """One partition's partials over every kv head: max, sum and weighted values in float32,
    for the query rows of a kv head padded as the decode kernel pads them."""
    group = spec.num_heads // spec.num_kv_heads
    rows = max(TRITON_MIN, 1 << (group - 1).bit_length())
    return spec.num_kv_heads * rows * (spec.head_dim + 2) * 4


@dataclass(frozen=True)
class Workspace:
    """Device memory an engine uses besides its weights and KV pool, estimated up front."""

    context: int  # outside torch's allocator
    eager: int  # the largest step's activations, logits and sampling, split-K partials
    graphs: int  # the graphs' private pool: the largest bucket's step, every bucket's logits
    rope: int  # cos, sin and signed-sin tables

    @property
    def total(self) -> int:
        return self.context + self.eager + self.graphs + self.rope

    @property
    def allocated(self) -> int:
        """What is still to be allocated once the process holds its context."""
        return self.total - self.context


def workspace(
    spec: ModelSpec, config: EngineConfig, dtype_bytes: int, graphs: bool, pool_blocks: int
) -> Workspace:
    per_token = activation_bytes_per_token(spec, dtype_bytes)
    rows, vocab = config.max_num_seqs, spec.vocab_size
    table = math.ceil(config.max_model_len / config.block_size) * config.block_size
    partials = split_partitions(pool_blocks * config.block_size, rows, table) * partition_bytes(
        spec
    )
    step_tokens = rows + config.prefill_chunk_size  # decode rows beside a prefill chunk
    eager = step_tokens * per_token + rows * vocab * LOGIT_BYTES + partials
    graph = 0
    if graphs:
        outputs = sum(default_buckets(rows)) * vocab * 4  # each bucket keeps its logits
        graph = rows * per_token + rows * vocab * dtype_bytes + partials + outputs
    rope = 3 * config.max_model_len * spec.head_dim * dtype_bytes
    return Workspace(CONTEXT_BYTES, eager, graph, rope)


@dataclass(frozen=True)
class KVPlan:
    """One engine's device memory: its share of the GPU, weights, workspace, KV pool."""

    total_bytes: int  # the device's memory
    share: float
    weight_bytes: int
    workspace: Workspace
    block_bytes: int  # K and V of one block across all layers
    block_size: int
    blocks: int  # the pool
    needed_blocks: int  # one max_model_len sequence
    explicit: bool  # engine.num_blocks set: the pool is that, whatever the share holds
    free_bytes: int | None = None  # free device memory when the engine sized its pool

    @property
    def share_bytes(self) -> int:
        return int(self.share * self.total_bytes)

    @property
    def minimum_bytes(self) -> int:
        """Weights, workspace and the KV of one max_model_len sequence: the least that runs."""
        return self.weight_bytes + self.workspace.total + self.needed_blocks * self.block_bytes

    @property
    def fits(self) -> bool:
        return self.blocks >= self.needed_blocks and self.minimum_bytes <= self.share_bytes

    def describe(self) -> str:
        """e.g. `KV 1024 blocks of 16 (3.2 GB) in 0.3333 of 141.0 GB: weights 1.0 GB,
        workspace 1.9 GB`."""
        pool = self.blocks * self.block_bytes
        how = (
            "engine.num_blocks"
            if self.explicit
            else f"{self.share:.4g} of {size(self.total_bytes)}"
        )
        free = "" if self.free_bytes is None else f", {size(self.free_bytes)} free at start"
        return (
            f"KV {self.blocks} blocks of {self.block_size} tokens ({size(pool)}) in {how}: "
            f"weights {size(self.weight_bytes)}, workspace {size(self.workspace.total)}{free}"
        )

    def shortfall(self) -> str:
        """Why it cannot run, in words (callers name the key)."""
        one = self.needed_blocks * self.block_bytes
        room = f"{self.share:.4g} of {size(self.total_bytes)} ({size(self.share_bytes)})"
        if self.free_bytes is not None:
            room += f", {size(self.free_bytes)} free"
        return (
            f"{room} cannot hold the weights ({size(self.weight_bytes)}), workspace "
            f"({size(self.workspace.total)}) and the KV of one max_model_len sequence ({size(one)})"
        )


def plan_kv(
    spec: ModelSpec,
    config: EngineConfig,
    dtype_bytes: int,
    graphs: bool,
    total_bytes: int,
    share: float,
    free_bytes: int | None = None,
) -> KVPlan:
    """The pool for `share` of a device of `total_bytes` (capped by `free_bytes`, what is free
    now, when given: measured once the weights are on the device, so it counts them)."""
    block_bytes = (
        kv_bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype_bytes)
        * config.block_size
    )
    wanted = config.kv_blocks  # num_blocks, or max_num_seqs full-length sequences
    work = workspace(spec, config, dtype_bytes, graphs, wanted)
    weights = weight_bytes(spec, dtype_bytes)
    room = share * total_bytes - weights - work.total
    if free_bytes is not None:
        room = min(room, free_bytes - work.allocated)
    blocks = wanted
    if config.num_blocks is None:
        blocks = max(0, min(wanted, int(room // block_bytes)))
    needed = math.ceil(config.max_model_len / config.block_size)
    explicit = config.num_blocks is not None
    return KVPlan(
        total_bytes, share, weights, work, block_bytes, config.block_size, blocks, needed,
        explicit, free_bytes,
    )  # fmt: skip


def size(n: float) -> str:
    """Bytes in words: `33.6 MB`, `1.93 GB`, `141.0 GB`."""
    if n < GB:
        return f"{n / 1e6:.1f} MB"
    return f"{n / GB:.2f} GB" if n < 10 * GB else f"{n / GB:.1f} GB"
