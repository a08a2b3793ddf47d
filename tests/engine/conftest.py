"""Engine tests run single-threaded (the `single_thread` fixture of tests/conftest.py)."""

import pytest


@pytest.fixture(autouse=True)
def _engine_tests_single_thread(single_thread):
    yield
