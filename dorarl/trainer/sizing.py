"""The automatic micro-batch size: as many tokens as fit an activation-memory budget.

What a decoder layer keeps for backward grows with tokens x (hidden, intermediate) widths:
its norms, q/k/v, attention output and the MLP's gate, up and product. The estimate below
(10 x hidden + 4 x intermediate values per token per layer) is a slight over-count of
a Llama-family layer with fused (flash-style) attention, so the budget holds. Packed rows
(trainer.packing=shared_prompt) pass a mask to attention, which then takes keys and values
repeated to every query head (grouped-query attention is not used with a mask), and keeps
those copies: 2 x (heads - kv_heads) x head_dim more per token.
"""

from __future__ import annotations

from transformers import PretrainedConfig

ACTIVATION_BUDGET_BYTES = 2 * 1024**3
MIN_TOKENS, MAX_TOKENS, ROUND_TO = 256, 16384, 256


def activation_bytes_per_token(
    config: PretrainedConfig, dtype_bytes: int, packed: bool = False
) -> int:
    hidden = config.hidden_size
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    values = 10 * hidden + 4 * intermediate + (_repeated_kv(config) if packed else 0)
    return config.num_hidden_layers * values * dtype_bytes


def _repeated_kv(config: PretrainedConfig) -> int:
    heads = getattr(config, "num_attention_heads", None) or 1
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * (heads - kv_heads) * head_dim


def auto_micro_batch_tokens(
    config: PretrainedConfig,
    dtype_bytes: int,
    budget_bytes: int = ACTIVATION_BUDGET_BYTES,
    packed: bool = False,
) -> int:
    """Tokens per micro-batch whose saved activations fit `budget_bytes`, rounded down to a
    multiple of 256 within [256, 16384] (a larger batch buys a small model nothing)."""
    fits = budget_bytes // activation_bytes_per_token(config, dtype_bytes, packed)
    return max(MIN_TOKENS, min(MAX_TOKENS, fits // ROUND_TO * ROUND_TO))
