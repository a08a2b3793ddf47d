"""`dorarl bench trainer` on a tiny shape: the packed, padded, HF and torch-ops contenders, the
floor, the peak memory of a first step and of one with AdamW state, trainer.json."""

import json

import pytest
from transformers import LlamaConfig

from dorarl.bench import trainer as bench
from dorarl.bench.matmul_floor import MicroShape, step_shapes
from dorarl.bench.shapes import SHAPES
from dorarl.errors import UserInputError


def test_quick_bench_on_a_tiny_shape_writes_its_report(tmp_path, capsys):
    assert bench.main(["--shape", "tiny", "--quick", "--profile", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "trainer.json").read_text())
    work = report["workload"]
    positions = work["positions"]
    assert work["samples"] == 8 and positions["padded"] >= work["tokens"]
    # One group: its prompt once, then its responses, in fewer positions than the samples.
    prompt = bench.QUICK.prompt_len
    assert positions["shared_prompt"] == work["response_tokens"] + prompt < work["tokens"]
    # the trainer with its fused CPU kernels and without them (they build on every CI machine)
    contenders = {"trainer", "trainer_padded", "hf", "trainer_torch_ops"}
    for name in (*contenders, "floor"):
        assert report["tokens_per_s"][name] > 0 and report["ms_per_step"][name] > 0
    assert report["ms_per_step"]["floor"] == pytest.approx(report["floor_ms"]["total"])
    assert report["floor_ms"]["output_layer"] > 0 and report["floor_ms"]["attention"] > 0
    assert 0 < report["train_step"]["peak_memory_gb"] < 64
    first, with_adamw = report["train_step"]["peak_memory_gb_per_step"]  # two full steps
    assert report["train_step"]["peak_memory_gb"] == max(first, with_adamw)
    assert report["trainer_config"]["activation_checkpointing"] is False
    assert set(report["peak_memory_gb"]) == contenders
    assert set(report["bars"]) == {"trainer_vs_hf", "packed_vs_padded", "peak_memory_gb"}
    assert set(report["agreement"]) >= {"loss", "grad_norm", "entropy"}
    assert max(report["agreement"].values()) < 1e-4
    profile = report["profile"]  # one packed forward+backward by op, the largest first
    ops = profile["ops"]
    assert "aten::mm" in {op["op"] for op in ops} and 0 < profile["matrix_products_share"] < 1
    assert [op["self_ms"] for op in ops] == sorted((op["self_ms"] for op in ops), reverse=True)
    assert sum(op["self_ms"] for op in ops) <= profile["self_ms"] * (1 + 1e-9)
    printed = capsys.readouterr().out
    assert "trainer bench" in printed and "packed trainer by op" in printed


def test_unknown_shape_is_a_user_error():
    with pytest.raises(UserInputError, match="--shape"):
        bench.build_model("no-such-shape", None)


def test_workload_is_long_tailed_and_capped():
    groups = bench.make_groups(bench.FULL, vocab=100)
    lengths = sorted(len(s.response_ids) for g in groups for s in g.samples)
    assert len(lengths) == 64 and lengths[-1] == bench.FULL.max_len
    assert lengths[0] < bench.FULL.median_len < lengths[-1]
    assert all(len(s.logprobs) == len(s.response_ids) for g in groups for s in g.samples)


def test_floor_counts_every_multiply_of_the_step():
    config = LlamaConfig(**SHAPES["smollm2-135m"])
    micro = [MicroShape(rows=4, width=100, response_tokens=150), MicroShape(2, 60, 40)]
    linears, attention = step_shapes(config, micro)
    hidden, inter, vocab, layers = 576, 1536, 49152, 30
    per_token = hidden * 576 * 2 + hidden * 192 * 2 + 3 * hidden * inter  # q, o, k, v, mlp
    expected = layers * (400 + 120) * per_token + (150 + 40) * hidden * vocab
    assert sum(n * s.tokens * s.fan_in * s.fan_out for s, n in linears.items()) == expected
    assert {(s.batch, s.width, s.head_dim): n for s, n in attention.items()} == {
        (36, 100, 64): layers,
        (18, 60, 64): layers,
    }
