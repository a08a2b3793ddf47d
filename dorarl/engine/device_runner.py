"""The model runner on the GPU fast paths: Triton paged attention, device sampling, graphs.

Same contract as `model_runner.ModelRunner.run` (rows: decode rows, then one chunk per
prefill row; a row samples when its chunk reaches the end of its tokens). A decode-only
step replays the CUDA graph of its batch bucket (`decode_graphs.py`); any step with a
prefill chunk runs eagerly on `TritonPagedAttention`. With `engine.attention=torch` the
tensors come from `ModelRunner.prepare`, so only the sampler differs. Sampling on the device
uploads the rows' settings before the forward (the copy overlaps it) and syncs once.
The CPU default never comes here: `Engine` runs `ModelRunner` when nothing is switched on.
"""

from __future__ import annotations

import torch

from dorarl.engine.attention import SeqRows
from dorarl.engine.backends import Backends
from dorarl.engine.config import EngineConfig
from dorarl.engine.device_sampler import fetch, sample_on_device, sampling_batch
from dorarl.engine.kv_cache import KVCache
from dorarl.engine.model import Transformer
from dorarl.engine.model_runner import ModelRunner
from dorarl.engine.preflight import check_graph_replay
from dorarl.engine.sampler import SampleRow, sample
from dorarl.engine.scheduler import Batch
from dorarl.engine.sequence import Sequence


class DeviceRunner:
    def __init__(
        self, model: Transformer, base: ModelRunner, backends: Backends, graphs=None
    ) -> None:
        self.model = model
        self.base = base  # today's runner: its tensors serve engine.attention=torch
        self.cache = base.cache
        self.device = base.device
        self.backends = backends
        self.graphs = graphs  # decode_graphs.DecodeGraphs, or None

    def run(self, batch: Batch) -> list[tuple[Sequence, int, float]]:
        """(sequence, token, logprob) for each row that sampled this step."""
        items = ModelRunner.order(batch)
        samplers = [seq for seq, n in items if seq.num_computed + n == seq.num_tokens]
        rows = [SampleRow(s.params, s.seed, s.num_output) for s in samplers]
        on_device = None
        if samplers and self.backends.sampler == "device":
            on_device = sampling_batch(rows, self.model.spec.vocab_size, self.device)
        routes = self.base.new_routes()
        logits = self._forward(items, routes)
        self.base.keep_routes(routes)
        if not samplers:
            return []
        if on_device is not None:
            tokens, logprobs = fetch(*sample_on_device(logits, on_device))
        else:
            tokens, logprobs = sample(logits, rows)
        return list(zip(samplers, tokens, logprobs, strict=True))

    @property
    def last_routes(self) -> torch.Tensor | None:
        return self.base.last_routes

    def _forward(
        self, items: list[tuple[Sequence, int]], routes: list[torch.Tensor] | None
    ) -> torch.Tensor:
        """Logits of the rows that sample, in row order (MoE models never capture graphs)."""
        num_decode = sum(1 for seq, _ in items if seq.decodes)
        if self.graphs is not None and num_decode == len(items):
            rows = [SeqRows(seq.block_table, seq.num_computed, 1) for seq, _ in items]
            return self.graphs.run([seq.token_ids[seq.num_computed] for seq, _ in items], rows)
        if self.backends.attention in ("torch", "cpp"):  # the base runner's attention.py
            i = self.base.prepare(items)
            return self.model.forward(i.input_ids, i.positions, i.attention, i.sample_rows, routes)
        return self._triton_eager(items, num_decode, routes)

    def _triton_eager(
        self,
        items: list[tuple[Sequence, int]],
        num_decode: int,
        routes: list[torch.Tensor] | None,
    ) -> torch.Tensor:
        from dorarl.engine.triton_attention import TritonPagedAttention, plan_paged_step

        ids, positions, last_rows = [], [], []
        for seq, n in items:
            start = seq.num_computed
            ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            if start + n == seq.num_tokens:
                last_rows.append(len(ids) - 1)
        flat = _upload(ids + positions + last_rows, self.device)
        input_ids, pos, sample_rows = flat.split((len(ids), len(ids), len(last_rows)))
        s = self.cache.shape
        q_per_kv = self.model.spec.num_heads // s.num_kv_heads
        seq_rows = [SeqRows(seq.block_table, seq.num_computed, n) for seq, n in items]
        step = plan_paged_step(
            seq_rows, num_decode, s.num_kv_heads, q_per_kv, s.block_size, self.device
        )
        every_row = len(last_rows) == len(ids)
        attention = TritonPagedAttention(self.cache, step)
        rows = None if every_row else sample_rows
        return self.model.forward(input_ids, pos, attention, rows, routes)


def _upload(values: list[int], device: torch.device) -> torch.Tensor:
    """One host-to-device copy of the step's int64 inputs (pinned, non-blocking on cuda)."""
    host = torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


# --- set-up ---------------------------------------------------------------------------------
def build_graphs(model: Transformer, cache: KVCache, config: EngineConfig, kv_blocks: int):
    """The decode graphs over `cache`, captured (on cuda) and checked against their eager
    forward (preflight.py); the pool's last block, past the `kv_blocks` the block manager
    hands out, is their scratch block (`Engine` made the pool one block larger)."""
    from dorarl.engine.decode_graphs import DecodeGraphs

    max_blocks = -(-config.max_model_len // config.block_size)
    graphs = DecodeGraphs(
        lambda ids, pos, attention: model.forward(ids, pos, attention),
        cache, config.max_num_seqs, max_blocks, scratch_block=kv_blocks,
    )  # fmt: skip
    graphs.capture()
    check_graph_replay(graphs)
    return graphs
