"""The real `dorarl model get smollm2-135m-instruct` (once per session, via the
`smollm2_dir` fixture in tests/conftest.py): the folder holds SmolLM2-135M-Instruct (its
shape, tokenizer and chat template), and the engine matched transformers on chat prompts
(the command exits 0 only then)."""

import json
import math
import os

import pytest
from safetensors import safe_open
from transformers import AutoTokenizer

from dorarl.models.verify import CHAT_PROMPTS, verify_folder


@pytest.mark.slow
def test_model_get_smollm2(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    shape = {k: config[k] for k in ("model_type", "num_hidden_layers", "num_attention_heads")}
    assert shape == {"model_type": "llama", "num_hidden_layers": 30, "num_attention_heads": 9}
    assert (config["num_key_value_heads"], config["vocab_size"]) == (3, 49152)
    assert config["tie_word_embeddings"] is True
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert "<|im_start|>" in tokenizer.chat_template
    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as handle:
        names = list(handle.keys())
        count = sum(math.prod(handle.get_slice(n).get_shape()) for n in names)
    assert "lm_head.weight" not in names  # tied: stored once
    assert count == 134_515_008
    if os.environ.get("DORARL_SMOLLM2_DIR"):  # reused folder: the command's check did not run
        report = verify_folder(smollm2_dir, prompts=CHAT_PROMPTS[:2], max_new_tokens=16)
        assert report.ok, "\n".join(report.lines())
