"""A version on the wire: buckets of one dtype within the size, aliases sent once, the bits
back exactly, and a receiver that refuses any tensor unlike the sender's manifest."""

import pytest
import torch

from dorarl.runtime.transfer.weight_layout import (
    WeightsRefused,
    allocate,
    build_manifest,
    flatten,
    unflatten,
    wire_tensors,
)


def _named() -> dict[str, torch.Tensor]:
    embed = torch.randn(100, 16)
    return {
        "embed.weight": embed,
        "layer.q.weight": torch.randn(16, 16),
        "layer.q.bias": torch.randn(16),
        "layer.norm.weight": torch.randn(16),
        "steps": torch.tensor([3], dtype=torch.int64),
        "lm_head.weight": embed,  # tied: an alias of the embedding
    }


def _sent(dtype=torch.bfloat16, bucket_bytes=1200):
    wire = wire_tensors(_named(), dtype)
    manifest = build_manifest(wire, version=7, bucket_bytes=bucket_bytes)
    buckets = [flatten(wire, manifest, i) for i in range(len(manifest.buckets))]
    return wire, manifest, buckets


def test_buckets_keep_one_dtype_and_the_size_and_tied_weights_go_once():
    wire, manifest, _ = _sent()
    assert "lm_head.weight" not in wire and [e.name for e in manifest.tensors] == list(wire)
    assert wire["layer.q.weight"].dtype == torch.bfloat16 and wire["steps"].dtype == torch.int64
    for index, bucket in enumerate(manifest.buckets):
        members = list(manifest.in_bucket(index))
        assert {str(wire[e.name].dtype).removeprefix("torch.") for e in members} == {bucket.dtype}
        assert bucket.nbytes <= 1200 or len(members) == 1  # a larger tensor: a bucket alone
    assert manifest.buckets[0].nbytes == 100 * 16 * 2  # the embedding, alone
    assert manifest.nbytes == sum(t.numel() * t.element_size() for t in wire.values())


def test_received_buckets_give_the_senders_bits_and_pass_its_check():
    wire, manifest, buckets = _sent()
    received = allocate(manifest, "cpu")
    for target, bucket in zip(received, buckets, strict=True):
        target.copy_(bucket)
    named = unflatten(received, manifest)
    assert all(torch.equal(named[n].view(torch.uint8), wire[n].view(torch.uint8)) for n in wire)
    manifest.verify(named, 7, "instance 0")


def test_a_corrupted_bucket_is_refused_naming_the_tensor_and_its_bucket():
    _, manifest, buckets = _sent()
    buckets[1].view(torch.uint8)[3] ^= 0x10  # one bit, in transit
    with pytest.raises(WeightsRefused) as refused:
        manifest.verify(unflatten(buckets, manifest), 7, "instance 2")
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("weights of version 7 refused on instance 2: tensor 'layer.q.weight'")
    assert f"(bucket 1 of {len(manifest.buckets)})" in message


def test_two_sign_flips_in_one_tensor_are_refused():
    """Negating two bfloat16 weights of one row (bit 31 of two 32-bit words)."""
    _, manifest, buckets = _sent()
    raw = buckets[1].view(torch.uint8)  # layer.q.weight, bfloat16: bytes 3 and 7 hold signs
    raw[[3, 7]] ^= 0x80
    with pytest.raises(WeightsRefused, match="tensor 'layer.q.weight'"):
        manifest.verify(unflatten(buckets, manifest), 7, "instance 2")


def test_a_wrong_version_shape_or_dtype_or_a_missing_tensor_is_refused():
    wire, manifest, _ = _sent()
    with pytest.raises(WeightsRefused, match="manifest is of version 7"):
        manifest.verify(wire, 8, "instance 0")
    with pytest.raises(WeightsRefused, match="'layer.q.bias' .* is missing"):
        manifest.verify({k: v for k, v in wire.items() if k != "layer.q.bias"}, 7, "instance 0")
    with pytest.raises(WeightsRefused, match="'layer.q.bias' .* torch.float32, the sender's"):
        manifest.verify(dict(wire, **{"layer.q.bias": wire["layer.q.bias"].float()}), 7, "i")
