"""What the vLLM backend offers without vllm installed: its arguments checked in one line
naming the key, a package that imports no vllm, and each engine's capabilities."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dorarl.config import ConfigError
from dorarl.engine.capabilities import Capabilities
from dorarl.engine.vllm.config import VllmArgs


def test_vllm_args_are_checked_naming_the_key():
    assert VllmArgs().tensor_parallel_size == 1
    with pytest.raises(ConfigError, match="engine.vllm.tensor_parallel_size"):
        VllmArgs(tensor_parallel_size=0)
    with pytest.raises(ConfigError, match="engine.vllm.gpu_memory_utilization"):
        VllmArgs(gpu_memory_utilization=1.5)
    with pytest.raises(ConfigError, match="engine.vllm.dtype"):
        VllmArgs(dtype="int8")  # type: ignore[arg-type]


def test_an_instance_takes_its_placed_share_of_a_gpu_unless_told():
    assert VllmArgs().gpu_share(placed=None) == 0.9  # vLLM's own default
    assert VllmArgs().gpu_share(placed=0.3333) == 0.3333  # three actors on one GPU
    assert VllmArgs(gpu_memory_utilization=0.5).gpu_share(placed=0.3333) == 0.5
    assert VllmArgs().gpu_share(placed=1.0) == 0.9  # a whole GPU: vLLM's headroom


def test_the_backend_package_imports_no_vllm():
    code = (
        "import sys, dorarl.engine.vllm, dorarl.engine.vllm.config, dorarl.engine.vllm.requests;"
        "import dorarl.engine.engine; print('vllm' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_our_engine_states_its_capabilities():  # and vLLM's: VLLM_CAPABILITIES
    from dorarl.engine.engine import Engine

    assert Engine.capabilities == Capabilities(
        kv_export=True, offload=True, adapters=True, route_recording=True,
        serves_weights=True, exact_logprobs=True,
    )  # fmt: skip


def test_backend_vllm_is_refused_without_vllm_and_where_it_cannot_serve(monkeypatch):
    from dorarl.engine import config as engine_config
    from dorarl.engine.config import EngineConfig
    from dorarl.engine.vllm.config import INSTALL

    monkeypatch.setattr(engine_config, "vllm_missing", lambda: INSTALL)
    with pytest.raises(
        ConfigError, match=r"^engine.backend: vllm needs vLLM.*scripts/install_vllm_cpu.sh"
    ):
        EngineConfig(backend="vllm")
    assert EngineConfig().backend == "dorarl"  # the default never looks for vllm
    monkeypatch.setattr(engine_config, "vllm_missing", lambda: None)
    config = EngineConfig(backend="vllm", vllm=VllmArgs(tensor_parallel_size=2))
    assert config.vllm.tensor_parallel_size == 2
    for key, value in (("host_blocks", 4), ("record_routes", True)):
        with pytest.raises(ConfigError, match=rf"^engine.{key}: .*engine.backend=vllm"):
            EngineConfig(backend="vllm", device="cuda", **{key: value})
    with pytest.raises(ConfigError, match=r"^engine.record_routes: .* on the cpu only: .*CUDA"):
        EngineConfig(backend="vllm", device="cuda", record_routes=True)
    with pytest.raises(ConfigError, match=r"^engine.record_routes: .*enforce_eager=true: .*"):
        EngineConfig(backend="vllm", record_routes=True)  # a compiled forward calls no hook
    eager = VllmArgs(enforce_eager=True)
    assert EngineConfig(backend="vllm", record_routes=True, vllm=eager).record_routes
    # LoRA versions are vLLM adapters, whose prefix cache is keyed by adapter and salt
    assert EngineConfig(backend="vllm", max_versions=3).max_versions == 3
