"""`dorarl bench rewards`: short programs through the code task's reward pool, in each
sandbox and as bare subprocesses: programs/s, latency per program, and the sandbox's overhead.

Each program reads a number and prints a sum (one stdin/stdout test, all must pass); the
pool is the code task's (`CodeRewards`, `--workers` threads). Latency is timed one program
at a time (50, or as many as the programs); the overhead is a sandbox's median latency minus the bare subprocess's.

    dorarl bench rewards --out DIR [--programs 1000] [--workers N]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import subprocess
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.table import Table

from dorarl.bench.cli_args import write_json
from dorarl.bench.clock import load_window
from dorarl.report.console import table_console
from dorarl.tasks.code_reward import CodeRewards
from dorarl.tasks.sandbox import BWRAP, UNSAFE, Limits, RunResult, Sandbox, bwrap_problem
from dorarl.tasks.sandbox.isolation import interpreter
from dorarl.tasks.user_rewards import RewardInput

LIMITS = Limits(cpu_s=5, wall_s=10.0)
LATENCY_RUNS = 50
PROGRAM = "n = int(input())\nprint(sum(i * i for i in range({scale} * n)))\n"


class BareRunner:
    """The baseline: `python -I -c source` as a plain subprocess, nothing isolated."""

    name = "bare subprocess"
    limits = LIMITS

    def __init__(self) -> None:
        self.python = interpreter()

    def run(self, source: str, stdin: str = "") -> RunResult:
        start = time.monotonic()
        done = subprocess.run(
            [self.python, "-I", "-c", source], input=stdin, capture_output=True, text=True,
            timeout=self.limits.wall_s, check=False,
        )  # fmt: skip
        return RunResult(done.returncode, done.stdout, done.stderr, time.monotonic() - start)


def programs(count: int, seed: int = 0) -> list[RewardInput]:
    """`count` responses, each a program and its one test."""
    rng, inputs = random.Random(seed), []
    for _ in range(count):
        scale, n = rng.randint(1, 9), rng.randint(1, 300)
        code = PROGRAM.format(scale=scale)
        test = {"stdin": f"{n}\n", "stdout": f"{sum(i * i for i in range(scale * n))}\n"}
        row = {"prompt": "", "language": "python", "tests": [test]}
        inputs.append(RewardInput(row, f"```python\n{code}```\n", [], ""))
    return inputs


def contender(runner: Any, inputs: list[RewardInput], workers: int) -> dict[str, Any]:
    """Throughput through the pool, then latency one program at a time."""
    rewards = CodeRewards(runner, workers=workers)  # type: ignore[arg-type]
    start = time.monotonic()
    scored = rewards.score(inputs)
    wall = time.monotonic() - start
    one = inputs[0].row["tests"][0]
    code = PROGRAM.format(scale=1)
    latencies = []
    for _ in range(min(LATENCY_RUNS, len(inputs))):
        begin = time.monotonic()
        runner.run(code, one["stdin"])
        latencies.append(time.monotonic() - begin)
    return {
        "programs": len(inputs), "workers": workers, "wall_s": wall,
        "programs_per_s": len(inputs) / wall,
        "passed": sum(s.reward == 1.0 for s in scored),
        "errors": sum(s.error is not None for s in scored),
        "latency_median_ms": statistics.median(latencies) * 1e3,
        "latency_p90_ms": statistics.quantiles(latencies, n=10)[-1] * 1e3,
    }  # fmt: skip


def runners() -> list[tuple[str, Any]]:
    """The bare baseline, bubblewrap where it holds, and the rlimits-only sandbox."""
    found: list[tuple[str, Any]] = [("bare subprocess", BareRunner())]
    if bwrap_problem() is None:
        found.append((BWRAP, Sandbox(BWRAP, LIMITS)))
    found.append((UNSAFE, Sandbox(UNSAFE, LIMITS, concurrency=os.cpu_count() or 1)))
    return found


def bench(count: int, workers: int) -> dict[str, Any]:
    inputs = programs(count)
    report: dict[str, Any] = {
        "cpu": cpu_model(), "cores": os.cpu_count(), "python": interpreter(),
        "kernel": platform.release(), "bwrap": bwrap_problem() or "available",
        "limits": asdict(LIMITS), "contenders": {},
    }  # fmt: skip
    with load_window() as window:
        for name, runner in runners():
            report["contenders"][name] = contender(runner, inputs, workers)
    bare = report["contenders"]["bare subprocess"]["latency_median_ms"]
    for result in report["contenders"].values():
        result["overhead_ms"] = result["latency_median_ms"] - bare
    return report | window.fields()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def table(report: dict[str, Any]) -> Table:
    out = Table(title=f"rewards: short programs through the code task's pool ({report['cpu']})")
    for col in ("runner", "programs", "workers", "wall s", "programs/s", "passed", "errors",
                "latency median ms", "p90 ms", "overhead vs bare ms"):  # fmt: skip
        out.add_column(col, justify="right")
    for name, r in report["contenders"].items():
        out.add_row(name, str(r["programs"]), str(r["workers"]), f"{r['wall_s']:.1f}",
                    f"{r['programs_per_s']:.1f}", str(r["passed"]), str(r["errors"]),
                    f"{r['latency_median_ms']:.1f}", f"{r['latency_p90_ms']:.1f}",
                    f"{r['overhead_ms']:+.1f}")  # fmt: skip
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="dorarl bench rewards", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", required=True, type=Path, help="folder for rewards.json")
    parser.add_argument("--programs", type=int, default=1000, help="programs per runner")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="pool threads")
    parser.add_argument("--quick", action="store_true", help="100 programs")
    args = parser.parse_args(argv)
    report = bench(100 if args.quick else args.programs, args.workers)
    write_json(args.out, "rewards.json", report)
    table_console().print(table(report))
    return 0
