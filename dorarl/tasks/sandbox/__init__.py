"""Running model-written programs: isolation (bubblewrap or rlimits only), limits, results."""

from dorarl.tasks.sandbox.isolation import BWRAP, MODES, UNSAFE
from dorarl.tasks.sandbox.limits import Limits
from dorarl.tasks.sandbox.result import RunResult
from dorarl.tasks.sandbox.sandbox import KEY, Sandbox, SandboxFailure, bwrap_problem

__all__ = [
    "BWRAP",
    "KEY",
    "MODES",
    "UNSAFE",
    "Limits",
    "RunResult",
    "Sandbox",
    "SandboxFailure",
    "bwrap_problem",
]
