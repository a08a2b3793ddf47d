"""`dorarl bench engine-model --backend`: the engine backends side by side on the shipped
tiny base, the same requests and token counts for each; a bad list or a missing vLLM is
one line before any work."""

import json
from pathlib import Path

import pytest

from dorarl.bench import engine_backends
from dorarl.cli import main
from dorarl.engine.vllm.config import INSTALL, vllm_missing

BASE_MODEL = Path(__file__).resolve().parents[2] / "assets" / "base_model"
TINY = ["--batches", "2,3", "--prompt-len", "5", "--new-tokens", "4"]
ROW_KEYS = {
    "tokens", "wall_s", "cpu_s", "tokens_per_s", "tokens_per_cpu_s", "prefill", "decode_steps",
    "step", "threads", "setup", "same_outputs_as_first",
}  # fmt: skip
BOTH = pytest.param(
    "dorarl,vllm",
    marks=[
        pytest.mark.slow,  # a vLLM start: 10-60 s of CPU
        pytest.mark.skipif(vllm_missing() is not None, reason="vLLM is not installed"),
    ],
)


@pytest.mark.parametrize("backends", ["dorarl", BOTH])
def test_backends_do_the_same_tokens_on_the_same_requests(tmp_path, backends):
    argv = ["bench", "engine-model", "--out", str(tmp_path), "--model", str(BASE_MODEL)]
    assert main([*argv, "--backend", backends, *TINY]) == 0
    report = json.loads((tmp_path / "engine.json").read_text())
    run = report["backends"]
    names = backends.split(",")
    assert run["order"] == names and set(run["batches"]) == {"2", "3"}
    assert run["spec"]["new_tokens"] == 4 and run["spec"]["dtype"] == "float32"
    for batch, entry in run["batches"].items():
        rows = entry["backends"]
        assert list(rows) == names
        for row in rows.values():
            assert set(row) == ROW_KEYS
            assert row["tokens"] == int(batch) * 4  # every request exactly new_tokens
            assert row["threads"] == report["threads"] == 1
            assert row["prefill"]["steps"] >= 1 and row["decode_steps"] >= 3
            assert row["tokens_per_s"] > 0 and row["step"]["ms"] > 0
        assert rows[names[0]]["same_outputs_as_first"] == int(batch)
    assert ("vllm" in report["versions"]) == ("vllm" in names)
    if "vllm" in names:
        assert run["vllm_env"]["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"


def test_a_missing_vllm_is_the_one_install_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(engine_backends, "vllm_missing", lambda: INSTALL)
    argv = ["bench", "engine-model", "--out", str(tmp_path), "--model", str(BASE_MODEL)]
    assert main([*argv, "--backend", "dorarl,vllm"]) == 2
    assert capsys.readouterr().err == f"dorarl: error: --backend vllm {INSTALL}\n"
    assert not (tmp_path / "engine.json").exists()


@pytest.mark.parametrize("backends", ["hf", "dorarl,dorarl", ""])
def test_a_bad_backend_list_is_one_line(tmp_path, capsys, backends):
    argv = ["bench", "engine-model", "--out", str(tmp_path), "--model", str(BASE_MODEL)]
    assert main([*argv, "--backend", backends]) == 2
    assert capsys.readouterr().err.startswith("dorarl: error: --backend: a comma-separated")


def test_backends_need_a_model_folder(tmp_path, capsys):
    argv = ["bench", "engine-model", "--out", str(tmp_path), "--shape", "tiny"]
    assert main([*argv, "--backend", "dorarl"]) == 2
    assert capsys.readouterr().err.startswith("dorarl: error: --backend: needs --model DIR")
