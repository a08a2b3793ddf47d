"""The automatic micro-batch: sized from the model's shape to an activation budget."""

from transformers import LlamaConfig

from dorarl.trainer.sizing import (
    MAX_TOKENS,
    MIN_TOKENS,
    activation_bytes_per_token,
    auto_micro_batch_tokens,
)


def _smollm2_shape() -> LlamaConfig:
    return LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, vocab_size=49152
    )


def test_a_135m_llama_gets_a_budget_that_fits_a_small_machine():
    tokens = auto_micro_batch_tokens(_smollm2_shape(), dtype_bytes=4)
    assert tokens % 256 == 0
    assert tokens * activation_bytes_per_token(_smollm2_shape(), 4) <= 2 * 1024**3
    assert 1024 <= tokens <= 2048
    assert auto_micro_batch_tokens(_smollm2_shape(), dtype_bytes=2) >= 2 * tokens - 256


def test_tiny_and_huge_models_are_clamped():
    tiny = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    huge = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80)
    assert auto_micro_batch_tokens(tiny, 4) == MAX_TOKENS
    assert auto_micro_batch_tokens(huge, 2) == MIN_TOKENS


def test_packed_rows_count_the_keys_and_values_repeated_for_the_mask():
    gqa = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3)  # fmt: skip
    extra = 30 * 2 * (9 - 3) * 64 * 4
    padded = activation_bytes_per_token(gqa, 4)
    assert activation_bytes_per_token(gqa, 4, packed=True) == padded + extra
    budget = padded * 1280  # padded rows: 1280 tokens fit exactly; packed ones: fewer
    assert auto_micro_batch_tokens(gqa, 4, budget) == 1280
    assert auto_micro_batch_tokens(gqa, 4, budget, packed=True) == 1024
    mha = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=9)  # fmt: skip
    assert activation_bytes_per_token(mha, 4, packed=True) == activation_bytes_per_token(mha, 4)
