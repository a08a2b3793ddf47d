"""The package's functions stay short enough to read at a glance: none over 50 lines."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dorarl"
MAX_LINES = 50


def _long_functions() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    where = path.relative_to(PACKAGE.parent)
                    found.append(f"{where}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_is_over_50_lines():
    assert not _long_functions(), "split these: " + "; ".join(_long_functions())
