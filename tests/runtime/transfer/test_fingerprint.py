"""Fingerprints see every single changed element, whatever its dtype or place in the tensor,
and every pair of changes tried (sign flips and exponent bits of one row included); they
are a fixed function of the bits, the same on every device and in every chunking."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dorarl.runtime.transfer import fingerprint as module
from dorarl.runtime.transfer.fingerprint import WIDTH, fingerprint, fingerprints

pytestmark = pytest.mark.filterwarnings("error")  # torch's, e.g. an `out=` resized

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]
TRIALS = 600  # per kind of change below: 3000 in all
ROW = 2 * WIDTH  # 32-bit words in a row of 64-bit lanes
_U64 = (1 << 64) - 1


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


def _weights(dtype: torch.dtype, words: int, seed: int) -> torch.Tensor:
    """Weight-like values (normal, std 0.02) filling `words` 32-bit words of `dtype`."""
    numel = words * 4 // torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(numel, generator=gen) * 0.02).to(dtype)
    return torch.randint(0, 100, (numel,), generator=gen).to(dtype)


def _bits(kind: str, words: int, gen: torch.Generator) -> list[int]:
    """The bits (index into the tensor's raw bits, little-endian) one trial flips."""

    def pick(n: int) -> int:
        return int(torch.randint(0, n, (1,), generator=gen))

    row = pick(words // ROW)
    one, other = row * ROW + pick(ROW), row * ROW + pick(ROW - 1)
    other += other >= one  # another word of the same row
    if kind == "sign bits of two words of a row":
        return [32 * one + 31, 32 * other + 31]
    if kind == "exponent bit 30 of two words of a row":
        return [32 * one + 30, 32 * other + 30]
    if kind == "the same bit of one column in two rows":
        bit, column = pick(32), pick(ROW)
        rows = [pick(words // ROW), pick(words // ROW - 1)]
        rows[1] += rows[1] >= rows[0]
        return [32 * (r * ROW + column) + bit for r in rows]
    if kind == "any two bits":
        first, second = pick(32 * words), pick(32 * words - 1)
        return [first, second + (second >= first)]
    return [pick(32 * words)]  # any bit


KINDS = [
    "sign bits of two words of a row",
    "exponent bit 30 of two words of a row",
    "the same bit of one column in two rows",
    "any two bits",
    "any bit",
]


@pytest.mark.parametrize("kind", KINDS)
def test_random_single_and_paired_bit_flips_all_change_the_fingerprint(kind):
    """The reviewer's cases: flipping the sign of two weights of one row, or setting bit 30
    of two small weights (values near 1e36), passed a fingerprint linear in the words."""
    words = 3 * ROW + 6  # three full rows and a short one (whole int64 elements)
    gen = torch.Generator().manual_seed(KINDS.index(kind))
    tensors = {dtype: _weights(dtype, words, seed=7) for dtype in DTYPES}
    before = {dtype: fingerprint(t) for dtype, t in tensors.items()}
    missed = []
    for trial in range(TRIALS):
        dtype = DTYPES[trial % len(DTYPES)]
        changed = tensors[dtype].clone()
        raw = changed.view(torch.uint8)
        bits = _bits(kind, words, gen)
        for bit in bits:
            raw[bit // 8] ^= 1 << (bit % 8)
        if fingerprint(changed) == before[dtype]:
            missed.append((dtype, bits))
    assert not missed, f"{len(missed)} of {TRIALS} changes unseen, e.g. {missed[:3]}"


def test_the_fingerprint_is_of_the_bits_not_the_layout_or_the_call():
    tensor = torch.randn(64, 96)
    assert fingerprint(tensor) == fingerprint(tensor.clone()) == fingerprint(tensor.t().t())
    assert fingerprint(tensor.t()) != fingerprint(tensor)  # other element order: other bits
    strided = torch.randn(WIDTH + 3, 6)[:, ::2]
    assert not strided.is_contiguous() and fingerprint(strided) == fingerprint(strided.clone())
    named = {"a": tensor, "b": tensor.to(torch.bfloat16), "c": torch.zeros(0)}
    assert fingerprints(named) == {name: fingerprint(t) for name, t in named.items()}


def test_a_view_at_an_odd_place_of_a_bucket_is_hashed_as_its_copy():
    bucket = torch.randn(1001).to(torch.bfloat16)  # tensors of any size follow each other
    view = bucket[3:803]
    assert view.storage_offset() * 2 % 8 and fingerprint(view) == fingerprint(view.clone())


def test_the_same_bits_in_any_dtype_give_the_same_fingerprint():
    half = torch.randn(2 * WIDTH + 6).to(torch.bfloat16)
    assert fingerprint(half) == fingerprint(half.view(torch.float16))
    assert fingerprint(half) == fingerprint(half.view(torch.int32)) == fingerprint(half.view(-1, 2))


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(3 * WIDTH + 5, dtype=torch.float32) * 0.37 - 11,
        torch.arange(7, dtype=torch.bfloat16),  # a lane, a 32-bit word and a 16-bit element
        torch.arange(11, dtype=torch.uint8),  # a lane and three bytes, a lane each
        torch.zeros(0),
    ],
    ids=["rows", "bfloat16 tail", "uint8 tail", "empty"],
)
def test_the_value_is_the_documented_formula_in_plain_integers(tensor):
    """The module docstring's h, in Python integers: no device or torch kernel in it, so a
    value equal to it is the value every device gives."""
    assert fingerprint(tensor) & _U64 == _formula(tensor)


def test_the_value_does_not_depend_on_how_many_rows_are_mixed_at_once(monkeypatch):
    tensor = torch.randn(5 * ROW + 17)
    whole = fingerprint(tensor)
    monkeypatch.setattr(module, "cpu_row_sums", lambda: None)  # the torch ops' chunks
    monkeypatch.setattr(module, "CPU_CHUNK_ROWS", 2)
    assert fingerprint(tensor) == whole


needs_cpp = pytest.mark.skipif(
    module.cpu_row_sums() is None, reason="the C++ row sums did not build here"
)


@needs_cpp
def test_the_cpp_row_sums_are_the_torch_ops_sums_bit_for_bit():
    gen = torch.Generator().manual_seed(3)
    lanes = torch.randint(-(2**63), 2**63 - 1, (9, WIDTH), generator=gen, dtype=torch.int64)
    lanes[0] = -(2**63)  # the extremes, where a signed shift or overflow would show
    lanes[1] = 2**63 - 1
    lanes[2] = -1
    offsets = module._column_offsets(torch.device("cpu"))
    want = torch.empty(9, dtype=torch.int64)
    module._chunked_row_sums(lanes, offsets, want)
    assert torch.equal(module.cpu_row_sums()(lanes, offsets), want)


@needs_cpp
@pytest.mark.parametrize("dtype", DTYPES)
def test_fingerprints_with_and_without_the_cpp_row_sums_agree(dtype, monkeypatch):
    tensors = [_weights(dtype, words, seed=words) for words in [1, ROW - 1, ROW, 5 * ROW + 17]]
    with_cpp = [fingerprint(t) for t in tensors]
    monkeypatch.setattr(module, "cpu_row_sums", lambda: None)
    assert [fingerprint(t) for t in tensors] == with_cpp


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_gpu_gives_the_cpus_value(dtype):
    for words in [1, ROW + 3, (module.DEVICE_CHUNK_ROWS + 1) * ROW + 1]:
        tensor = _weights(dtype, words, seed=words)
        assert fingerprint(tensor.cuda()) == fingerprint(tensor)
    odd = torch.randn(2 * WIDTH + 1).to(dtype)
    assert fingerprint(odd.cuda()) == fingerprint(odd)


@pytest.mark.cuda
def test_a_large_gpu_tensor_is_hashed_within_one_chunks_buffer():
    tensor = torch.randn(3 * module.DEVICE_CHUNK_ROWS * ROW + 5, device="cuda")
    fingerprint(tensor[:5])  # the column offsets, once
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fingerprint(tensor)
    buffer = module.DEVICE_CHUNK_ROWS * WIDTH * 8  # a third of the tensor's own bytes
    assert torch.cuda.max_memory_allocated() - before <= buffer + (32 << 20)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swapping_two_elements_changes_the_fingerprint(dtype):
    tensor = torch.randn(2 * WIDTH + 7, generator=torch.Generator().manual_seed(0)).to(dtype)
    tensor[5], tensor[WIDTH + 9] = (
        1.5,
        -0.25,
    )  # two values that differ (random ones may not, in bf16)
    swapped = tensor.clone()
    swapped[[5, WIDTH + 9]] = tensor[[WIDTH + 9, 5]]
    assert fingerprint(swapped) != fingerprint(tensor)


def _formula(tensor: torch.Tensor) -> int:
    raw = bytes(tensor.contiguous().view(torch.uint8).reshape(-1).tolist())
    whole = len(raw) // 8 * 8
    lanes = [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, whole, 8)]
    rest = raw[whole:]
    if len(rest) >= 4:
        lanes.append(int.from_bytes(rest[:4], "little", signed=True))
        rest = rest[4:]
    if rest and tensor.element_size() == 2:
        lanes.append(int.from_bytes(rest, "little", signed=True))
    else:
        lanes += list(rest)
    offsets = module._column_offsets(torch.device("cpu")).tolist()
    h = 0
    for r in range(0, len(lanes), WIDTH):
        s = sum(_mix(y, offsets[j]) for j, y in enumerate(lanes[r : r + WIDTH]))
        h += _splitmix(s + _splitmix((r // WIDTH + 1) * 0x9E3779B97F4A7C15))
    return h & _U64


def _mix(y: int, offset: int) -> int:
    z = (y + offset) & _U64
    z ^= z >> 32
    z = (0xFF51AFD7ED558CCD * z) & _U64
    z ^= z >> 32
    z = (0xC4CEB9FE1A85EC53 * z) & _U64
    return z ^ (z >> 32)


def _splitmix(z: int) -> int:
    z &= _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)
