"""How much host memory a vLLM-CPU engine takes for its KV cache: what our engine's pool
would hold (engine.num_blocks, or max_num_seqs full-length requests) within `HOST_SHARE` of
the memory the process may use, as vLLM-CPU otherwise takes a share of the whole node."""

from __future__ import annotations

from dorarl.config import ConfigError
from dorarl.engine.config import EngineConfig
from dorarl.engine.host_memory import host_memory
from dorarl.engine.memory import DTYPE_BYTES, HOST_SHARE, kv_bytes_per_token, size

MIN_BYTES = 64 << 20  # vLLM-CPU's pool for a few short requests of a tiny model


def model_kv_bytes_per_token(model: dict, dtype: str) -> int:
    """K and V of one token across the layers of a config.json's model, in `dtype`."""
    text = model.get("text_config", model)  # a multimodal config's language model
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    kv_heads = text.get("num_key_value_heads") or heads
    return kv_bytes_per_token(text["num_hidden_layers"], kv_heads, head_dim, DTYPE_BYTES[dtype])


def cpu_kv_bytes(model: dict, config: EngineConfig, dtype: str) -> int:
    """The KV bytes of a vLLM-CPU engine: `config`'s pool in tokens, capped by its share of
    the host; refused in one line naming engine.max_model_len when one request cannot fit."""
    per_token = model_kv_bytes_per_token(model, dtype)
    _, total = host_memory()
    room = int(HOST_SHARE * total)
    wanted = config.kv_blocks * config.block_size * per_token
    needed = config.max_model_len * per_token
    if config.num_blocks is None and needed > room:
        raise ConfigError(
            f"engine.max_model_len: one request of {config.max_model_len} tokens needs "
            f"{size(needed)} of KV, more than the {size(room)} a vLLM-CPU engine takes of this "
            "host (a smaller engine.max_model_len, or engine.num_blocks to set it)"
        )
    return max(MIN_BYTES, wanted if config.num_blocks is not None else min(wanted, room))
