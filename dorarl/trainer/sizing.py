"""The automatic micro-batch size: as many tokens as fit an activation-memory budget.

What a decoder layer keeps for backward grows with tokens x (hidden, intermediate) widths:
its norms, q/k/v, attention output and the MLP's gate, up and product. The estimate below
(10 x hidden + 4 x intermediate values per token per layer) is a slight over-count of
a Llama-family layer with fused (flash-style) attention, so the budget holds. With
activation checkpointing a layer keeps only its input (hidden values per token) and one
layer at a time holds the full set again while it is recomputed in backward.
"""

from __future__ import annotations

from transformers import PretrainedConfig

ACTIVATION_BUDGET_BYTES = 2 * 1024**3
MIN_TOKENS, MAX_TOKENS, ROUND_TO = 256, 16384, 256


def activation_bytes_per_token(
    config: PretrainedConfig, dtype_bytes: int, checkpointing: bool = False
) -> int:
    hidden = config.hidden_size
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    layer = (10 * hidden + 4 * intermediate) * dtype_bytes
    if checkpointing:
        return config.num_hidden_layers * hidden * dtype_bytes + layer
    return config.num_hidden_layers * layer


def auto_micro_batch_tokens(
    config: PretrainedConfig,
    dtype_bytes: int,
    budget_bytes: int = ACTIVATION_BUDGET_BYTES,
    checkpointing: bool = False,
) -> int:
    """Tokens per micro-batch whose saved activations fit `budget_bytes`, rounded down to a
    multiple of 256 within [256, 16384] (a larger batch buys a small model nothing)."""
    fits = budget_bytes // activation_bytes_per_token(config, dtype_bytes, checkpointing)
    return max(MIN_TOKENS, min(MAX_TOKENS, fits // ROUND_TO * ROUND_TO))
