"""Every non-Python file the package reads at run time (C++ sources and headers built on the
user's machine) is shipped: matched by a package-data pattern in pyproject.toml."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dorarl"


def _shipped() -> set[Path]:
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["dorarl"]
    return {path for pattern in patterns for path in PACKAGE.glob(pattern)}


def test_every_cpp_source_and_header_is_package_data():
    sources = {p for p in PACKAGE.rglob("*") if p.suffix in {".cpp", ".h", ".cu"}}
    assert sources, "no C++ sources found: the test looks in the wrong place"
    missing = sorted(str(p.relative_to(ROOT)) for p in sources - _shipped())
    assert not missing, f"add to [tool.setuptools.package-data] in pyproject.toml: {missing}"
