"""The engine's fused C++ CPU kernels (csrc/cpu_kernels.cpp): built once, loaded on demand.

Inside a decode step every op costs tens of microseconds whatever its size (its code and
data come in cold after a layer's weights went through the caches), so two hot spots of the
step are one op each here: decode attention, which attends every decode row over its own
blocks in one call per layer (block-table walk, scores, softmax, weighted values) where the
tensor path of attention.py runs about 15 ops, RMSNorm (torch composes it of 7) and RoPE (4,
model.rotate). It is
compiled with `torch.utils.cpp_extension` the first time a process needs it, into the
per-user extension cache (`TORCH_EXTENSIONS_DIR`, else ~/.cache/torch_extensions), under a
name that carries the CPU's vector ISA and a hash of the source, so later processes only load
it. Where they cannot be built (no compiler, no ninja, a build error), `load_kernels` says so in
one log line and returns None: `engine.attention=auto` then runs torch ops (attention.py).
`load_library` builds and loads any such op library the same way (the trainer's fused kernels,
trainer/csrc; the weights' fingerprint, runtime/transfer/csrc), each source beside the shared
header csrc/lanes.h.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.cpp"
# Headers every source may include (lanes.h), copied beside it into its build folder.
HEADERS = (Path(__file__).with_name("csrc") / "lanes.h",)
HEAD_DIMS = (16, 32, 64, 128, 256)  # the kernel keeps a head row in whole 16-float vectors
MAX_QUERIES_PER_KV = 32
# Vector ISA flags per torch's own CPU capability: the kernel's sums run in the source's order
# whatever the ISA; the flags choose instructions (and fused multiply-adds where there are).
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}

DecodeKernel = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class CpuKernels:
    # (q [batch, heads, dim], key_pool, value_pool [blocks, kv_heads, block_size, dim],
    #  tables [batch, width] int64 (-1 pads), context_lens [batch], scale) -> [batch, heads*dim]
    decode: DecodeKernel
    # (x [rows, hidden] contiguous, weight [hidden], eps) -> [rows, hidden]; within 2 ulps of
    # F.rms_norm (its sum of squares runs in its own fixed order)
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    # (x [tokens, heads, dim], cos, sin_signed [tokens, 1, dim]) -> x rotated: model.rotate's
    # three ops in one, bit for bit
    rope: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def supports(head_dim: int, queries_per_kv: int, dtype: torch.dtype) -> bool:
    """Whether the kernel computes this model's decode attention (else attention.py does)."""
    return dtype == torch.float32 and head_dim in HEAD_DIMS and queries_per_kv <= MAX_QUERIES_PER_KV


@functools.cache
def load_kernels() -> CpuKernels | None:
    """The kernels, built or loaded from the cache; None where they cannot be (logged once)."""
    if not load_library(
        SOURCE, "dorarl_cpu_kernels", "fused CPU kernels", "the engine runs torch ops"
    ):
        return None
    ops = torch.ops.dorarl_cpu
    return CpuKernels(decode=ops.paged_decode, rms_norm=ops.rms_norm, rope=ops.rope)


def load_library(source: Path, prefix: str, what: str, otherwise: str) -> bool:
    """Build (once per machine, under `prefix` in the extension cache) and load the C++ op
    library `source` into this process; False where it cannot be, in one log line naming
    `what` and what happens `otherwise`."""
    try:
        missing = _missing_tools()
    except ImportError as err:  # cpp_extension needs setuptools, which a slim env may lack
        missing = f"torch.utils.cpp_extension: {err}"
    if missing:
        logger.warning("%s unavailable (%s): %s", what, missing, otherwise)
        return False
    try:
        _build(source, prefix)
    except (RuntimeError, OSError, ImportError, subprocess.SubprocessError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        logger.warning("%s did not build (%s): %s", what, first, otherwise)
        return False
    return True


def _missing_tools() -> str:
    from torch.utils.cpp_extension import is_ninja_available

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler {compiler!r} on PATH"
    if not is_ninja_available():
        return "no ninja on PATH"
    return ""


def _build(source_path: Path, prefix: str) -> None:
    from torch.utils.cpp_extension import get_default_build_root, load

    capability = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-ffp-contract=fast", *_ISA_FLAGS.get(capability, [])]
    # One folder per source, flags and torch (its ABI): builds never overwrite each other.
    key = f"{' '.join(flags)} {torch.__version__}".encode()
    source = source_path.read_bytes()
    headers = {path.name: path.read_bytes() for path in HEADERS}
    digest = hashlib.sha256(source + b"".join(headers.values()) + key).hexdigest()[:12]
    name = f"{prefix}_{capability.lower()}_{digest}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    build_dir = Path(root) / name
    if not any(build_dir.glob("*.so")):
        logger.info("building %s once, into %s (16-40 s)", source_path.name, build_dir)
    with _exclusive(build_dir):
        for header, text in headers.items():
            _source_copy(build_dir, header, text)
        load(
            name,
            [str(_source_copy(build_dir, source_path.name, source))],
            extra_cflags=flags,
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )


def _source_copy(build_dir: Path, name: str, source: bytes) -> Path:
    """A source or header, copied into its build folder (made and locked by `_exclusive`): torch's
    build file records the source's path, so building from the checkout's own path would
    rebuild whenever another checkout (a second clone, a worktree) loaded the same kernels."""
    copy = build_dir / name
    if not copy.is_file() or copy.read_bytes() != source:
        copy.write_bytes(source)
    return copy


@contextlib.contextmanager
def _exclusive(build_dir: Path) -> Iterator[None]:
    """One builder at a time, by a lock the OS drops when its holder dies. cpp_extension's own
    lock is a plain file that a build killed half-way leaves behind, on which every later
    build would wait forever: under our lock, such a file can only be stale, so it goes."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "dorarl.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
