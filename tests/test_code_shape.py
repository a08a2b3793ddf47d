"""The package's code stays short enough to read at a glance: no function over 50 lines, no
file over 600."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dorarl"
MAX_LINES = 50
MAX_FILE_LINES = 600


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


def _long_files() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > MAX_FILE_LINES:
            found.append(f"{path.relative_to(PACKAGE.parent)} ({lines} lines)")
    return found


def test_no_function_is_over_50_lines():
    assert not _long_functions(), "split these: " + "; ".join(_long_functions())


def test_no_file_is_over_600_lines():
    assert not _long_files(), "split these along their ideas: " + "; ".join(_long_files())
