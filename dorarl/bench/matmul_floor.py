"""The floor of a training step: its own matrix multiplications, timed alone on their shapes.

For a Llama-family decoder (Llama, Qwen2, Mistral: q/k/v/o, gate/up/down, an output layer)
and the micro-batches of one step: every linear layer's forward, input-gradient and
weight-gradient products, the attention score and value products with their backward, and
the output layer on the response tokens only (what the step needs; recomputation is
overhead, not floor). Each distinct shape is timed once per repeat (best of the repeats)
and multiplied by how often the step runs it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from dorarl.bench.clock import timed


@dataclass(frozen=True)
class MicroShape:
    rows: int
    width: int
    response_tokens: int


@dataclass(frozen=True)
class LinearShape:
    tokens: int
    fan_in: int
    fan_out: int


@dataclass(frozen=True)
class AttentionShape:
    batch: int  # rows x heads
    width: int
    head_dim: int


def step_shapes(
    config: PretrainedConfig, micro: list[MicroShape]
) -> tuple[Counter[LinearShape], Counter[AttentionShape]]:
    """How often a step runs each linear and attention shape (forward + backward)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    layer = [
        (hidden, heads * head_dim),  # q
        (hidden, kv_heads * head_dim),  # k
        (hidden, kv_heads * head_dim),  # v
        (heads * head_dim, hidden),  # o
        (hidden, inter),  # gate
        (hidden, inter),  # up
        (inter, hidden),  # down
    ]
    linears: Counter[LinearShape] = Counter()
    attention: Counter[AttentionShape] = Counter()
    for mb in micro:
        tokens = mb.rows * mb.width
        for fan_in, fan_out in layer:
            linears[LinearShape(tokens, fan_in, fan_out)] += config.num_hidden_layers
        attention[AttentionShape(mb.rows * heads, mb.width, head_dim)] += config.num_hidden_layers
        if mb.response_tokens:
            linears[LinearShape(mb.response_tokens, hidden, config.vocab_size)] += 1
    return linears, attention


def _best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm up: first-call allocation and kernel selection
    return 1e3 * min(timed(fn)[1].wall_s for _ in range(repeats))


def linear_ms(shape: LinearShape, repeats: int, dtype: torch.dtype = torch.float32) -> float:
    """Forward y = x W^T, input gradient dy W, weight gradient dy^T x."""
    x = torch.randn(shape.tokens, shape.fan_in, dtype=dtype)
    w = torch.randn(shape.fan_out, shape.fan_in, dtype=dtype)
    dy = torch.randn(shape.tokens, shape.fan_out, dtype=dtype)

    def run() -> None:
        F.linear(x, w)
        torch.mm(dy, w)
        torch.mm(dy.t(), x)

    return _best_ms(run, repeats)


def attention_ms(shape: AttentionShape, repeats: int, dtype: torch.dtype = torch.float32) -> float:
    """Scores q k^T and output p v, and the four products of their backward."""
    q, k, v, do = (
        torch.randn(shape.batch, shape.width, shape.head_dim, dtype=dtype) for _ in range(4)
    )
    p = torch.randn(shape.batch, shape.width, shape.width, dtype=dtype)

    def run() -> None:
        torch.bmm(q, k.transpose(1, 2))  # scores
        torch.bmm(p, v)  # output
        torch.bmm(do, v.transpose(1, 2))  # d probs
        torch.bmm(p.transpose(1, 2), do)  # d v
        torch.bmm(p, k)  # d q (p stands in for d scores: same shape)
        torch.bmm(p.transpose(1, 2), q)  # d k

    return _best_ms(run, repeats)


def floor_ms(
    config: PretrainedConfig,
    micro: list[MicroShape],
    repeats: int = 3,
    body_dtype: torch.dtype = torch.float32,
) -> dict[str, float]:
    """Milliseconds of the step's matrix multiplications: linear layers, attention, output.

    The decoder's products run in `body_dtype` (bfloat16 under trainer.autocast=bf16), the
    output layer's in float32 as the trainer's do in either case."""
    linears, attention = step_shapes(config, micro)
    body = head = 0.0
    for shape, count in linears.items():
        if shape.fan_out == config.vocab_size:
            head += linear_ms(shape, repeats) * count
        else:
            body += linear_ms(shape, repeats, body_dtype) * count
    attn = sum(
        attention_ms(shape, repeats, body_dtype) * count for shape, count in attention.items()
    )
    return {"total": body + attn + head, "linear": body, "attention": attn, "output_layer": head}
