"""The KV budget arithmetic, on given device totals (an H200's 141 GB, a 24 GB card): its
byte counts are the engine's own (a real pool, real packed weights), the pool is what the
share leaves after weights and workspace, and a share that cannot hold one max_model_len
sequence does not fit."""

import pytest
import torch
from engine_testlib import tiny_config
from transformers import Qwen2Config

from dorarl.bench.shapes import SHAPES
from dorarl.engine import EngineConfig
from dorarl.engine.kv_cache import KVCache, KVShape
from dorarl.engine.memory import (
    GB,
    kv_bytes_per_token,
    plan_kv,
    split_partitions,
    weight_bytes,
)
from dorarl.engine.model_spec import spec_from_hf
from dorarl.engine.weights import pack, random_named

H200, CARD_24 = int(141 * GB), int(24 * GB)
QWEN_7B = spec_from_hf(Qwen2Config(**SHAPES["qwen2.5-7b"]))
LONG = dict(device="cuda", max_num_seqs=64, max_model_len=32768, block_size=16)


@pytest.mark.parametrize("variant", [dict(), dict(tie_word_embeddings=True, attention_bias=True)])
def test_the_byte_counts_are_the_engines_own(variant):
    spec = spec_from_hf(tiny_config("qwen3", **variant))
    packed = pack(spec, random_named(spec, 0, 0.02), torch.device("cpu"), torch.bfloat16)
    tensors = {t.data_ptr(): t for t in _tensors(packed)}  # tied: the embedding once
    assert weight_bytes(spec, 2) == sum(t.numel() * t.element_size() for t in tensors.values())
    shape = KVShape(spec.num_layers, spec.num_kv_heads, spec.head_dim, 16)
    pool = KVCache(shape, 3, 0, torch.device("cpu"), torch.bfloat16).pool
    per_token = pool.numel() * pool.element_size() // (3 * 16)
    assert kv_bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim, 2) == per_token


def _tensors(weights):
    yield weights.embed
    yield weights.norm
    yield weights.lm_head.weight
    for layer in weights.layers:
        for part in vars(layer).values():
            if isinstance(part, torch.Tensor):
                yield part
            elif part is not None:
                yield from (t for t in (part.weight, part.bias) if t is not None)


def test_the_pool_is_what_the_share_leaves_after_weights_and_workspace():
    config = EngineConfig(**LONG)
    whole = plan_kv(QWEN_7B, config, 2, True, H200, 0.9)
    third = plan_kv(QWEN_7B, config, 2, True, H200, 0.3333)
    # 64 x 32k tokens would take 120 GB: the share's room decides, in whole blocks
    assert config.kv_blocks * whole.block_bytes > 117 * GB
    for plan in (whole, third):
        used = plan.weight_bytes + plan.workspace.total + plan.blocks * plan.block_bytes
        assert used <= plan.share_bytes < used + plan.block_bytes
        assert plan.fits and plan.blocks < config.kv_blocks
    assert third.blocks < whole.blocks
    assert 14 * GB < whole.weight_bytes < 16 * GB  # 7.6B parameters in bfloat16
    # a short context: max_num_seqs full sequences are all an engine can use
    short = EngineConfig(**{**LONG, "max_model_len": 1024})
    assert plan_kv(QWEN_7B, short, 2, True, H200, 0.9).blocks == short.kv_blocks


def test_free_memory_caps_the_pool_and_an_explicit_num_blocks_wins():
    config = EngineConfig(**LONG)
    free = int(20 * GB)  # another process holds most of the device
    capped = plan_kv(QWEN_7B, config, 2, True, H200, 0.9, free_bytes=free)
    assert capped.blocks * capped.block_bytes + capped.workspace.allocated <= free
    explicit = EngineConfig(**LONG, num_blocks=5000)
    assert plan_kv(QWEN_7B, explicit, 2, True, CARD_24, 0.1).blocks == 5000


def test_a_share_that_cannot_hold_one_sequence_does_not_fit():
    config = EngineConfig(**LONG)
    plan = plan_kv(QWEN_7B, config, 2, True, CARD_24, 0.3333)  # 8 GB for 15 GB of weights
    assert not plan.fits and plan.blocks == 0
    assert plan.shortfall().startswith("0.3333 of 24.0 GB (8.00 GB) cannot hold the weights")
    assert plan_kv(QWEN_7B, config, 2, True, CARD_24, 0.9).fits


def test_split_partials_are_bounded_by_the_pool_not_by_full_tables():
    assert split_partitions(pool_tokens=1000, max_batch=8, table_tokens=2048) == 2 + 8
    assert split_partitions(pool_tokens=10**6, max_batch=8, table_tokens=2048) == 8 * 4
    assert split_partitions(pool_tokens=10**6, max_batch=8, table_tokens=512) == 0  # no split
