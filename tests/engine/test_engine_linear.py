"""The engine's matmul kernels: oneDNN's packed linear equals F.linear, is row-independent, is
re-packed on every weight load, and makes a request's results independent of its batch."""

import pytest
import torch
import torch.nn.functional as F
from engine_testlib import greedy, make_engine, prompts, run_all, run_alone, seeded, tiny_model

from dorarl.config import ConfigError
from dorarl.engine.linear import Linear, choose_kernel, onednn_works

needs_onednn = pytest.mark.skipif(not onednn_works(), reason="no oneDNN in this torch build")
CPU = torch.device("cpu")
# (out, in) of the real model's products (SmolLM2: q|k|v, o, gate|up, down) and tiny ones.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (192, 64), (64, 128)]


def _weights(out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(out_features, in_features, generator=gen) * in_features**-0.5,
        torch.randn(out_features, generator=gen),
    )


@needs_onednn
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 33])
def test_packed_linear_equals_f_linear(shape, rows):
    weight, bias = _weights(*shape, seed=rows)
    x = torch.randn(rows, shape[1])
    residual = torch.randn(rows, shape[0])
    for b in (bias, None):
        packed = Linear(weight, b, "onednn")
        assert packed.kernel == "onednn"
        torch.testing.assert_close(packed(x), F.linear(x, weight, b), atol=1e-5, rtol=1e-5)
        fused = packed.add_to(residual, x)
        assert torch.equal(fused, residual + packed(x))  # the fused add rounds the same


@needs_onednn
@pytest.mark.parametrize("shape", SHAPES)
def test_a_rows_product_does_not_depend_on_the_rows_beside_it(shape):
    weight, bias = _weights(*shape, seed=1)
    packed = Linear(weight, bias, "onednn")
    x = torch.randn(300, shape[1])
    full = packed(x)
    for start, stop in [(0, 1), (7, 8), (0, 2), (3, 36), (100, 300), (299, 300)]:
        assert torch.equal(packed(x[start:stop]), full[start:stop]), (start, stop)


def test_kernel_choice():
    if onednn_works():
        assert choose_kernel("auto", CPU, torch.float32) == "onednn"
    assert choose_kernel("auto", CPU, torch.bfloat16) == "torch"
    assert choose_kernel("torch", CPU, torch.float32) == "torch"
    assert choose_kernel("auto", torch.device("cuda"), torch.float32) == "torch"
    with pytest.raises(ConfigError, match="engine.linear_kernel"):
        choose_kernel("onednn", CPU, torch.bfloat16)


def _logits(engine, prompt: list[int]) -> list[float]:
    engine.add_request("probe", prompt, greedy(3))
    return run_all(engine)["probe"].logprobs


@pytest.mark.parametrize("kernel", ["onednn", "torch"])
def test_load_weights_repacks_the_new_weights(kernel):
    if kernel == "onednn" and not onednn_works():
        pytest.skip("no oneDNN in this torch build")
    old, new = tiny_model("llama", seed=1), tiny_model("llama", seed=2)
    prompt = prompts([9], seed=3)[0]
    swapped = make_engine(old, linear_kernel=kernel)
    swapped.load_weights(new.state_dict(), version=1)
    fresh = make_engine(new, linear_kernel=kernel)
    assert swapped.model.weights.kernel == kernel
    assert _logits(swapped, prompt) == _logits(fresh, prompt)  # bit for bit
    assert _logits(swapped, prompt) != _logits(make_engine(old, linear_kernel=kernel), prompt)


def test_both_kernels_agree():
    if not onednn_works():
        pytest.skip("no oneDNN in this torch build")
    model = tiny_model("qwen2", seed=1)
    prompt = prompts([12], seed=4)[0]
    a = run_alone(model, prompt, greedy(16), linear_kernel="onednn")
    b = run_alone(model, prompt, greedy(16), linear_kernel="torch")
    assert a.output_ids == b.output_ids
    torch.testing.assert_close(
        torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0
    )


@needs_onednn
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_on_onednn_a_request_is_bit_identical_whatever_its_batch(arch):
    """Row-independent products, placement-independent attention and per-row sampling: a
    request's tokens and logprobs do not change by one bit with its companions (same block
    size, its prompt prefilled in one chunk)."""
    model = tiny_model(arch, seed=1)
    prompt = prompts([11], seed=5)[0]
    for params in (greedy(20), seeded(20, seed=3)):
        alone = run_alone(model, prompt, params, prefill_chunk_size=128)
        engine = make_engine(model, prefill_chunk_size=128)
        for i, p in enumerate(prompts([3, 17, 30, 6], seed=9)):
            engine.add_request(f"n{i}", p, seeded(5 + 7 * i, seed=i))
        engine.add_request("x", prompt, params)
        got = run_all(engine)["x"]
        assert got.output_ids == alone.output_ids
        assert got.logprobs == alone.logprobs
