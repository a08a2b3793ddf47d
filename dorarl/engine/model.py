"""The decoder forward pass (Llama / Qwen2 / Qwen3 families) over a step's flattened tokens.

Tokens of all sequences in a step form one `[tokens, hidden]` matrix, so every matmul is
batched across requests; attention is delegated to a backend (the paged pool in the
engine, a dense cache in the benchmark floor). Numerics follow Hugging Face's modules:
RMSNorm in float32, rotate-half RoPE from precomputed tables, SiLU-gated MLP; Qwen3's
per-head q/k RMSNorm before RoPE where the weights carry it (`norm_qk_heads`).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from dorarl.engine.model_spec import ModelSpec
from dorarl.engine.weights import LayerWeights, ModelWeights


class AttentionBackend(Protocol):
    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on `[tokens, heads, dim]` with cos, sin `[tokens, 1, dim]`."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Transformer:
    def __init__(
        self, spec: ModelSpec, weights: ModelWeights, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        self.spec = spec
        self.weights = weights
        self.cos, self.sin = cos, sin  # [max_len, head_dim], on the device, in the model dtype

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionBackend,
        sample_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits `[rows, vocab]` in float32 for `sample_rows` (all rows when None)."""
        w = self.weights
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        x = F.embedding(input_ids, w.embed)
        for i, layer in enumerate(w.layers):
            x = x + self._attention(
                i, layer, rms_norm(x, layer.input_norm, self.spec.rms_norm_eps), cos, sin, attention
            )
            x = x + self._mlp(layer, rms_norm(x, layer.post_norm, self.spec.rms_norm_eps))
        if sample_rows is not None:
            x = x.index_select(0, sample_rows)
        return F.linear(rms_norm(x, w.norm, self.spec.rms_norm_eps), w.lm_head).float()

    def _attention(
        self,
        index: int,
        layer: LayerWeights,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        s = self.spec
        qkv = F.linear(h, layer.qkv_w, layer.qkv_b).view(h.shape[0], -1, s.head_dim)
        if layer.q_norm is not None:
            qkv = norm_qk_heads(qkv, layer, s)
        qk = rotate(qkv[:, : s.num_heads + s.num_kv_heads], cos, sin)
        q, k = qk[:, : s.num_heads], qk[:, s.num_heads :]
        v = qkv[:, s.num_heads + s.num_kv_heads :]
        return F.linear(attention(index, q, k, v), layer.o_w, layer.o_b)

    @staticmethod
    def _mlp(layer: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(h, layer.gate_up_w, layer.gate_up_b).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, layer.down_w, layer.down_b)


def norm_qk_heads(qkv: torch.Tensor, layer: LayerWeights, spec: ModelSpec) -> torch.Tensor:
    """`[tokens, q|k|v heads, dim]` with each q head and each k head RMS-normalised over its
    dim (its own weights for q and for k); v is left as it is."""
    q_end = spec.num_heads
    k_end = q_end + spec.num_kv_heads
    q = rms_norm(qkv[:, :q_end], layer.q_norm, spec.rms_norm_eps)
    k = rms_norm(qkv[:, q_end:k_end], layer.k_norm, spec.rms_norm_eps)
    return torch.cat((q, k, qkv[:, k_end:]), dim=1)
