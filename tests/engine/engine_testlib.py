"""Shared helpers for the engine tests: tiny seeded HF models, engines, and run loops."""

from __future__ import annotations

import functools

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from dorarl.engine import Engine, EngineConfig, RequestOutput, SamplingParams

VOCAB = 128

TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=VOCAB,
    max_position_embeddings=1024,
)


FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
    "mixtral": (MixtralConfig, MixtralForCausalLM),
}
MOE_ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral"]
# Qwen3's own default head_dim is 128; 32 here keeps q_size (128) != hidden (64). The MoE
# families: 8 (4) experts of width 32 (Mixtral: intermediate_size), top-2; Qwen3-MoE
# renormalises the top-k weights, Qwen2-MoE does not and adds its gated shared expert, and
# its layer 1 is dense (mlp_only_layers); Mixtral renormalises always.
FAMILY_DEFAULTS = {
    "qwen3": dict(head_dim=32),
    "qwen3_moe": dict(
        head_dim=32, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True,
    ),
    "qwen2_moe": dict(
        moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        shared_expert_intermediate_size=48, mlp_only_layers=[1],
    ),
    "mixtral": dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
}  # fmt: skip


def tiny_config(arch: str, **overrides):
    config_cls, _ = FAMILIES[arch]
    return config_cls(**{**TINY, **FAMILY_DEFAULTS.get(arch, {}), **overrides})


VARIANTS = {
    "qwen2": {},
    "llama": {},
    "llama-tied-bias-llama3rope": dict(
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 50000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen2-linear-rope-headdim": dict(
        head_dim=32, rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}
    ),
    "qwen2-tied": dict(tie_word_embeddings=True),
    "qwen3": {},
    "qwen3-tied-bias-headdim16": dict(tie_word_embeddings=True, attention_bias=True, head_dim=16),
    "qwen3_moe": {},
    "qwen2_moe": {},
    "mixtral": {},
    "mixtral-tied-top1": dict(tie_word_embeddings=True, num_experts_per_tok=1),
}


@functools.cache
def tiny_model(variant: str, seed: int = 0):
    """A random HF model in float32, fixed by `seed` (cached: tests must not modify it)."""
    arch = variant.split("-")[0]
    torch.manual_seed(seed)
    config = tiny_config(arch, **VARIANTS[variant])
    model = FAMILIES[arch][1](config).eval()
    # HF inits biases to zero and Qwen3's q/k norms to one; random ones make those paths
    # count in the parity tests.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.1)
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5)
    return model


def make_engine(model, version: int = 0, **cfg) -> Engine:
    defaults = dict(
        max_num_seqs=8, block_size=4, num_blocks=128, max_model_len=256, prefill_chunk_size=32
    )
    return Engine.from_hf_config(
        model.config, EngineConfig(**{**defaults, **cfg}), model.state_dict(), version
    )


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def run_all(engine: Engine, max_steps: int = 10_000) -> dict[str, RequestOutput]:
    done: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return done
        for out in engine.step():
            done[out.request_id] = out
    raise AssertionError("engine did not finish its requests")


def run_alone(model, prompt: list[int], params: SamplingParams, **cfg) -> RequestOutput:
    engine = make_engine(model, **cfg)
    engine.add_request("alone", prompt, params)
    return run_all(engine)["alone"]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, stop_token_ids=[])


def seeded(n: int, seed: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_new_tokens=n, stop_token_ids=[], seed=seed, **kw)
