"""Fingerprints of weights: one 64-bit integer per tensor, computed where the tensor lives
(on the GPU for GPU tensors) over its raw bits, that any change of them changes (within
8 aligned bytes: always; elsewhere too: but at odds of about 2^-64). It catches
corruption, not an adversary.

The tensor is read as 64-bit lanes y: its bytes eight at a time (little-endian), then
what is left: a 32-bit word, then 16-bit or 8-bit elements, each sign- or zero-extended
to a lane of its own. The lanes lie in rows of `WIDTH` (the last may be short), and every
lane is mixed with its column j,

    f_j(y) = xs(C2 * xs(C1 * xs(y + T_j))),    xs(z) = z ^ (z >>> 32)    (mod 2^64),

each row's mixes are summed, s_r = sum_j f_j(y[r, j]), and

    h = sum_r g(s_r + g((r + 1) G))    (mod 2^64),

with T_j fixed-seed random, f_j murmur3's 64-bit finalizer (its multipliers, shifts of
32), g splitmix64's finalizer and G its odd increment.

Why: f_j is a bijection of y (an offset, xorshifts and odd multipliers are invertible),
so one changed lane changes its row's sum, and g, also a bijection, carries that into h.
Several changes leave h as it was only if their differences cancel, and the finalizer
makes each difference look like a random 64-bit number whatever the change (sign flips,
exponent bits, pairs in one row or in several): the products carry low bits up, the
xorshifts bring high bits down; the first xorshift is needed, as without it a flipped
top bit would leave half the difference fixed. The offsets differ by column and row, so
moved lanes (a swap) are seen too.

Integer sums wrap identically on every device and in any order, so the CPU and the GPU
give the same value (unlike a float reduction). Rows are mixed a chunk at a time in one
reused int64 buffer: a large tensor never has an int64 copy of itself. On the CPU the row
sums run in one C++ loop where it builds (csrc/fingerprint.cpp: each lane read once, against
seven passes of torch ops), the same value.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch

WIDTH = 4096  # lanes per row
# Rows mixed at once. On the CPU fewer lanes than torch's grain (32768 elements), so every
# op runs on the calling thread and waits on no other: on a shared, oversubscribed CPU
# each op of a parallel chunk waited for a descheduled thread (100M float32 at two
# threads: 2.0-6.8 s against 0.26-0.39 s), and 224 KiB stay in cache between the passes.
# On an accelerator 128 MiB: few, large kernels.
CPU_CHUNK_ROWS = 32767 // WIDTH
DEVICE_CHUNK_ROWS = 4096
_SEED = 20240531


def _signed(value: int) -> int:
    """A 64-bit constant as the int64 torch holds (torch has no uint64 arithmetic)."""
    return value - (1 << 64) if value >= 1 << 63 else value


_C1 = _signed(0xFF51AFD7ED558CCD)  # murmur3's fmix64 multipliers
_C2 = _signed(0xC4CEB9FE1A85EC53)
_GOLDEN = _signed(0x9E3779B97F4A7C15)  # splitmix64's increment and finalizer multipliers
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)

_COLUMN_OFFSETS: dict[torch.device, torch.Tensor] = {}
_KERNEL_SOURCE = Path(__file__).with_name("csrc") / "fingerprint.cpp"
RowSums = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@functools.cache
def cpu_row_sums() -> RowSums | None:
    """The C++ row sums (lanes [rows, WIDTH], offsets [WIDTH] -> [rows]), built once per
    machine; None where they cannot be built (the torch ops then)."""
    from dorarl.engine.cpu_kernels import load_library

    if not load_library(_KERNEL_SOURCE, "dorarl_fingerprint", "the fingerprint's C++ row sums",
                        "fingerprints run on torch ops"):  # fmt: skip
        return None
    return torch.ops.dorarl_fingerprint.row_sums


def fingerprint(tensor: torch.Tensor) -> int:
    """The 64-bit fingerprint of `tensor`'s bits (shape and dtype are checked apart)."""
    return int(_hash(tensor).item())


def fingerprints(named: dict[str, torch.Tensor]) -> dict[str, int]:
    """Every tensor's fingerprint, with one device synchronisation per device."""
    hashes = {name: _hash(t) for name, t in named.items()}
    by_device: dict[torch.device, list[str]] = {}
    for name, value in hashes.items():
        by_device.setdefault(value.device, []).append(name)
    result: dict[str, int] = {}
    for names in by_device.values():
        values = torch.stack([hashes[n] for n in names]).tolist()
        result.update(zip(names, values, strict=True))
    return {name: result[name] for name in named}


