"""Which malloc the CPU actors run on: tcmalloc, preloaded into their processes, where the
machine has it (`ray.allocator`).

A CPU training step frees and re-allocates hundreds of megabytes of activations and chunked
logits. glibc maps every block over its mmap threshold (at most 32 MiB) afresh, so each one
page-faults in and is zeroed by the kernel on every step: on SmolLM2-135M's arith step that
was 2.9 million page faults and a quarter of the step's CPU time in the kernel. tcmalloc
keeps freed pages and hands them out again (same peak resident size), and vLLM's CPU build
asks for it too. A library cannot be swapped into a running process, so the actors start
with it in LD_PRELOAD, by its soname: each node finds it on its own library path, and a node
without it starts the process on glibc's malloc (ld.so says so on stderr).
"""

from __future__ import annotations

import ctypes.util
import functools
import logging
import os
import sys
from pathlib import Path
from typing import Literal

from dorarl.config import ConfigError

log = logging.getLogger(__name__)

Allocator = Literal["auto", "tcmalloc", "system"]
TCMALLOC_NAMES = ("tcmalloc_minimal", "tcmalloc")  # the minimal one has no heap profiler
INSTALL = "apt install libtcmalloc-minimal4 (Debian, Ubuntu) or dnf install gperftools-libs"
REEXEC_MARK = "DORARL_PRELOADED"
_own_process = False  # whether `dorarl` runs as this process's program (see own_process)


@functools.cache  # each look-up runs ldconfig; a run asks at start, the peers bench thrice
def find_tcmalloc() -> str | None:
    """tcmalloc's soname on this machine's library path, or None."""
    for name in TCMALLOC_NAMES:
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


def preload_library(allocator: Allocator) -> str | None:
    """The library the CPU actors preload for `allocator` (None: glibc's malloc).
    ConfigError naming `ray.allocator` if tcmalloc is asked for and not installed."""
    if allocator == "system":
        return None
    found = find_tcmalloc()
    if found is None and allocator == "tcmalloc":
        raise ConfigError(f"ray.allocator: tcmalloc is not installed here ({INSTALL})")
    if found is None:
        log.info("no tcmalloc here: CPU actors run on glibc's malloc (%s)", INSTALL)
    return found


def preload_env(library: str | None) -> dict[str, str]:
    """The env_vars that start a process on `library` (none for glibc's malloc), keeping
    whatever LD_PRELOAD this process was given."""
    if library is None:
        return {}
    inherited = os.environ.get("LD_PRELOAD", "").split()
    return {"LD_PRELOAD": " ".join([library, *(p for p in inherited if p != library)])}


def describe(library: str | None) -> str:
    """The malloc this process runs on, for a bench's record: `library` if it is loaded."""
    return library if library is not None and loaded(library) else "glibc malloc"


def loaded(library: str, maps: Path = Path("/proc/self/maps")) -> bool:
    """Whether `library` is mapped into this process (False where there is no /proc)."""
    stem = library.split(".so")[0]
    try:
        text = maps.read_text()
    except OSError:
        return False
    return any(Path(line.split()[-1]).name.startswith(stem) for line in text.splitlines())


def own_process() -> None:
    """Declare this process the `dorarl` program's own (the command line's entry point), so
    `reexec_on` may replace it; a caller's process (a test, a notebook) never is."""
    global _own_process
    _own_process = True


def reexec_on(library: str | None) -> None:
    """Start this command again on `library` (once; it does not return when it does), so
    work run in this very process gets the actors' allocator: a no-op when there is no
    library, it is already loaded, this process is that second start, or it is not the
    program's own (`own_process`)."""
    if library is None or loaded(library) or os.environ.get(REEXEC_MARK) or not _own_process:
        return
    env = {**os.environ, **preload_env(library), REEXEC_MARK: "1"}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
