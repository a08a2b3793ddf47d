"""GGUF -> Hugging Face folder on tiny GGUFs written here: files, tied embeddings, exact
weights, and logits equal to transformers' own GGUF load; the engine agrees."""

import json
import os

import gguf
import pytest
import torch
from safetensors import safe_open
from tiny_gguf import tiny_model, write_gguf
from transformers import AutoModelForCausalLM, AutoTokenizer

from dorarl.cli import main
from dorarl.models.convert import convert_gguf
from dorarl.models.verify import render_chat, verify_folder

Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_f32_gguf_converts_to_the_exact_weights(tmp_path, family):
    original = tiny_model(family, seed=1)
    path = write_gguf(tmp_path / "m.gguf", original, Q.F32)
    converted = convert_gguf(path, tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(str(converted.folder)).eval()
    # llama.cpp permutes llama's q/k rows; the conversion must undo it exactly.
    want, got = original.state_dict(), reloaded.state_dict()
    assert set(want) == set(got)
    for name, tensor in want.items():
        assert torch.equal(tensor, got[name]), name


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_q8_folder_reloads_with_the_gguf_logits(tmp_path, family):
    path = write_gguf(tmp_path / "m.gguf", tiny_model(family, seed=2), Q.Q8_0)
    converted = convert_gguf(path, tmp_path / "out")
    folder = converted.folder
    names = {p.name for p in converted.files()}
    umask = os.umask(0)
    os.umask(umask)
    assert {p.stat().st_mode & 0o777 for p in converted.files()} == {0o666 & ~umask}
    assert {"config.json", "model.safetensors", "generation_config.json"} <= names
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= names
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == family
    assert config["tie_word_embeddings"] is True
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2
    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        stored = set(handle.keys())
    assert "lm_head.weight" not in stored  # tied: stored once

    from_gguf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf").eval()
    from_folder = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    assert from_folder.lm_head.weight.data_ptr() == from_folder.model.embed_tokens.weight.data_ptr()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    ids = torch.tensor([render_chat(tokenizer, "the cat is here")])
    assert tokenizer.decode(ids[0]).startswith("<|im_start|>user\n")
    with torch.inference_mode():
        assert torch.equal(from_gguf(ids).logits, from_folder(ids).logits)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_engine_matches_transformers_on_the_converted_folder(tmp_path, family):
    model = tiny_model(family, seed=3)
    with torch.no_grad():  # sharper logits than a 0.02 init, so greedy outputs vary
        for param in model.parameters():
            if param.ndim == 2:
                param.mul_(8.0)
    converted = convert_gguf(write_gguf(tmp_path / "m.gguf", model, Q.Q8_0), tmp_path / "out")
    report = verify_folder(converted.folder, reference=converted.model, max_new_tokens=16)
    assert report.ok, "\n".join(report.lines())
    assert report.reload_max_logit_diff == 0.0
    responses = {p.response for p in report.prompts}
    assert len(responses) > 1 and sum(p.tokens for p in report.prompts) > 8


def test_model_convert_command_writes_and_verifies(tmp_path, capsys):
    path = write_gguf(tmp_path / "m.gguf", tiny_model("llama"), Q.Q8_0)
    assert main(["model", "convert", str(path), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "model.safetensors" in printed and "verification: passed" in printed
    assert "llama: 0.1M parameters, 2 layers, 4/2 heads" in printed


def test_an_empty_out_folder_is_accepted(tmp_path):
    (tmp_path / "out").mkdir()
    path = write_gguf(tmp_path / "m.gguf", tiny_model("llama"), Q.F32)
    assert (convert_gguf(path, tmp_path / "out").folder / "config.json").is_file()
