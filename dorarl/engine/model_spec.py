"""What the engine needs from a Hugging Face config, checked up front: the dense families
(Llama, Qwen2, Qwen3) and the Mixture-of-Experts ones (Qwen3-MoE, Qwen2-MoE, Mixtral).

`ModelSpec` is the single source of tensor names and shapes: weight loading, weight
updates and `state_dict()` all agree on it. How the families differ is data (`FAMILIES`:
which projections carry biases, whether q and k are normalised per head, and for an MoE
family its `Experts`: where the config keeps the expert count and width, whether the top-k
weights are renormalised, whether a gated shared expert runs beside them, which layers are
sparse), not code paths. Expert tensors are named and shaped as transformers 5 holds them
in memory (`mlp.experts.gate_up_proj` [experts, 2 x width, hidden], `mlp.experts.down_proj`
[experts, hidden, width], the router `mlp.gate.weight`); a checkpoint's own per-expert
layout is converted on reading (weights.py). Unsupported settings raise `UserInputError`
naming the setting (and the file, when the config came from one).
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
class Experts:
    """An MoE family's expert block, as its config and checkpoints describe it."""

    count: str  # the config key of the number of experts
    width: str  # the config key of each expert's intermediate size
    norm_topk: bool | str  # renormalise the top-k probabilities (or the key that says so)
    shared: bool  # a dense shared expert behind a sigmoid gate, added to every token's mix
    every_layer: bool  # all layers sparse; else Qwen's mlp_only_layers / decoder_sparse_step
    float_weights: bool = False  # the top-k weights stay float32 (Mixtral), else model dtype
    # Checkpoint files keep one module per expert: `{block}.experts.{j}.{gate|up|down}.weight`.
    block: str = "mlp"
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Family:
    """A model type's layer layout. A bias is a fixed answer or the config key that gives it."""

    qkv_bias: bool | str
    o_bias: bool | str
    mlp_bias: bool | str
    qk_norm: bool  # RMSNorm over each q and k head (head_dim weights) before RoPE
    experts: Experts | None = None  # an MoE family's expert block


