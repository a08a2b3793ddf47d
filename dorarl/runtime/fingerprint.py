"""Fingerprints of weights: one 64-bit integer per tensor, computed where the tensor lives
(on the GPU for GPU tensors) over its raw bits, that any single changed element changes.

The hash of a tensor read as 32-bit words x (its bytes four at a time; a last odd 16-bit
or 8-bit element widened to a word of its own), laid out in rows of `WIDTH` words, is

    h = sum_r R_r * (sum_j x[r, j] * W_j mod 2^32)   mod 2^64

with every W_j (fixed-seed random) and every R_r (a mix of r) odd. Why a single change is
always seen: changing one word by d (0 < |d| < 2^32) changes its row's inner sum by
d * W_j mod 2^32, which is not 0 because W_j is odd and 2^32 does not divide d; that row
sum, an int32, thus changes by some e with 0 < |e| < 2^32, and h by e * R_r mod 2^64, not
0 for the same reason. (An element of 1, 2 or 4 bytes lies inside one word; 8-byte dtypes
span two, whose changes could cancel, at odds of 2^-64.) Integer sums wrap identically on
every device and in any order, so the CPU and the GPU give the same value (unlike a float
reduction). On the CPU the row sums are one int32 matrix-vector product (no temporary).
"""

from __future__ import annotations

import torch

WIDTH = 4096  # words per row
CHUNK_ROWS = 1024  # rows hashed at once: bounds the temporaries at 4 * WIDTH * CHUNK_ROWS bytes
_SEED = 20240531
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64
_MIX = -4658895280553007687  # 0xBF58476D1CE4E5B9 as a signed int64

_COLUMN_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def fingerprint(tensor: torch.Tensor) -> int:
    """The 64-bit fingerprint of `tensor`'s bits (shape and dtype are checked apart)."""
    return int(_hash(_words(tensor)).item())


def fingerprints(named: dict[str, torch.Tensor]) -> dict[str, int]:
    """Every tensor's fingerprint, with one device synchronisation per device."""
    hashes = {name: _hash(_words(t)) for name, t in named.items()}
    by_device: dict[torch.device, list[str]] = {}
    for name, value in hashes.items():
        by_device.setdefault(value.device, []).append(name)
    result: dict[str, int] = {}
    for names in by_device.values():
        values = torch.stack([hashes[n] for n in names]).tolist()
        result.update(zip(names, values, strict=True))
    return {name: result[name] for name in named}


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as a flat int32 tensor: its bytes four at a time, a last
    element of a narrower dtype that does not fill a word widened to one."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    whole = raw.numel() // 4 * 4
    words = raw[:whole].view(torch.int32)
    if whole == raw.numel():
        return words
    rest = raw[whole:]
    if tensor.element_size() == 2:
        rest = rest.view(torch.int16)
    return torch.cat([words, rest.to(torch.int32)])


def _column_weights(device: torch.device) -> torch.Tensor:
    if device not in _COLUMN_WEIGHTS:
        generator = torch.Generator().manual_seed(_SEED)
        weights = torch.randint(-(2**31), 2**31, (WIDTH,), generator=generator, dtype=torch.int64)
        _COLUMN_WEIGHTS[device] = (weights | 1).to(torch.int32).to(device)
    return _COLUMN_WEIGHTS[device]


def _row_weights(first: int, count: int, device: torch.device) -> torch.Tensor:
    """Odd 64-bit multipliers of rows first .. first + count - 1 (wrapping int64 maths)."""
    r = torch.arange(first, first + count, dtype=torch.int64, device=device) + 1
    mixed = r * _GOLDEN
    mixed = (mixed ^ (mixed >> 31)) * _MIX
    return mixed | 1


def _hash(words: torch.Tensor) -> torch.Tensor:
    """h of the module docstring, as a 0-dimensional int64 tensor on the words' device."""
    weights = _column_weights(words.device)
    rows = words.numel() // WIDTH
    sums = [
        _row_sums(words[start * WIDTH : min(rows, start + CHUNK_ROWS) * WIDTH], weights)
        for start in range(0, rows, CHUNK_ROWS)
    ]
    tail = words[rows * WIDTH :]
    if tail.numel():
        sums.append((tail * weights[: tail.numel()]).sum(dtype=torch.int32).reshape(1))
    if not sums:
        return torch.zeros((), dtype=torch.int64, device=words.device)
    row_sums = torch.cat(sums).to(torch.int64)
    return (row_sums * _row_weights(0, row_sums.numel(), words.device)).sum()


def _row_sums(words: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each row's sum of x * W mod 2^32 (int32 arithmetic wraps)."""
    rows = words.view(-1, WIDTH)
    if rows.device.type == "cpu":
        return torch.mv(rows, weights)  # CUDA has no integer matrix-vector product
    return (rows * weights).sum(dim=1, dtype=torch.int32)
