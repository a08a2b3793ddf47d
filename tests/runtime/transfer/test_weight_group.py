"""The weight-transfer group over gloo, two ranks in one process (threads): buckets arrive
bit for bit, a refusal is told, bytes changed on the way are caught by the fingerprints, and a
sender that fails mid-transfer ends the receive at once."""

import threading
import time

import pytest
import torch

from dorarl.runtime.transfer.weight_endpoints import layout, send_hosted
from dorarl.runtime.transfer.weight_layout import (
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
    served, got = _transfer(pair, manifest, lambda g: g.send(sent, layout(manifest), 3, dst=1))
    assert served and all(
        torch.equal(a.view(torch.int16), b.view(torch.int16))
        for a, b in zip(got, sent, strict=True)
    )
    manifest.verify(unflatten(got, manifest), 3, "instance 0")


def test_a_refusal_is_told_and_the_group_goes_on(pair):
    _, manifest, sent = _version(4)
    served, _ = _transfer(pair, manifest, lambda g: g.refuse(4, dst=1))
    assert not served
    served, _ = _transfer(pair, manifest, lambda g: g.send(sent, layout(manifest), 4, dst=1))
    assert served


def test_a_bucket_changed_on_the_way_is_refused_by_the_fingerprint(pair):
    _, manifest, sent = _version(5)
    corrupted = [b.clone() for b in sent]
    corrupted[1].view(torch.int16)[-1] ^= 1  # the last bit of the bias
    served, got = _transfer(pair, manifest, lambda g: g.send(corrupted, layout(manifest), 5, dst=1))
    assert served
    with pytest.raises(WeightsRefused, match=r"tensor 'b' \(bucket 1 of 2\) has fingerprint"):
        manifest.verify(unflatten(got, manifest), 5, "instance 1")


def _failing_send(manifest, sent, failed: list):
    def send(group):
        def made():
            yield sent[0]
            raise MemoryError("no room for bucket 1")

        try:
            group.send(made(), layout(manifest), manifest.version, dst=1)
        except MemoryError as exc:
            failed.append(exc)

    return send


def test_a_sender_that_fails_after_its_header_ends_the_receive_at_once(pair):
    """The pair's timeout is 30 s here: a receive left waiting for the bucket the sender
    never made would last that long, then close the pair."""
    _, manifest, sent = _version(6)
    failed: list[Exception] = []
    started = time.perf_counter()
    served, _ = _transfer(pair, manifest, _failing_send(manifest, sent, failed))
    assert time.perf_counter() - started < 5.0
    assert served and [str(e) for e in failed] == ["no room for bucket 1"]
    _, manifest, sent = _version(7)  # the pair is still in step
    served, got = _transfer(pair, manifest, lambda g: g.send(sent, layout(manifest), 7, dst=1))
    assert served
    manifest.verify(unflatten(got, manifest), 7, "instance 1")


def test_a_peer_without_a_tensor_of_the_manifest_refuses_and_says_which(pair):
    wire, manifest, _ = _version(8)
    hosted = {name: t for name, t in wire.items() if name != "b"}
    failed: list[Exception] = []

    def send(group):
        try:
            send_hosted(group, hosted, manifest, dst=1)
        except WeightsRefused as exc:
            failed.append(exc)

    served, _ = _transfer(pair, manifest, send)
    assert not served
    assert [str(e) for e in failed] == [
        "version 8 as hosted here has no b (1 of the manifest's 3 tensors)"
    ]
