"""The decoder forward pass (Llama / Qwen2 / Qwen3 and their MoE kin) over a step's tokens.

Tokens of all sequences in a step form one `[tokens, hidden]` matrix, so every matmul is
batched across requests; attention is delegated to a backend (the paged pool in the
engine, a dense cache in the benchmark floor). Numerics follow Hugging Face's modules:
RMSNorm in float32, rotate-half RoPE from precomputed tables, SiLU-gated MLP; the residual
adds ride in the o and down products (`Linear.add_to`); Qwen3's per-head q/k RMSNorm before
RoPE where the weights carry it (`norm_qk_heads`). A layer is `_attention` then `_mlp`,
each reading and returning the residual stream, so a model family's extra step goes in
one place. A sparse layer's MLP is its expert block, routed as transformers routes it
(`route`): softmax of the router's logits in float32, top-k, renormalised where the family
does; its experts run grouped by expert (`linear.Experts`), a gated shared expert beside
them (Qwen2-MoE). With `routes` given, forward appends each sparse layer's expert ids of the
rows that sample: what the engine records per sampled token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from dorarl.engine.model_spec import ModelSpec, MoESpec
from dorarl.engine.weights import ExpertBlock, LayerWeights, ModelWeights


class AttentionBackend(Protocol):
    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
Rotate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # one fused op, bit-equal to the two below
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated, so `rotate` needs no negation per layer."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on `[tokens, heads, dim]` with cos, `signed_sin` `[tokens, 1, dim]`:
    x cos + (-x2, x1) sin, bit for bit, as (x2, x1) (-sin1, sin2)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


class Transformer:
    def __init__(
        self,
        spec: ModelSpec,
        weights: ModelWeights,
        cos: torch.Tensor,
        sin: torch.Tensor,
        norm: Norm = rms_norm,
        rope: Rotate = rotate,
    ) -> None:
        self.spec = spec
        self.weights = weights
        # The residual stream's RMSNorm and q/k RoPE: `rms_norm` and `rotate`, or the fused
        # C++ kernels (cpu_kernels.py) of an engine on the CPU with engine.attention=cpp.
        self.norm, self.rope = norm, rope
        # [max_len, head_dim], on the device, in the model dtype
        self.cos, self.sin_signed = cos, signed_sin(sin)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionBackend,
        sample_rows: torch.Tensor | None = None,
        routes: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits `[rows, vocab]` in float32 for `sample_rows` (all rows when None); with
        `routes`, each sparse layer's expert ids `[sample rows, top_k]` appended to it."""
        w = self.weights
        cos_sin = self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)
        x = F.embedding(input_ids, w.embed)
        for i, layer in enumerate(w.layers):
            x = self._attention(i, layer, x, cos_sin, attention)
            if layer.moe is None:
                x = self._mlp(layer, x)
            else:
                x = self._experts(layer, x, sample_rows, routes)
        if sample_rows is not None:
            x = x.index_select(0, sample_rows)
        return w.lm_head(self.norm(x, w.norm, self.spec.rms_norm_eps)).float()

    def _attention(
        self,
        index: int,
        layer: LayerWeights,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        attention: AttentionBackend,
    ) -> torch.Tensor:
        s = self.spec
        h = self.norm(x, layer.input_norm, s.rms_norm_eps)
        qkv = layer.qkv(h).view(h.shape[0], -1, s.head_dim)
        if layer.q_norm is not None:
            qkv = norm_qk_heads(qkv, layer, s)
        qk = self.rope(qkv[:, : s.num_heads + s.num_kv_heads], *cos_sin)
        q, k = qk[:, : s.num_heads], qk[:, s.num_heads :]
        v = qkv[:, s.num_heads + s.num_kv_heads :]
        return layer.o.add_to(x, attention(index, q, k, v))

    def _mlp(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x, layer.post_norm, self.spec.rms_norm_eps)
        return dense_mlp(layer.gate_up, layer.down, h, x)

    def _experts(
        self,
        layer: LayerWeights,
        x: torch.Tensor,
        sample_rows: torch.Tensor | None,
        routes: list[torch.Tensor] | None,
    ) -> torch.Tensor:
        assert layer.moe is not None and self.spec.moe is not None
        h = self.norm(x, layer.post_norm, self.spec.rms_norm_eps)
        out, experts = expert_block(layer.moe, self.spec.moe, h)
        if routes is not None:
            routes.append(experts if sample_rows is None else experts.index_select(0, sample_rows))
        return x + out


def dense_mlp(gate_up, down, h: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """down(silu(gate(h)) * up(h)), plus `residual` where given."""
    gate, up = gate_up(h).chunk(2, dim=-1)
    if residual is None:
        return down(F.silu(gate) * up)
    return down.add_to(residual, F.silu(gate) * up)


def route(logits: torch.Tensor, moe: MoESpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k weights, expert ids) `[tokens, top_k]` from router logits, as transformers
    computes them: softmax in float32, top-k, renormalised if the family does, the weights
    back in the logits' dtype unless the family keeps them in float32."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, experts = torch.topk(probs, moe.top_k, dim=-1)
    if moe.norm_topk:
        top = top / top.sum(dim=-1, keepdim=True)
    return (top if moe.float_weights else top.to(logits.dtype)), experts


def expert_block(
    block: ExpertBlock, moe: MoESpec, h: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the block's output, the expert ids each token was routed to)."""
    weights, experts = route(block.router(h), moe)
    out = block.experts(h, experts, weights)
    if block.shared_gate is not None:
        shared = dense_mlp(block.shared_gate_up, block.shared_down, h, None)
        out = out + torch.sigmoid(block.shared_gate(h)) * shared
    return out, experts


def norm_qk_heads(qkv: torch.Tensor, layer: LayerWeights, spec: ModelSpec) -> torch.Tensor:
    """`[tokens, q|k|v heads, dim]` with each q head and each k head RMS-normalised over its
    dim (its own weights for q and for k); v is left as it is."""
    q_end = spec.num_heads
    k_end = q_end + spec.num_kv_heads
    q = rms_norm(qkv[:, :q_end], layer.q_norm, spec.rms_norm_eps)
    k = rms_norm(qkv[:, q_end:k_end], layer.k_norm, spec.rms_norm_eps)
    return torch.cat((q, k, qkv[:, k_end:]), dim=1)
