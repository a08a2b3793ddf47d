"""`dorarl bench rewards`: short programs through the code task's reward pool, in each
sandbox and as bare subprocesses: programs/s, latency per program, and the sandbox's overhead.

Each program reads a number and prints a sum (one stdin/stdout test, all must pass); the
pool is the code task's (`CodeRewards`, `--workers` threads). The runners take turns, 10
chunks of the programs each, so a busy machine slows each alike; CPU time is the programs'
and their sandboxes' (this process's children's; none for bwrap, whose pid namespace reaps
the program out of this process's count). Latency is timed one program at a time
(50, or as many as the programs), the runners again in turn; a sandbox's overhead is its
median latency, and its CPU time per program, minus the bare subprocess's.

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
from dorarl.bench.clock import children_cpu_s, load_window
from dorarl.report.console import table_console
from dorarl.tasks.code_reward import CodeRewards
from dorarl.tasks.sandbox import BWRAP, UNSAFE, Limits, RunResult, Sandbox, bwrap_problem
from dorarl.tasks.sandbox.isolation import interpreter
from dorarl.tasks.user_rewards import RewardInput

LIMITS = Limits(cpu_s=5, wall_s=10.0)
LATENCY_RUNS = 50
ROUNDS = 10  # chunks per runner, taken in turns
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


def chunk_through_pool(rewards: CodeRewards, inputs: list[RewardInput]) -> dict[str, float]:
    """Wall seconds, children's CPU seconds and passes of one chunk through the pool."""
    cpu, start = children_cpu_s(), time.monotonic()
    scored = rewards.score(inputs)
    return {
        "wall_s": time.monotonic() - start, "cpu_s": children_cpu_s() - cpu,
        "passed": sum(s.reward == 1.0 for s in scored),
        "errors": sum(s.error is not None for s in scored),
    }  # fmt: skip


def measure(named: list[tuple[str, Any]], inputs: list[RewardInput], workers: int) -> dict:
    """Each runner's totals over ROUNDS chunks and its latencies, the runners taking turns
    (chunk by chunk, program by program) so the machine's load falls on each alike."""
    pools = {name: CodeRewards(runner, workers=workers) for name, runner in named}  # type: ignore[arg-type]
    totals = {name: {"wall_s": 0.0, "cpu_s": 0.0, "passed": 0, "errors": 0} for name, _ in named}
    size = max(1, -(-len(inputs) // ROUNDS))
    for start in range(0, len(inputs), size):
        for name, _ in named:
            for key, value in chunk_through_pool(pools[name], inputs[start : start + size]).items():
                totals[name][key] += value
    latencies: dict[str, list[float]] = {name: [] for name, _ in named}
    one = inputs[0].row["tests"][0]["stdin"]
    for _ in range(min(LATENCY_RUNS, len(inputs))):
        for name, runner in named:
            begin = time.monotonic()
            runner.run(PROGRAM.format(scale=1), one)
            latencies[name].append(time.monotonic() - begin)
    return {
        name: _summary(totals[name], latencies[name], len(inputs), workers, name != BWRAP)
        for name, _ in named
    }


def _summary(
    total: dict, latencies: list[float], count: int, workers: int, cpu_counted: bool
) -> dict[str, Any]:
    cpu = total["cpu_s"] / count * 1e3 if cpu_counted else None
    return {
        "programs": count, "workers": workers, "wall_s": total["wall_s"],
        "programs_per_s": count / total["wall_s"], "cpu_ms_per_program": cpu,
        "passed": total["passed"], "errors": total["errors"],
        "latency_median_ms": statistics.median(latencies) * 1e3,
        "latency_p90_ms": statistics.quantiles(latencies, n=10)[-1] * 1e3 if len(latencies) > 1 else latencies[0] * 1e3,
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
        report["contenders"] = measure(runners(), inputs, workers)
    bare = report["contenders"]["bare subprocess"]
    for result in report["contenders"].values():
        result["overhead_ms"] = result["latency_median_ms"] - bare["latency_median_ms"]
        cpu = result["cpu_ms_per_program"]
        result["overhead_cpu_ms"] = None if cpu is None else cpu - bare["cpu_ms_per_program"]
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
                "CPU ms/program", "latency median ms", "p90 ms", "overhead ms (latency)",
                "overhead CPU ms"):  # fmt: skip
        out.add_column(col, justify="right")
    for name, r in report["contenders"].items():
        out.add_row(name, str(r["programs"]), str(r["workers"]), f"{r['wall_s']:.1f}",
                    f"{r['programs_per_s']:.1f}", str(r["passed"]), str(r["errors"]),
                    _or_dash(r["cpu_ms_per_program"], "{:.1f}"), f"{r['latency_median_ms']:.1f}",
                    f"{r['latency_p90_ms']:.1f}", f"{r['overhead_ms']:+.1f}",
                    _or_dash(r["overhead_cpu_ms"], "{:+.1f}"))  # fmt: skip
    out.caption = (
        "runners take turns (10 chunks each, then one program each for the latencies), so the "
        f"machine's load falls on each alike; load average {report['load_average_start']} -> "
        f"{report['load_average']}. CPU: the programs' and their sandboxes' own (children's); "
        "not for bwrap, whose namespace reaps the program where this process cannot count it."
    )
    return out


def _or_dash(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


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
