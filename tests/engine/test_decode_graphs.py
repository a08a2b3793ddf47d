"""The decode graph runner: buckets, padding into a scratch block, static buffers refilled each
step, weights copied in place. Eager over the static buffers here; `cuda` tests capture."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from triton_testlib import DEVICE

from dorarl.engine.attention import SeqRows
from dorarl.engine.decode_graphs import DecodeGraphs, default_buckets, load_weights_in_place
from dorarl.engine.kv_cache import KVCache, KVShape
from dorarl.engine.model import Transformer
from dorarl.engine.model_spec import rope_tables, spec_from_hf
from dorarl.engine.triton_attention import TritonPagedAttention, plan_paged_step
from dorarl.engine.weights import pack, random_named

BLOCK = 16
CONFIG = LlamaConfig(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=96,
    max_position_embeddings=256,
)
SPEC = spec_from_hf(CONFIG)


def _model(seed: int = 0, dtype=torch.float32) -> Transformer:
    weights = pack(SPEC, random_named(SPEC, seed, std=0.2), DEVICE, dtype)
    cos, sin = rope_tables(CONFIG, SPEC, 256)
    return Transformer(SPEC, weights, cos.to(DEVICE, dtype), sin.to(DEVICE, dtype))


def _pool(num_blocks: int, dtype=torch.float32, seed: int = 0) -> KVCache:
    shape = KVShape(SPEC.num_layers, SPEC.num_kv_heads, SPEC.head_dim, BLOCK)
    cache = KVCache(shape, num_blocks, 0, DEVICE, dtype)
    gen = torch.Generator().manual_seed(seed)
    cache.pool.copy_(torch.randn(cache.pool.shape, generator=gen))
    return cache


def _rows(contexts: list[int], num_blocks: int, seed: int = 1) -> list[SeqRows]:
    """Decode rows (new token at position context - 1) over scattered blocks < num_blocks."""
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    rows, at = [], 0
    for c in contexts:
        n = -(-c // BLOCK)
        rows.append(SeqRows(order[at : at + n], c - 1, 1))
        at += n
    assert at <= num_blocks, "not enough blocks for these contexts"
    return rows


def _forward(model: Transformer):
    return lambda ids, positions, attention: model.forward(ids, positions, attention)


def _eager_step(model, cache, ids, rows) -> torch.Tensor:
    group = SPEC.num_heads // SPEC.num_kv_heads
    step = plan_paged_step(rows, len(rows), SPEC.num_kv_heads, group, BLOCK, DEVICE)
    ids_t = torch.tensor(ids, device=DEVICE)
    pos = torch.tensor([r.start for r in rows], device=DEVICE)
    return model.forward(ids_t, pos, TritonPagedAttention(cache, step))


def _clone(cache: KVCache) -> KVCache:
    other = KVCache(cache.shape, cache.pool.shape[2], 0, DEVICE, cache.dtype)
    other.pool.copy_(cache.pool)
    return other


def test_buckets_cover_every_batch_up_to_the_max():
    assert default_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert default_buckets(5) == [1, 2, 4, 5]
    graphs = DecodeGraphs(lambda *a: None, _pool(4), 20, 4, 3, graphs=False)
    assert [graphs.bucket_for(n) for n in (1, 3, 8, 9, 20)] == [1, 4, 8, 16, 20]
    with pytest.raises(ValueError, match="max_batch=20"):
        graphs.bucket_for(21)


def test_a_padded_bucket_gives_the_unpadded_steps_logits_and_writes_only_scratch():
    model, blocks = _model(), 24  # blocks 0..22 for sequences, 23 the scratch block
    cache = _pool(blocks)
    graphs = DecodeGraphs(_forward(model), cache, 8, 6, blocks - 1, buckets=[2, 8], graphs=False)
    reference = _clone(cache)
    written = torch.zeros(blocks - 1, BLOCK, dtype=torch.bool)  # the steps' new tokens so far
    for contexts, seed in (([5, 17, 40, 33, 64], 1), ([80, 2], 2)):  # buckets 8 (3 pads), 2
        rows = _rows(contexts, blocks - 1, seed)
        ids = [(7 * i + seed) % SPEC.vocab_size for i in range(len(rows))]
        logits = graphs.run(ids, rows)
        expected = _eager_step(model, reference, ids, rows)
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
        for row in rows:
            written[row.table[row.start // BLOCK], row.start % BLOCK] = True
        _assert_only_the_rows_wrote(cache, reference, written)


def _assert_only_the_rows_wrote(cache, reference, written: torch.Tensor) -> None:
    """Every cell of the sequences' blocks but the steps' own new tokens (`written`: block,
    slot) is bit-identical to the unpadded steps' pool (the pads wrote only the scratch
    block); the new tokens' K/V are within the logits' tolerance (in Triton's interpreter,
    layer 1's K/V follow layer 0's attention, whose float32 sums numpy may order by the
    batch's shape)."""
    blocks = written.shape[0]
    got, want = cache.pool[:, :, :blocks], reference.pool[:, :, :blocks]
    mask = written[None, None, :, None, :, None].expand_as(got)
    assert torch.equal(got[~mask], want[~mask]), "a pad wrote into a sequence's block"
    torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-5)


def test_weights_copied_in_place_keep_their_storage_and_reach_the_next_step():
    model, new = _model(seed=0), _model(seed=5)
    before = model.weights.layers[0].qkv.weight.data_ptr()
    cache = _pool(10)
    graphs = DecodeGraphs(_forward(model), cache, 4, 4, 9, graphs=False)
    rows = _rows([20, 3], 9)
    load_weights_in_place(model.weights, new.weights)
    assert model.weights.layers[0].qkv.weight.data_ptr() == before
    assert torch.equal(model.weights.layers[1].down.weight, new.weights.layers[1].down.weight)
    logits = graphs.run([1, 2], rows)
    torch.testing.assert_close(logits, _eager_step(new, _clone(cache), [1, 2], rows))


def test_mismatched_weights_are_refused_before_anything_is_copied():
    model = _model()
    wrong = _model(seed=3, dtype=torch.float16)
    before = model.weights.embed.clone()
    with pytest.raises(ValueError, match="weights differ"):
        load_weights_in_place(model.weights, wrong.weights)
    assert torch.equal(model.weights.embed, before)


@pytest.mark.cuda
def test_captured_graphs_replay_the_eager_step_and_follow_weights_loaded_in_place():
    model, blocks = _model(dtype=torch.bfloat16), 160
    cache = _pool(blocks, torch.bfloat16)
    graphs = DecodeGraphs(_forward(model), cache, 16, 8, blocks - 1)
    graphs.capture()
    assert sorted(graphs.graphs) == graphs.buckets
    reference = _clone(cache)
    for step, contexts in enumerate(([5, 17, 40], [100, 3, 64, 77, 9], [120] * 16)):
        if step == 2:
            new = _model(seed=7, dtype=torch.bfloat16)
            load_weights_in_place(model.weights, new.weights)
        rows = _rows(contexts, blocks - 1, seed=step)
        ids = list(range(len(rows)))
        torch.testing.assert_close(
            graphs.run(ids, rows), _eager_step(model, reference, ids, rows), atol=2e-2, rtol=2e-2
        )
