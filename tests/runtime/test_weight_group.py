"""The weight-transfer group over gloo, two ranks in one process (threads): buckets arrive
bit for bit, a refusal is told, and bytes changed on the way are caught by the fingerprints."""

import threading

import pytest
import torch

from dorarl.runtime.weight_layout import (
    WeightsRefused,
    allocate,
    build_manifest,
    flatten,
    unflatten,
    wire_tensors,
)


def _version(version: int):
    named = {"embed": torch.randn(300, 8), "w": torch.randn(8, 8), "b": torch.randn(8)}
    wire = wire_tensors(named, torch.bfloat16)
    manifest = build_manifest(wire, version, bucket_bytes=4096)
    return wire, manifest, [flatten(wire, manifest, i) for i in range(len(manifest.buckets))]


def _transfer(pair, manifest, send):
    sender, receiver = pair
    buckets = allocate(manifest, "cpu")
    thread = threading.Thread(target=send, args=(sender,))
    thread.start()
    served = receiver.receive(buckets, manifest.version, src=0)
    thread.join(timeout=60)
    return served, buckets


def test_buckets_arrive_bit_for_bit_and_pass_the_check(pair):
    wire, manifest, sent = _version(3)
    assert len(sent) == 2  # the embedding alone, then the rest
    served, got = _transfer(pair, manifest, lambda g: g.send(iter(sent), len(sent), 3, dst=1))
    assert served and all(
        torch.equal(a.view(torch.int16), b.view(torch.int16))
        for a, b in zip(got, sent, strict=True)
    )
    manifest.verify(unflatten(got, manifest), 3, "instance 0")


def test_a_refusal_is_told_and_the_group_goes_on(pair):
    _, manifest, sent = _version(4)
    served, _ = _transfer(pair, manifest, lambda g: g.refuse(4, dst=1))
    assert not served
    served, _ = _transfer(pair, manifest, lambda g: g.send(iter(sent), len(sent), 4, dst=1))
    assert served


def test_a_bucket_changed_on_the_way_is_refused_by_the_fingerprint(pair):
    _, manifest, sent = _version(5)
    corrupted = [b.clone() for b in sent]
    corrupted[1].view(torch.int16)[-1] ^= 1  # the last bit of the bias
    served, got = _transfer(pair, manifest, lambda g: g.send(iter(corrupted), 2, 5, dst=1))
    assert served
    with pytest.raises(WeightsRefused, match=r"tensor 'b' \(bucket 1 of 2\) has fingerprint"):
        manifest.verify(unflatten(got, manifest), 5, "instance 1")
