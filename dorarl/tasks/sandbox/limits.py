"""What one sandboxed program may use: CPU and wall seconds, memory, processes, output, files.

The kernel enforces all but the wall time and the output (`prlimit` sets them before the
program starts); the runner enforces those two by killing the program's whole group.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 1024  # address space
    processes: int = 32  # processes and threads of the program's user (namespace)
    output_bytes: int = 1 << 20  # stdout and stderr together
    file_mb: int = 16  # largest file written; the sandbox's temp folder holds 4 times that

    def __post_init__(self) -> None:
        for name in ("cpu_s", "wall_s", "memory_mb", "processes", "output_bytes", "file_mb"):
            if getattr(self, name) <= 0:
                raise ValueError(f"sandbox limit {name} must be > 0, got {getattr(self, name)}")

    def prlimit_args(self, processes: int | None = None) -> list[str]:
        """`prlimit` options setting the kernel's limits (no core files)."""
        memory = self.memory_mb * MIB
        return [
            f"--cpu={self.cpu_s}:{self.cpu_s + 1}",  # SIGXCPU, then SIGKILL a second on
            f"--as={memory}",
            f"--nproc={processes or self.processes}",
            f"--fsize={self.file_mb * MIB}",
            "--core=0",
        ]