QWEN_EXPERTS = dict(count="num_experts", width="moe_intermediate_size", every_layer=False)
FAMILIES = {
    "llama": Family(
        qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias", qk_norm=False
    ),
    "qwen2": Family(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False),
    "qwen3": Family(
        qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias=False, qk_norm=True
    ),
    "qwen3_moe": Family(
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        mlp_bias=False,
        qk_norm=True,
        experts=Experts(norm_topk="norm_topk_prob", shared=False, **QWEN_EXPERTS),
    ),
    "qwen2_moe": Family(
        qkv_bias="qkv_bias",
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
        experts=Experts(norm_topk="norm_topk_prob", shared=True, **QWEN_EXPERTS),
    ),
    "mixtral": Family(
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
        experts=Experts(
            count="num_local_experts",
            width="intermediate_size",
            norm_topk=True,  # softmax over all, top-k, renormalised: softmax over the top-k
            shared=False,
            every_layer=True,
            float_weights=True,
            block="block_sparse_moe",
            names=("w1", "w3", "w2"),
        ),
    ),
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
# RoPE types whose frequencies depend on the sequence length are not a fixed table.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


@dataclass(frozen=True)
class MoESpec:
    """The expert blocks of an MoE model: which layers have them and their shape."""

    num_experts: int
    top_k: int
    expert_size: int  # each expert's intermediate width
    norm_topk: bool  # the top-k probabilities renormalised to sum to one
    sparse_layers: tuple[int, ...]  # layers with experts; the others have a dense MLP
    shared_expert_size: int = 0  # 0: no shared expert
    float_weights: bool = False  # top-k weights kept in float32 rather than the model dtype

    @property
    def route_width(self) -> int:
        """Expert ids one token's route holds: top_k per sparse layer."""
        return len(self.sparse_layers) * self.top_k


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
    moe: MoESpec | None = None

    def sparse(self, layer: int) -> bool:
        """Whether `layer`'s MLP is an expert block."""
        return self.moe is not None and layer in self.moe.sparse_layers

    @property
    def mlp_width(self) -> int:
        """The widest intermediate activation of one token in any layer's MLP."""
        if self.moe is None:
            return self.intermediate_size
        m = self.moe
        sparse = m.top_k * m.expert_size + m.shared_expert_size
        dense = self.intermediate_size if len(m.sparse_layers) < self.num_layers else 0
        return max(sparse, dense)

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
            shapes.update(self._layer_shapes(f"model.layers.{i}.", self.sparse(i)))
        shapes["model.norm.weight"] = (self.hidden_size,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, self.hidden_size)
        return shapes

    def _layer_shapes(self, prefix: str, sparse: bool) -> dict[str, tuple[int, ...]]:
        h = self.hidden_size
        attn = f"{prefix}self_attn."
        shapes = {
            f"{prefix}input_layernorm.weight": (h,),
            f"{attn}q_proj.weight": (self.q_size, h),
            f"{attn}k_proj.weight": (self.kv_size, h),
            f"{attn}v_proj.weight": (self.kv_size, h),
            f"{attn}o_proj.weight": (h, self.q_size),
            f"{prefix}post_attention_layernorm.weight": (h,),
        }
        if sparse:
            shapes.update(self._expert_shapes(f"{prefix}mlp."))
        else:
            shapes.update(_mlp_shapes(f"{prefix}mlp.", h, self.intermediate_size, self.mlp_bias))
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
        return shapes

    def _expert_shapes(self, mlp: str) -> dict[str, tuple[int, ...]]:
        """The router, the experts as transformers 5 stacks them, and a shared expert."""
        assert self.moe is not None
        h, m = self.hidden_size, self.moe
        shapes = {
            f"{mlp}gate.weight": (m.num_experts, h),
            f"{mlp}experts.gate_up_proj": (m.num_experts, 2 * m.expert_size, h),
            f"{mlp}experts.down_proj": (m.num_experts, h, m.expert_size),
        }
        if m.shared_expert_size:
            shapes.update(_mlp_shapes(f"{mlp}shared_expert.", h, m.shared_expert_size, False))
            shapes[f"{mlp}shared_expert_gate.weight"] = (1, h)
        return shapes

    def num_parameters(self) -> int:
        total = 0
        for shape in self.weight_shapes().values():
            count = 1
            for dim in shape:
                count *= dim
            total += count
        return total


def _mlp_shapes(mlp: str, hidden: int, inter: int, bias: bool) -> dict[str, tuple[int, ...]]:
    shapes = {
        f"{mlp}gate_proj.weight": (inter, hidden),
        f"{mlp}up_proj.weight": (inter, hidden),
        f"{mlp}down_proj.weight": (hidden, inter),
    }
    if bias:
        for name, size in (("gate_proj", inter), ("up_proj", inter), ("down_proj", hidden)):
            shapes[f"{mlp}{name}.bias"] = (size,)
    return shapes


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


def sizing_spec(folder: str | Path) -> ModelSpec:
    """A spec of a model's sizes alone, read from its config.json whatever its family (a
    vLLM run's model this engine does not run): what placement's memory budgets and the
    default learning rate need; no engine is built from it."""
    path = Path(folder) / "config.json"
    raw = json.loads(path.read_text())
    text = raw.get("text_config") or raw
    hidden = _first(text, "hidden_size", "n_embd", "d_model")
    heads = _first(text, "num_attention_heads", "n_head")
    eos = text.get("eos_token_id", raw.get("eos_token_id"))
    return ModelSpec(
        model_type=str(raw.get("model_type")), vocab_size=_first(text, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=text.get("intermediate_size") or text.get("n_inner") or 4 * hidden,
        num_layers=_first(text, "num_hidden_layers", "n_layer"), num_heads=heads,
        num_kv_heads=text.get("num_key_value_heads") or heads,
        head_dim=text.get("head_dim") or hidden // heads,
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=False, o_bias=False, mlp_bias=False,
        max_position_embeddings=text.get("max_position_embeddings") or text.get("n_positions") or 2048,
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
    )  # fmt: skip


def _first(config: dict, *keys: str) -> int:
    """The first of `keys` a config.json has (families name their sizes differently)."""
    for key in keys:
        if config.get(key) is not None:
            return int(config[key])
    raise UserInputError(f"config.json: none of {', '.join(keys)} (the model's sizes)")


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
        moe=_moe_spec(config, family.experts, where) if family.experts else None,
    )


def _moe_spec(config: PretrainedConfig, experts: Experts, where: str) -> MoESpec:
    count, top_k = getattr(config, experts.count), config.num_experts_per_tok
    if not 0 < top_k <= count:
        raise UserInputError(
            f"{where}: num_experts_per_tok must be in [1, {experts.count}={count}], got {top_k}"
        )
    layers = range(config.num_hidden_layers)
    if experts.every_layer:
        sparse = tuple(layers)
    else:
        dense = set(getattr(config, "mlp_only_layers", None) or ())
        step = config.decoder_sparse_step
        sparse = tuple(i for i in layers if i not in dense and (i + 1) % step == 0)
    shared = getattr(config, "shared_expert_intermediate_size", 0) if experts.shared else 0
    return MoESpec(
        num_experts=count,
        top_k=top_k,
        expert_size=getattr(config, experts.width),
        norm_topk=_flag(config, experts.norm_topk),
        sparse_layers=sparse,
        shared_expert_size=shared,
        float_weights=experts.float_weights,
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
    if FAMILIES[config.model_type].experts and getattr(config, "sliding_window", None):
        # Mixtral and Qwen3-MoE mask every layer by the window whenever one is set.
        raise UserInputError(
            f"{where}: sliding_window {config.sliding_window} is not supported (full "
            "attention only)"
        )
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
