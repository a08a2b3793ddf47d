"""The test suite's own layout: pytest imports test modules by basename, so each is unique."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_every_test_module_has_its_own_basename():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    shared = sorted(name for name, count in names.items() if count > 1)
    assert not shared, f"test modules sharing a basename (pytest collects one of each): {shared}"
