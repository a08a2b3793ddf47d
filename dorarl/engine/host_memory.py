"""The host memory this process may use: the machine's, within its cgroup's limit (a
container's), as the engine on the CPU sizes its KV pool from it (memory.py)."""

from __future__ import annotations

from pathlib import Path

import psutil

# cgroup v2, then v1: the limit and what the group uses now
_CGROUP_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


def host_memory() -> tuple[int, int]:
    """(free, total) bytes: what is available now and all this process may use, each
    within its cgroup's limit when that is below the machine's memory."""
    machine = psutil.virtual_memory()
    free, total = int(machine.available), int(machine.total)
    limit = cgroup_memory()
    if limit is not None and limit[1] < total:
        used, total = limit
        free = min(free, max(0, total - used))
    return free, total


def cgroup_memory() -> tuple[int, int] | None:
    """(used, limit) bytes of this process's cgroup, or None without a limit."""
    for limit_file, usage_file in _CGROUP_FILES:
        limit, used = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and used is not None:
            return used, limit
    return None


def _read_int(path: str) -> int | None:
    """The file's number; None when it is absent, unreadable or `max` (no limit)."""
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
