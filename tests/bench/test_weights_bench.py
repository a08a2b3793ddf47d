"""`dorarl bench weights`: the Qwen2-0.5B shape by its Hugging Face names, `--params` scaling
it, an adapter's A and B named and shaped as peft makes them, and a small run writing
weights.json with every row for both transports, full weights and adapter."""

import json

import pytest
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

from dorarl.bench.shapes import random_llama
from dorarl.bench.weights import ROWS, TRANSPORTS, adapter_shapes, model_shapes, qwen2_shapes
from dorarl.cli import main


def _params(shapes) -> int:
    total = 0
    for shape in shapes.values():
        n = 1
        for size in shape:
            n *= size
        total += n
    return total


def test_the_default_is_qwen2_05b_with_tied_embeddings_sent_once():
    shapes = qwen2_shapes(None)
    assert 490e6 < _params(shapes) < 500e6  # Qwen2-0.5B: 494M
    assert "lm_head.weight" not in shapes and shapes["model.embed_tokens.weight"] == (151936, 896)
    assert shapes["model.layers.23.self_attn.k_proj.bias"] == (128,)


@pytest.mark.parametrize("params", [16_000_000, 300_000_000])
def test_params_scales_the_shape(params):
    assert 0.7 * params < _params(qwen2_shapes(params)) < 1.3 * params


def test_adapter_shapes_are_pefts_on_every_linear_layer():
    model = random_llama("tiny")
    peft = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    want = {n: tuple(t.shape) for n, t in get_peft_model_state_dict(peft).items()}
    assert adapter_shapes(model_shapes("tiny"), 4) == want


def test_the_shapes_send_what_was_measured_before():
    """SmolLM2-135M: 269.0 MB in bf16, its rank-16 adapter 9.8 MB; Qwen2-0.5B: 988.1, 17.6."""
    for shape, full_mb, adapter_mb in (("smollm2-135m", 269.0, 9.8), ("qwen2-0.5b", 988.1, 17.6)):
        full = model_shapes(shape)
        assert round(_params(full) * 2 / 1e6, 1) == full_mb
        assert round(_params(adapter_shapes(full, 16)) * 2 / 1e6, 1) == adapter_mb


@pytest.mark.slow
def test_a_small_run_writes_every_row_for_both_transports(tmp_path):
    argv = ["bench", "weights", "--out", str(tmp_path), "--quick", "--params", "16000000"]
    assert main(argv) == 0
    report = json.loads((tmp_path / "weights.json").read_text())
    full, adapter = report["cases"]
    assert (full["payload"], adapter["payload"]) == ("full", "adapter")
    assert adapter["bytes_per_version"] < full["bytes_per_version"] / 10
    for case in (full, adapter):
        for kind in TRANSPORTS:
            rows = case["results"][kind]
            assert set(rows) == set(ROWS)
            assert all(row["s"] > 0 and row["gb_per_s"] > 0 for row in rows.values())
