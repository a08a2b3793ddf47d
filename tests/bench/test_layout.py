"""dorarl/bench as a whole: every bench reads the clocks and the load average through
dorarl.bench.clock, and no function runs over 50 lines."""

import ast
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "dorarl" / "bench"
MODULES = sorted(BENCH.glob("*.py"))
CLOCK_READS = {"getloadavg", "process_time", "perf_counter", "getrusage", "times"}
MAX_LINES = 50


def _calls(tree: ast.AST) -> set[str]:
    """Names called as `module.name(...)` (os.getloadavg, time.perf_counter, ...)."""
    return {
        node.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    }


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_only_the_clock_module_reads_clocks_and_load(path):
    if path.name == "clock.py":
        return
    read = _calls(ast.parse(path.read_text())) & CLOCK_READS
    assert not read, f"{path.name} reads {sorted(read)}: use dorarl.bench.clock"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_function_runs_over_50_lines(path):
    tree = ast.parse(path.read_text())
    long = {
        node.name: node.end_lineno - node.lineno + 1
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_LINES
    }
    assert not long, f"{path.name}: {long}"
