"""Why a worker process died, in one line, read from the error Ray raised for its death.

Ray's error carries what its raylet saw (the actor table's death cause holds the same text,
so asking the state API adds nothing): a memory monitor kill, an exit code, a signal it
caught, `ray.kill`, or a process gone with no exit status (SIGKILL, the kernel's OOM killer,
a crash: the raylet cannot tell these apart).
"""

from __future__ import annotations

import re
import signal

_MEMORY = re.compile(r"Memory usage (\d+)B exceeded threshold of (\d+)B \(([\d.]+)% of (\d+)B")
_HELD = re.compile(r"Selected to kill: .*?actual memory used=([\d.]+)GB")
_EXIT = re.compile(r"exits with an exit code (-?\d+)\.(?: The process receives a (SIG\w+))?")
_EXIT_TYPE = re.compile(r"Worker exit type: (\w+) Worker exit detail: ([^.]*)")
_NO_STATUS = "connection error code 2. End of file"
_MAX_CHARS = 200


def death_cause(exc: BaseException) -> str:
    """One line on why the process behind `exc` died (`exc`: Ray's death error, or an error
    that wraps one: a failed call whose actor saw another die, a trainer rank's death)."""
    inner = getattr(exc, "cause", None)
    if isinstance(inner, BaseException) and inner is not exc:
        return death_cause(inner)
    return classify(type(exc).__name__, str(exc))


def classify(kind: str, text: str) -> str:
    """The one line for a death error of type name `kind` with message `text`."""
    if kind == "OutOfMemoryError" or "running low on memory" in text:
        return _memory_kill(text)
    if "killed by `ray.kill`" in text:
        return "killed by ray.kill"
    if exit_ := _EXIT.search(text):
        return _exit_code(int(exit_.group(1)), exit_.group(2))
    if _NO_STATUS in text:
        return (
            "its process ended with no exit status (SIGKILL, the kernel's OOM killer or a "
            "crash; `dmesg` on its node tells them apart)"
        )
    if typed := _EXIT_TYPE.search(text):
        return f"{typed.group(1).lower()}: {typed.group(2).strip()}"[:_MAX_CHARS]
    if kind == "ActorUnavailableError":
        return f"unreachable: {_first_line(text)}"[:_MAX_CHARS]
    return f"{kind}: {_first_line(text)}"[:_MAX_CHARS]


def _memory_kill(text: str) -> str:
    found = _MEMORY.search(text)
    if found is None:
        return "killed by Ray's memory monitor (the node ran low on memory)"
    used, threshold, limit = (int(found.group(i)) for i in (1, 2, 4))
    line = (
        f"killed by Ray's memory monitor (node memory {_gb(used)} > threshold {_gb(threshold)}"
        f" of {_gb(limit)}"
    )
    held = _HELD.search(text)
    return line + (f"; the process held {held.group(1)} GB)" if held else ")")


def _exit_code(code: int, caught: str | None) -> str:
    """`exit code 3`; `exit code 137 (SIGKILL)` for a shell-style signal code; a signal the
    worker caught (and exited on) after the code."""
    line = f"exit code {code}"
    if code > 128 and code - 128 in signal.valid_signals():
        line += f" ({signal.Signals(code - 128).name})"
    return line + (f" after {caught}" if caught else "")


def _gb(size: int) -> str:
    return f"{size / 1e9:.1f} GB"


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "no detail")
