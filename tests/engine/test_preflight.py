"""The fast paths' start-up checks: they pass on working kernels (Triton's interpreter
here), and a kernel that raises or computes wrong values, or a graph capture that raises,
makes an engine on `auto` fall back (torch attention, eager decode), generate what the
torch path generates, and record the fallback; an explicit choice fails in one line."""

import dataclasses
import os

import pytest
import torch
from engine_testlib import make_engine, prompts, run_all, seeded, tiny_model

import dorarl.engine.engine as engine_module
from dorarl.config import ConfigError
from dorarl.engine.backends import resolve_backends
from dorarl.engine.preflight import PreflightFailed, check_graph_replay

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter is not on"
)
FAST = dict(block_size=16, num_blocks=24, max_model_len=96, prefill_chunk_size=16, max_num_seqs=4)


def _as_on_cuda(monkeypatch, **paths):
    """`auto` resolving as it does on cuda (Triton attention, graphs) on this CPU."""

    def resolved(config):
        return dataclasses.replace(resolve_backends(config), **paths)

    monkeypatch.setattr(engine_module, "resolve_backends", resolved)


def _generate(engine) -> dict[str, list[int]]:
    for i, p in enumerate(prompts([20, 3, 9], seed=2)):
        engine.add_request(f"r{i}", p, seeded(5, seed=i))
    return {rid: out.output_ids for rid, out in run_all(engine).items()}


def _torch_path() -> dict[str, list[int]]:
    return _generate(make_engine(tiny_model("qwen2", seed=1), **FAST, attention="torch"))


def _broken_decode(kind: str):
    def decode(q, k_cache, v_cache, tables, lens, out=None, **kw):
        if kind == "raises":
            raise RuntimeError("PTX assembly failed\nptxas fatal: (details)")
        out = torch.empty_like(q) if out is None else out
        return out.fill_(0.5)  # finite, wrong

    return decode


def test_working_kernels_pass_and_nothing_falls_back(monkeypatch):
    from dorarl.engine import preflight

    calls = []
    check = preflight.check_triton_attention
    monkeypatch.setattr(engine_module, "check_triton_attention", lambda *a: calls.append(check(*a)))
    engine = make_engine(tiny_model("qwen2", seed=1), **FAST, attention="triton")
    assert calls and engine.backends.attention == "triton"
    assert engine.setup().fast_path_fallbacks == []


@pytest.mark.parametrize("kind", ["raises", "wrong values"])
def test_a_failing_kernel_on_auto_falls_back_to_torch_and_is_recorded(monkeypatch, caplog, kind):
    from dorarl.engine import triton_attention

    monkeypatch.setattr(triton_attention, "paged_decode", _broken_decode(kind))
    _as_on_cuda(monkeypatch, attention="triton", cuda_graphs=True)
    engine = make_engine(tiny_model("qwen2", seed=1), **FAST)
    b = engine.backends
    assert (b.attention, b.cuda_graphs, engine.graphs) == ("torch", False, None)
    (fallback,) = engine.setup().fast_path_fallbacks
    assert (fallback.path, fallback.instead) == ("attention", "torch")
    assert ("PTX assembly failed" if kind == "raises" else "differs from the reference") in (
        fallback.error
    )
    assert "\n" not in fallback.error
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "engine.attention=auto" in warned[0]
    monkeypatch.undo()
    assert _generate(engine) == _torch_path()


def test_an_explicit_triton_that_fails_its_check_is_refused_in_one_line(monkeypatch):
    from dorarl.engine import triton_attention

    monkeypatch.setattr(triton_attention, "paged_decode", _broken_decode("raises"))
    with pytest.raises(ConfigError, match="^engine.attention: triton failed its start-up check"):
        make_engine(tiny_model("qwen2", seed=1), **FAST, attention="triton")


def test_a_capture_that_raises_on_auto_falls_back_to_eager_decode(monkeypatch):
    from dorarl.engine.decode_graphs import DecodeGraphs

    def capture(self):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(DecodeGraphs, "capture", capture)
    _as_on_cuda(monkeypatch, attention="triton", cuda_graphs=True)
    engine = make_engine(tiny_model("qwen2", seed=1), **FAST)
    assert engine.backends.attention == "triton" and not engine.backends.cuda_graphs
    assert engine.graphs is None and engine.runner.graphs is None
    (fallback,) = engine.setup().fast_path_fallbacks
    assert (fallback.path, fallback.instead) == ("cuda_graphs", "off")
    assert "operation not permitted" in fallback.error
    got = _generate(engine)
    monkeypatch.undo()
    assert got == _torch_path()


def test_a_replay_that_differs_from_eager_fails_the_graph_check():
    """What capture leaves, a graph per bucket whose replay writes its static output; here
    one whose replay writes the wrong logits."""
    graphs = _eager_graphs()

    class WrongReplay:
        def replay(self):
            graphs.outputs[1].fill_(3.0)

    graphs.outputs[1] = graphs.eager(1).clone()
    graphs.graphs[1] = WrongReplay()
    with pytest.raises(PreflightFailed, match="^CUDA graph replay differs from the reference"):
        check_graph_replay(graphs)
    graphs.graphs[1] = type("Replay", (), {"replay": lambda self: None})()
    graphs.outputs[1] = graphs.eager(1).clone()  # what a faithful replay leaves there
    check_graph_replay(graphs)


def _eager_graphs():
    from dorarl.engine.decode_graphs import DecodeGraphs

    engine = make_engine(tiny_model("qwen2", seed=1), **FAST, attention="triton")
    model = engine.model
    return DecodeGraphs(
        lambda ids, pos, attention: model.forward(ids, pos, attention),
        engine.kv, 4, 6, scratch_block=FAST["num_blocks"] - 1, graphs=False,
    )  # fmt: skip
