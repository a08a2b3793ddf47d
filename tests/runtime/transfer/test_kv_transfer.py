"""Migrated KV over a real gloo group, two ranks in one process (threads): the KV arrives bit
for bit and the request continues with the tokens of a run that never moved, weight and KV transfers of one pair
keep apart on their tags, and a ticket the source no longer holds is refused."""

import threading

import torch
from transformers import LlamaConfig

from dorarl.engine import Engine, EngineConfig, SamplingParams
from dorarl.runtime.transfer import kv_transfer
from dorarl.runtime.transfer.weight_group import KV_TAG, BucketShape

CONFIG = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=128, vocab_size=128)  # fmt: skip
PARAMS = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=24, stop_token_ids=[], seed=7)
PROMPT = [(5 * i + 3) % 128 for i in range(13)]


def _engine(block_size: int = 16) -> Engine:
    config = EngineConfig(max_num_seqs=4, max_model_len=128, block_size=block_size)
    return Engine.from_hf_config(CONFIG, config, seed=3)


def _finish(engine: Engine, request_id: str):
    while True:
        for out in engine.step():
            if out.request_id == request_id:
                return out


def _exported_parcel(held: kv_transfer.HeldKV) -> kv_transfer.KVParcel:
    source = _engine()
    source.add_request("x", PROMPT, PARAMS)
    source.add_request("neighbour", PROMPT[:5], SamplingParams(max_new_tokens=30, seed=1))
    while source.progress("x") < 9:
        source.step()
    return kv_transfer.pack_parcel([source.export_request("x", to_host=False)], held)


def _send_in_thread(target, *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args)
    thread.start()
    return thread


def test_kv_sent_over_the_group_arrives_bit_for_bit_and_the_request_continues(pair):
    sender, receiver = pair
    alone = _engine()
    alone.add_request("x", PROMPT, PARAMS)
    want = _finish(alone, "x")
    held = kv_transfer.HeldKV()
    parcel = _exported_parcel(held)
    assert parcel.snapshots[0].kv is None and parcel.shapes[0][3] == 13 + 9 - 1
    (sent,) = held.get(parcel.ticket)
    buffers = [torch.empty(s, dtype=torch.float32) for s in parcel.kv_shapes]
    thread = _send_in_thread(kv_transfer.send_held, sender, held, parcel.ticket, 1)
    assert receiver.receive(buffers, parcel.ticket, 0, KV_TAG)
    thread.join(timeout=60)
    assert len(held) == 0  # sent whole: the source lets it go
    assert torch.equal(buffers[0], sent)
    destination = _engine(block_size=8)  # another block size: the snapshot layout is neutral
    destination.import_request(parcel.with_kv(buffers)[0])
    got = _finish(destination, "x")
    assert got.output_ids == want.output_ids
    # the same rounding as any migration (tests/engine/test_engine_migration.py)
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs),
                               atol=1e-5, rtol=0)  # fmt: skip
    assert got.migrations == 1


def test_weight_and_kv_transfers_of_one_pair_keep_apart(pair):
    sender, receiver = pair
    held = kv_transfer.HeldKV()
    kv = [torch.randn(2, 2, 2, 21, 16)]
    ticket = held.hold(kv)
    weights = [torch.randn(1000), torch.randn(7)]
    kv_thread = _send_in_thread(kv_transfer.send_held, sender, held, ticket, 1)
    shapes = [BucketShape.of(w) for w in weights]
    weight_thread = _send_in_thread(sender.send, iter(weights), shapes, 5, 1)
    got_weights = [torch.empty_like(w) for w in weights]
    got_kv = [torch.empty_like(kv[0])]
    assert receiver.receive(got_weights, 5, 0)  # the weights first, though sent beside KV
    assert receiver.receive(got_kv, ticket, 0, KV_TAG)
    kv_thread.join(timeout=60)
    weight_thread.join(timeout=60)
    assert all(torch.equal(a, b) for a, b in zip(got_weights + got_kv, weights + kv, strict=True))


def test_a_ticket_no_longer_held_is_refused_and_the_pair_goes_on(pair):
    sender, receiver = pair
    held = kv_transfer.HeldKV()
    ticket = held.hold([torch.randn(2, 2, 2, 3, 16)])
    held.take(ticket)  # taken by a destination outside the group, say
    thread = _send_in_thread(kv_transfer.send_held, sender, held, ticket, 1)
    assert not receiver.receive([torch.empty(2, 2, 2, 3, 16)], ticket, 0, KV_TAG)
    thread.join(timeout=60)
    test_weight_and_kv_transfers_of_one_pair_keep_apart(pair)