def _lanes(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensor's raw bits as a flat int64 view of its whole 8-byte lanes, and the lanes
    its last bytes widen to (often none)."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if raw.storage_offset() % 8:  # a view at an odd place of a bucket: int64 views need 8
        raw = raw.clone()
    whole = raw.numel() // 8 * 8
    rest = raw[whole:]
    parts = []
    if rest.numel() >= 4:
        parts.append(rest[:4].view(torch.int32))
        rest = rest[4:]
    if rest.numel():
        parts.append(rest.view(torch.int16) if tensor.element_size() == 2 else rest)
    tail = [p.to(torch.int64) for p in parts]
    empty = torch.zeros(0, dtype=torch.int64, device=raw.device)
    return raw[:whole].view(torch.int64), torch.cat(tail) if tail else empty


def _column_offsets(device: torch.device) -> torch.Tensor:
    """T_j of the module docstring (drawn on the CPU: the same on every device)."""
    if device not in _COLUMN_OFFSETS:
        generator = torch.Generator().manual_seed(_SEED)
        offsets = torch.randint(
            -(2**63), 2**63 - 1, (WIDTH,), generator=generator, dtype=torch.int64
        )
        _COLUMN_OFFSETS[device] = offsets.to(device)
    return _COLUMN_OFFSETS[device]


def _hash(tensor: torch.Tensor) -> torch.Tensor:
    """h of the module docstring, as a 0-dimensional int64 tensor on the tensor's device."""
    lanes, tail = _lanes(tensor)
    row_sums = _all_row_sums(lanes, tail)
    if not row_sums.numel():
        return torch.zeros((), dtype=torch.int64, device=lanes.device)
    rows = torch.arange(1, row_sums.numel() + 1, device=lanes.device)
    return _splitmix(row_sums + _splitmix(rows * _GOLDEN)).sum()


def _all_row_sums(lanes: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """Every row's s_r: the full rows (in C++ on the CPU where it builds, else a chunk at a
    time), then the short last one. Written into one tensor made first: small results kept
    between the chunks' temporaries would fragment the CPU heap."""
    device = lanes.device
    offsets = _column_offsets(device)
    full = lanes.numel() // WIDTH
    rows = lanes[: full * WIDTH].view(full, WIDTH)
    last = torch.cat([lanes[full * WIDTH :], tail]).view(1, -1)
    sums = torch.empty(full + int(last.numel() > 0), dtype=torch.int64, device=device)
    kernel = cpu_row_sums() if device.type == "cpu" and full else None
    if kernel is not None:
        sums[:full] = kernel(rows, offsets)
    else:
        _chunked_row_sums(rows, offsets, sums[:full])
    if last.numel():
        width = last.shape[1]
        _row_sums(last, offsets[:width], last.new_empty((1, width)), sums[full:])
    return sums


def _chunked_row_sums(rows: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor) -> None:
    """s_r of every row of `rows` into `out` with torch ops, a chunk of rows at a time mixed
    in one reused buffer."""
    count = rows.shape[0]
    if not count:
        return
    step = CPU_CHUNK_ROWS if rows.device.type == "cpu" else DEVICE_CHUNK_ROWS
    buffer = torch.empty((min(step, count), WIDTH), dtype=torch.int64, device=rows.device)
    for i in range(0, count, step):
        _row_sums(rows[i : i + step], offsets, buffer, out[i : i + step])


def _row_sums(
    lanes: torch.Tensor, offsets: torch.Tensor, buffer: torch.Tensor, out: torch.Tensor
) -> None:
    """s_r of the module docstring for each row of `lanes` (as many columns as `offsets`)
    into `out`, mixed in `buffer` (at least as many rows)."""
    z = buffer[: lanes.shape[0]]
    torch.add(lanes, offsets, out=z)
    _xorshift32(z)
    z.mul_(_C1)
    _xorshift32(z)
    z.mul_(_C2)
    _xorshift32(z)
    torch.sum(z, dim=1, out=out)


def _xorshift32(z: torch.Tensor) -> None:
    """z ^= z >>> 32 in place, on a contiguous int64 tensor: the low 32-bit half of each
    element (the first: CPUs and GPUs are little-endian) takes the xor of the high half, in
    one int32 pass (an arithmetic shift would need a mask and two passes more)."""
    halves = z.view(torch.int32).view(-1, 2)
    halves[:, 0] ^= halves[:, 1]


def _splitmix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer (a bijection), in wrapping int64 with logical shifts."""
    z = (z ^ _shift_right(z, 30)) * _M1
    z = (z ^ _shift_right(z, 27)) * _M2
    return z ^ _shift_right(z, 31)


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """z >>> bits: torch's >> on int64 copies the sign bit, which the mask clears."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)
