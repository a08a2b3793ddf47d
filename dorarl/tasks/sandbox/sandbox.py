"""`Sandbox`: run one Python program with its stdin under the run's isolation and limits.

Invariants: `Sandbox(mode)` raises `UserInputError` (naming `task.sandbox`) when the mode
cannot hold on this machine: `bwrap` where bubblewrap is missing or cannot make namespaces
(probed once per process); `run` never raises for what the program does (it comes back
in the `RunResult`), leaves no process of the program alive and no file behind.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import tempfile

from dorarl.errors import UserInputError
from dorarl.tasks.sandbox.isolation import (
    BWRAP,
    MODES,
    NOBODY,
    UNSAFE,
    bwrap_argv,
    interpreter,
    unsafe_argv,
)
from dorarl.tasks.sandbox.limits import Limits
from dorarl.tasks.sandbox.process import run_bounded
from dorarl.tasks.sandbox.result import RunResult

log = logging.getLogger(__name__)

KEY = "task.sandbox"
_PROBE = Limits(cpu_s=5, wall_s=20.0)


class Sandbox:
    def __init__(self, mode: str = BWRAP, limits: Limits | None = None, concurrency: int = 1):
        if mode not in MODES:
            raise UserInputError(f"{KEY}: unknown sandbox {mode!r}; choose one of {MODES}")
        self.mode, self.limits, self.concurrency = mode, limits or Limits(), concurrency
        self.python = interpreter()
        if mode == BWRAP:
            reason = bwrap_problem()
            if reason is not None:
                raise UserInputError(
                    f"{KEY}={BWRAP}: {reason}; install bubblewrap (apt-get install bubblewrap) "
                    f"where user namespaces are allowed, or set {KEY}={UNSAFE} to run "
                    "model-written code with rlimits only (it can read your files and reach "
                    "the network)"
                )
        else:
            log.warning("%s=%s: model-written code runs without namespaces", KEY, UNSAFE)

    def __reduce__(self) -> tuple:
        return (Sandbox, (self.mode, self.limits, self.concurrency))

    def run(self, source: str, stdin: str = "") -> RunResult:
        """The program's run; raises `SandboxFailure` or `OSError` when the sandbox failed."""
        if self.mode == BWRAP:
            return _run_bwrap(source, stdin, self.limits, self.python)
        return _run_unsafe(source, stdin, self.limits, self.python, self.concurrency)


@functools.cache
def bwrap_problem() -> str | None:
    """Why bubblewrap cannot isolate a program here (None: it can), probed once."""
    if shutil.which(BWRAP) is None:
        return "bubblewrap (bwrap) is not installed"
    try:
        result = _run_bwrap("print(6 * 7)", "", _PROBE, interpreter())
    except (SandboxFailure, OSError) as exc:
        return f"bubblewrap cannot make namespaces here ({exc})"
    if result.returncode == 0 and result.stdout.strip() == "42":
        return None
    why = result.stderr.strip().splitlines()[-1:] or [result.cause() or "no output"]
    return f"bubblewrap cannot make namespaces here ({why[0][:160]})"


def _run_bwrap(source: str, stdin: str, limits: Limits, python: str) -> RunResult:
    fd = os.memfd_create("program", 0)
    try:
        os.write(fd, source.encode())
        os.lseek(fd, 0, os.SEEK_SET)
        argv = bwrap_argv(limits, fd, python)
        result = run_bounded(argv, stdin.encode(), limits.wall_s, limits.output_bytes, None, [fd])
    finally:
        os.close(fd)
    return _signalled(result)


class SandboxFailure(RuntimeError):
    """The sandbox could not run the program (not the program's failure)."""


def _signalled(result: RunResult) -> RunResult:
    """bubblewrap reports a program killed by signal N as exit 128 + N, and its own
    failure to set up as exit 1 with its message on stderr."""
    code = result.returncode
    if code == 1 and not result.stdout and result.stderr.startswith("bwrap: "):
        raise SandboxFailure(result.stderr.strip().splitlines()[0][:200])
    if code is not None and code > 128:
        return RunResult(-(code - 128), result.stdout, result.stderr, result.wall_s)
    return result


def _run_unsafe(
    source: str, stdin: str, limits: Limits, python: str, concurrency: int
) -> RunResult:
    folder = tempfile.mkdtemp(prefix="dorarl-code-")
    try:
        program = os.path.join(folder, "main.py")
        with open(program, "w", encoding="utf-8") as handle:
            handle.write(source)
        if os.geteuid() == 0:
            os.chown(folder, NOBODY, NOBODY)
        argv = unsafe_argv(limits, program, python, limits.processes * concurrency)
        return run_bounded(argv, stdin.encode(), limits.wall_s, limits.output_bytes, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
