"""`dorarl bench weights`: the Qwen2-0.5B shape by its Hugging Face names, `--params` scaling
it, and a small run writing weights.json with every row for both transports."""

import json

import pytest

from dorarl.bench.weights import ROWS, TRANSPORTS, qwen2_shapes
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


@pytest.mark.slow
def test_a_small_run_writes_every_row_for_both_transports(tmp_path):
    assert (
        main(["bench", "weights", "--out", str(tmp_path), "--quick", "--params", "16000000"]) == 0
    )
    report = json.loads((tmp_path / "weights.json").read_text())
    for kind in TRANSPORTS:
        assert set(report["results"][kind]) == set(ROWS)
        assert all(row["s"] > 0 and row["gb_per_s"] > 0 for row in report["results"][kind].values())
