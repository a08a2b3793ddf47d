"""Run a command in its own process group, read at most N bytes of its output, and kill the
whole group on the wall-time or output limit, or once the command itself has exited.

Invariant: `run_bounded` returns within about `wall_s` plus `KILL_WAIT_S`, and no process
of the group it started is left alive (one that left the group by `setsid` is the
namespace's to kill: `dorarl.tasks.sandbox.isolation`).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from dorarl.tasks.sandbox.result import RunResult

KILL_WAIT_S = 5.0  # bound on the wait for a killed group's leader to be reaped
_READ_BYTES = 65536


@dataclass
class _Output:
    limit: int
    chunks: dict[int, list[bytes]] = field(default_factory=dict)
    total: int = 0

    def add(self, fd: int, data: bytes) -> bool:
        """Keep `data` up to the limit; False once the limit is passed."""
        room = max(0, self.limit - self.total)
        self.chunks.setdefault(fd, []).append(data[:room])
        self.total += len(data)
        return self.total <= self.limit

    def text(self, fd: int) -> str:
        return b"".join(self.chunks.get(fd, [])).decode("utf-8", errors="replace")


def run_bounded(
    argv: Sequence[str],
    stdin: bytes,
    wall_s: float,
    output_bytes: int,
    cwd: str | None = None,
    pass_fds: Sequence[int] = (),
) -> RunResult:
    """Run `argv` with `stdin`; stdout and stderr kept up to `output_bytes` together."""
    stdin_fd = _memory_file(stdin)
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            list(argv), stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            cwd=cwd, pass_fds=tuple(pass_fds), start_new_session=True, env=_bare_env(),
        )  # fmt: skip
    finally:
        os.close(stdin_fd)
    output = _Output(output_bytes)
    try:
        killed_for = _pump(proc, output, start + wall_s)
    finally:
        _kill_group(proc)
    returncode = None if killed_for else proc.returncode
    out, err = proc.stdout.fileno(), proc.stderr.fileno()  # type: ignore[union-attr]
    result = RunResult(
        returncode, output.text(out), output.text(err), time.monotonic() - start, killed_for
    )
    proc.stdout.close()  # type: ignore[union-attr]
    proc.stderr.close()  # type: ignore[union-attr]
    return result


def _pump(proc: subprocess.Popen, output: _Output, deadline: float) -> str | None:
    """Read the pipes until both close or the command exits; the limit it broke, if any."""
    with selectors.DefaultSelector() as selector:
        for pipe in (proc.stdout, proc.stderr):
            os.set_blocking(pipe.fileno(), False)  # type: ignore[union-attr]
            selector.register(pipe, selectors.EVENT_READ)  # type: ignore[arg-type]
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return "wall time"
            for key, _ in selector.select(min(left, 0.05)):
                data = os.read(key.fd, _READ_BYTES)
                if not data:
                    selector.unregister(key.fileobj)
                elif not output.add(key.fd, data):
                    return "output"
            if proc.poll() is not None:
                return _drain(selector, output)
    return "wall time" if _wait(proc, deadline) is None else None


def _drain(selector: selectors.BaseSelector, output: _Output) -> str | None:
    """What is left in the pipes of an exited command (its group is killed next)."""
    for key, _ in selector.select(0):
        try:
            data = os.read(key.fd, output.limit + 1)
        except BlockingIOError:
            continue
        if data and not output.add(key.fd, data):
            return "output"
    return None


def _wait(proc: subprocess.Popen, deadline: float) -> int | None:
    try:
        return proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the command's process group (its leader's id) and reap the leader."""
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):  # SIGKILL cannot be ignored
        proc.wait(timeout=KILL_WAIT_S)


def _memory_file(data: bytes) -> int:
    """An fd reading `data` from its start (the command's stdin: no pipe to keep fed)."""
    fd = os.memfd_create("stdin", 0)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _bare_env() -> dict[str, str]:
    """The environment a program sees: none of the run's (keys, tokens, paths)."""
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
