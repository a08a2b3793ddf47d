"""Fingerprints see every single changed element, whatever its dtype or place in the tensor."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dorarl.runtime.fingerprint import WIDTH, fingerprint, fingerprints

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    numel=st.sampled_from([1, 3, WIDTH - 1, WIDTH, WIDTH + 1, 3 * WIDTH + 5]),
    where=st.floats(0, 1, exclude_max=True),
    bit=st.integers(0, 7),
    byte=st.integers(0, 7),
)
def test_flipping_any_one_bit_changes_the_fingerprint(dtype, numel, where, bit, byte):
    tensor = (torch.arange(numel, dtype=torch.float64) * 0.37).to(dtype)
    before = fingerprint(tensor)
    raw = tensor.view(torch.uint8).reshape(-1)
    index = int(where * numel) * tensor.element_size() + byte % tensor.element_size()
    raw[index] ^= 1 << bit
    assert fingerprint(tensor) != before


def test_the_fingerprint_is_of_the_bits_not_the_layout_or_the_call():
    tensor = torch.randn(64, 96)
    assert fingerprint(tensor) == fingerprint(tensor.clone()) == fingerprint(tensor.t().t())
    assert fingerprint(tensor.t()) != fingerprint(tensor)  # other element order: other bits
    named = {"a": tensor, "b": tensor.to(torch.bfloat16), "c": torch.zeros(0)}
    assert fingerprints(named) == {name: fingerprint(t) for name, t in named.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swapping_two_elements_changes_the_fingerprint(dtype):
    tensor = torch.randn(2 * WIDTH + 7).to(dtype)
    swapped = tensor.clone()
    swapped[[5, WIDTH + 9]] = tensor[[WIDTH + 9, 5]]
    assert fingerprint(swapped) != fingerprint(tensor)
