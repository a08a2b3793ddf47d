"""Turns a scheduled batch into tensors, runs the forward pass, samples the finished rows.

Row order is decode rows, then one chunk per prefill row. Everything the layers share
(token ids, positions, pool write rows, the attention plan, the rows that need logits) is
built once per step here, never per layer. A row samples only when its chunk
reaches the end of its sequence's tokens; earlier prefill chunks just fill the KV pool.
With `record_routes` (an MoE model), `last_routes` holds after each step the expert ids of
the rows that sampled, `[rows, width]` on the CPU in the routes' dtype (data/routes.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dorarl.data.routes import route_dtype
from dorarl.engine.attention import (
    DecodePlan,
    PagedAttention,
    PrefillPlan,
    SeqRows,
    StepPlan,
    plan_decode,
    plan_prefill,
)
from dorarl.engine.cpu_kernels import DecodeKernel
from dorarl.engine.kv_cache import KVCache
from dorarl.engine.model import Transformer
from dorarl.engine.sampler import SampleRow, sample
from dorarl.engine.scheduler import Batch
from dorarl.engine.sequence import Sequence


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: PagedAttention
    sample_rows: torch.Tensor | None  # None: every row samples (a decode-only step)
    samplers: list[Sequence]  # the sequence of each sampled row


class ModelRunner:
    def __init__(
        self,
        model: Transformer,
        cache: KVCache,
        decode_kernel: DecodeKernel | None = None,
        record_routes: bool = False,
    ) -> None:
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.decode_kernel = decode_kernel  # the fused CPU decode attention, or None
        self.record_routes = record_routes
        self.last_routes: torch.Tensor | None = None

    def run(self, batch: Batch) -> list[tuple[Sequence, int, float]]:
        """(sequence, token, logprob) for each row that sampled this step."""
        items = self.order(batch)
        inputs = self.prepare(items)
        routes = self.new_routes()
        logits = self.model.forward(
            inputs.input_ids, inputs.positions, inputs.attention, inputs.sample_rows, routes
        )
        self.keep_routes(routes)
        if not inputs.samplers:
            return []
        rows = [SampleRow(s.params, s.seed, s.num_output) for s in inputs.samplers]
        tokens, logprobs = sample(logits, rows)
        return list(zip(inputs.samplers, tokens, logprobs, strict=True))

    def new_routes(self) -> list[torch.Tensor] | None:
        return [] if self.record_routes else None

    def keep_routes(self, routes: list[torch.Tensor] | None) -> None:
        """The step's sampled rows' routes `[rows, layers x top_k]`, on the CPU, compact."""
        if not routes:
            self.last_routes = None
            return
        assert self.model.spec.moe is not None  # routes come from expert layers only
        dtype = getattr(torch, route_dtype(self.model.spec.moe.num_experts))
        self.last_routes = torch.stack(routes, dim=1).flatten(1).to(dtype).cpu()

    @staticmethod
    def order(batch: Batch) -> list[tuple[Sequence, int]]:
        return batch.items

    def prepare(self, items: list[tuple[Sequence, int]]) -> StepInputs:
        ids, positions, blocks, sample_rows, samplers = [], [], [], [], []
        bs = self.cache.shape.block_size
        for seq, n in items:
            start = seq.num_computed
            ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            blocks.extend(seq.block_table[p // bs] for p in range(start, start + n))
            if start + n == seq.num_tokens:
                sample_rows.append(len(ids) - 1)
                samplers.append(seq)
        dev = self.device
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        plan = StepPlan(self._write_rows(blocks, pos), *self._plan(items))
        attention = PagedAttention(self.cache, plan, self.decode_kernel)
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=pos,
            attention=attention,
            sample_rows=None
            if len(sample_rows) == len(ids)
            else torch.tensor(sample_rows, dtype=torch.long, device=dev),
            samplers=samplers,
        )

    def _write_rows(self, blocks: list[int], positions: torch.Tensor) -> torch.Tensor:
        """Flat pool row of each (token, kv head), in the order of k.reshape(-1, head_dim)."""
        s = self.cache.shape
        block = torch.tensor(blocks, dtype=torch.long, device=self.device)
        heads = torch.arange(s.num_kv_heads, device=self.device)
        tile = block[:, None] * s.num_kv_heads + heads[None, :]
        return (tile * s.block_size + (positions % s.block_size)[:, None]).reshape(-1)

    def _plan(
        self, items: list[tuple[Sequence, int]]
    ) -> tuple[DecodePlan | None, list[PrefillPlan]]:
        s = self.cache.shape
        per_kv = self.model.spec.num_heads // s.num_kv_heads
        args = (s.num_kv_heads, per_kv, s.block_size, self.device)
        rows = [SeqRows(seq.block_table, seq.num_computed, n) for seq, n in items]
        num_decode = sum(1 for seq, _ in items if seq.decodes)
        decode = None
        if num_decode:
            fused = self.decode_kernel is not None
            decode = plan_decode(rows[:num_decode], *args, block_range=not fused)
        prefill, row = [], num_decode
        for item in rows[num_decode:]:
            prefill.append(plan_prefill(row, item, *args))
            row += item.q_len
        return decode, prefill
