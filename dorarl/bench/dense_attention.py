"""A dense-cache attention backend for the engine bench: the no-paging, no-scheduling floor.

Every sequence of a fixed batch owns one contiguous `[kv_heads, max_len, dim]` slab and all
rows decode at the same position, so attention is one SDPA call per layer with no gather
and no mask. The benchmark's `floor` runs the engine's own `Transformer` on it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dorarl.engine.model_spec import ModelSpec


class DenseAttention:
    def __init__(
        self, spec: ModelSpec, batch: int, max_len: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        shape = (spec.num_layers, batch, spec.num_kv_heads, max_len, spec.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.batch = batch
        self.start = 0  # position of the first token of the current step
        self.q_len = 1

    def set_step(self, start: int, q_len: int) -> None:
        self.start, self.q_len = start, q_len

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q `[batch * q_len, heads, dim]` (batch-major) -> `[batch * q_len, heads * dim]`."""
        b, n, end = self.batch, self.q_len, self.start + self.q_len
        kv_heads, dim = k.shape[1], k.shape[2]
        per_kv = q.shape[1] // kv_heads
        self.k[layer, :, :, self.start : end] = k.view(b, n, kv_heads, dim).transpose(1, 2)
        self.v[layer, :, :, self.start : end] = v.view(b, n, kv_heads, dim).transpose(1, 2)
        qg = (
            q.view(b, n, kv_heads, per_kv, dim)
            .transpose(1, 2)
            .reshape(b, kv_heads, n * per_kv, dim)
        )
        keys, values = self.k[layer, :, :, :end], self.v[layer, :, :, :end]
        if n == 1:
            out = F.scaled_dot_product_attention(qg, keys, values)
        else:
            mask = _prefill_mask(self.start, n, per_kv, end, q.device)
            out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask)
        return out.view(b, kv_heads, n, per_kv, dim).transpose(1, 2).reshape(b * n, -1)


def _prefill_mask(start: int, n: int, per_kv: int, end: int, device: torch.device) -> torch.Tensor:
    rows = start + torch.arange(n, device=device).repeat_interleave(per_kv)
    return torch.arange(end, device=device)[None, :] <= rows[:, None]
