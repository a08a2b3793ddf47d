"""What the engine needs from a Hugging Face config (Llama, Qwen2, Qwen3), checked up front.

`ModelSpec` is the single source of tensor names and shapes: weight loading, weight
updates and `state_dict()` all agree on it. How the families differ is data (`FAMILIES`:
which projections carry biases, whether q and k are normalised per head), not code paths.
Unsupported settings raise `UserInputError` naming the setting (and the file, when the
config came from one).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from dorarl.errors import UserInputError


@dataclass(frozen=True)
class Family:
    """A model type's layer layout. A bias is a fixed answer or the config key that gives it."""

    qkv_bias: bool | str
    o_bias: bool | str
    mlp_bias: bool | str
    qk_norm: bool  # RMSNorm over each q and k head (head_dim weights) before RoPE


FAMILIES = {
    "llama": Family(
        qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias", qk_norm=False
    ),
    "qwen2": Family(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False),
    "qwen3": Family(
        qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias=False, qk_norm=True
    ),
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
# RoPE types whose frequencies depend on the sequence length are not a fixed table.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    qk_norm: bool = False

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the model by its Hugging Face state-dict name."""
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (self.vocab_size, self.hidden_size)
        }
        for i in range(self.num_layers):
            shapes.update(self._layer_shapes(f"model.layers.{i}."))
        shapes["model.norm.weight"] = (self.hidden_size,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, self.hidden_size)
        return shapes

    def _layer_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h, inter = self.hidden_size, self.intermediate_size
        attn = f"{prefix}self_attn."
        mlp = f"{prefix}mlp."
        shapes = {
            f"{prefix}input_layernorm.weight": (h,),
            f"{attn}q_proj.weight": (self.q_size, h),
            f"{attn}k_proj.weight": (self.kv_size, h),
            f"{attn}v_proj.weight": (self.kv_size, h),
            f"{attn}o_proj.weight": (h, self.q_size),
            f"{prefix}post_attention_layernorm.weight": (h,),
            f"{mlp}gate_proj.weight": (inter, h),
            f"{mlp}up_proj.weight": (inter, h),
            f"{mlp}down_proj.weight": (h, inter),
        }
        if self.qkv_bias:
            shapes.update(
                {f"{attn}q_proj.bias": (self.q_size,), f"{attn}k_proj.bias": (self.kv_size,)}
            )
            shapes[f"{attn}v_proj.bias"] = (self.kv_size,)
        if self.o_bias:
            shapes[f"{attn}o_proj.bias"] = (h,)
        if self.qk_norm:
            shapes[f"{attn}q_norm.weight"] = (self.head_dim,)
            shapes[f"{attn}k_norm.weight"] = (self.head_dim,)
        if self.mlp_bias:
            for name, size in (("gate_proj", inter), ("up_proj", inter), ("down_proj", h)):
                shapes[f"{mlp}{name}.bias"] = (size,)
        return shapes

    def num_parameters(self) -> int:
        total = 0
        for shape in self.weight_shapes().values():
            count = 1
            for dim in shape:
                count *= dim
            total += count
        return total


def read_hf_config(folder: str | Path) -> PretrainedConfig:
    """Load config.json of a local model folder, refusing unsupported architectures by name."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise UserInputError(f"{path}: no config.json in the model folder")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserInputError(f"{path}: not valid JSON ({exc})") from exc
    check_model_type(raw.get("model_type"), str(path))
    return AutoConfig.from_pretrained(str(folder))


def check_model_type(model_type: Any, where: str) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UserInputError(
            f"{where}: model_type {model_type!r} is not supported by the engine "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )


def spec_from_hf(config: PretrainedConfig, where: str = "hf_config") -> ModelSpec:
    check_model_type(getattr(config, "model_type", None), where)
    _check_supported(config, where)
    heads = config.num_attention_heads
    family = FAMILIES[config.model_type]
    eos = config.eos_token_id
    return ModelSpec(
        model_type=config.model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=_flag(config, family.qkv_bias),
        o_bias=_flag(config, family.o_bias),
        mlp_bias=_flag(config, family.mlp_bias),
        max_position_embeddings=config.max_position_embeddings,
        eos_token_ids=tuple(eos)
        if isinstance(eos, list | tuple)
        else (() if eos is None else (eos,)),
        qk_norm=family.qk_norm,
    )


def _flag(config: PretrainedConfig, rule: bool | str) -> bool:
    return rule if isinstance(rule, bool) else bool(getattr(config, rule, False))


def _check_supported(config: PretrainedConfig, where: str) -> None:
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UserInputError(
            f"{where}: hidden_act {config.hidden_act!r} is not supported (silu only)"
        )
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        raise UserInputError(f"{where}: sliding-window attention layers are not supported")
    rope_type = _rope_parameters(config).get("rope_type", "default")
    if rope_type in _LENGTH_DEPENDENT_ROPE or (
        rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS
    ):
        raise UserInputError(f"{where}: rope_type {rope_type!r} is not supported by the engine")
    if config.num_attention_heads % (getattr(config, "num_key_value_heads", None) or 1):
        raise UserInputError(
            f"{where}: num_attention_heads must be a multiple of num_key_value_heads"
        )


def _rope_parameters(config: PretrainedConfig) -> dict[str, Any]:
    return dict(getattr(config, "rope_parameters", None) or {})


def rope_tables(
    config: PretrainedConfig, spec: ModelSpec, max_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[max_len, head_dim]` in float32, computed as Hugging Face computes them."""
    params = _rope_parameters(config)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = spec.head_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        scaling = 1.0
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    freqs = torch.arange(max_len, dtype=torch.int64).float()[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling
