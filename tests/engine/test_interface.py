"""Every engine backend answers `InstanceEngine` with its exact signatures (the vLLM
backend's check is in tests/engine/vllm/test_vllm_engine.py)."""

from __future__ import annotations

import pytest
import torch

from dorarl.engine.interface import InstanceEngine, interface_gaps


def test_our_engine_answers_the_instance_interface():
    from dorarl.engine.engine import Engine

    assert interface_gaps(Engine) == []
    assert Engine.capabilities.kv_export and Engine.capabilities.exact_logprobs


def test_a_check_refuses_a_load_of_our_engine(tiny_model_dir):
    from dorarl.engine.config import EngineConfig
    from dorarl.engine.engine import Engine

    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(max_model_len=64, max_num_seqs=2))
    assert isinstance(engine, InstanceEngine)
    named = {n: t.clone() for n, t in engine.state_dict().items()}
    before = {n: t.clone() for n, t in named.items()}
    for t in named.values():
        t.add_(1.0)

    def refuse(tensors):
        raise RuntimeError(f"refused {len(tensors)} tensors")

    with pytest.raises(RuntimeError, match="refused"):
        engine.load_weights(named, 1, refuse)
    assert engine.version == 0
    assert all(torch.equal(engine.state_dict()[n], t) for n, t in before.items())


def test_a_backend_short_of_the_interface_is_named():
    class Partial:
        def step(self, budget: int) -> list: ...

    gaps = interface_gaps(Partial)
    assert "add_request: missing" in gaps
    assert "step: takes ['self', 'budget'], the interface ['self']" in gaps
