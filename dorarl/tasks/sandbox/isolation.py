"""The command lines that isolate one program: bubblewrap's namespaces, or rlimits only.

`bwrap`: fresh user, pid, mount, network, IPC and UTS namespaces; the system read-only
(/usr and its links, the interpreter's prefix, the loader's cache), none of the home, the
working directories or the run's files; a private tmpfs as the working folder; `prlimit`
inside the namespace (so the process limit counts the program's processes only); the
program's death kills every process of its pid namespace. Run as root, bubblewrap runs as
`nobody` (the kernel skips the process limit for root). `unsafe_rlimits_only`: the
program runs with the same rlimits in its own process group and a temp folder, as `nobody`
when the run is root's, with the run's network and everything that user can read.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from dorarl.tasks.sandbox.limits import MIB, Limits

BWRAP = "bwrap"
UNSAFE = "unsafe_rlimits_only"
MODES = (BWRAP, UNSAFE)
NOBODY = 65534
WORKDIR = "/work"  # the program's working folder in the namespace (a tmpfs)
PROGRAM = "/code/main.py"
_SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/etc/alternatives")


def interpreter() -> str:
    """The Python that runs programs: the system's (/usr/bin/python3), else this one."""
    system = Path("/usr/bin/python3")
    return str(system) if system.exists() else os.path.realpath(sys.executable)


def as_nobody() -> list[str]:
    """A prefix that drops root to `nobody` (nothing when the run is not root's)."""
    if os.geteuid() != 0:
        return []
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"]


def bwrap_argv(limits: Limits, program_fd: int, python: str) -> list[str]:
    """bubblewrap running `python PROGRAM` (read from `program_fd`) under `limits`."""
    args = [shutil.which(BWRAP) or BWRAP, "--unshare-all", "--die-with-parent", "--new-session"]
    args += ["--ro-bind", "/usr", "/usr", *_system_links(), *_interpreter_binds(python)]
    for path in _ETC_FILES:
        if os.path.exists(path):
            args += ["--ro-bind", path, path]
    args += ["--proc", "/proc", "--dev", "/dev"]
    args += ["--size", str(4 * limits.file_mb * MIB), "--tmpfs", WORKDIR]
    args += ["--size", str(4 * limits.file_mb * MIB), "--tmpfs", "/tmp"]
    args += ["--file", str(program_fd), PROGRAM, "--chdir", WORKDIR]
    args += ["--", "prlimit", *limits.prlimit_args(), "--", python, "-I", PROGRAM]
    return [*as_nobody(), *args]


def unsafe_argv(limits: Limits, program: str, python: str, processes: int) -> list[str]:
    """`python program` under rlimits only; `processes` counts all the user's at once."""
    prlimit = ["prlimit", *limits.prlimit_args(processes), "--"]
    return [*as_nobody(), *prlimit, python, "-I", program]


def _system_links() -> list[str]:
    """/bin, /lib, ... as the host has them: a link into /usr, or a directory bound ro."""
    args: list[str] = []
    for path in _SYSTEM_LINKS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def _interpreter_binds(python: str) -> list[str]:
    """The interpreter's installation, read-only, when it lives outside /usr."""
    if python.startswith("/usr/"):
        return []
    prefix = str(Path(python).resolve().parents[1])
    return ["--ro-bind", prefix, prefix]
