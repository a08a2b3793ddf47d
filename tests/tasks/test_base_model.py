"""The shipped base model: architecture and size, tokenizer, and an accuracy that leaves room for RL.

Accuracy is measured on a fixed subset of the held-out set with Hugging Face `generate`
and, as a cross-check, through the rollout engine (both greedy: they must agree).
"""

import json

import pytest
import torch
from hf_sampling import accuracy_and_pass_at_k, hf_generate
from transformers import AutoModelForCausalLM, AutoTokenizer

from dorarl.tasks import make_task
from dorarl.tasks.assets import BASE_MODEL_DIR, shipped_base_model
from dorarl.tasks.chartok import build_char_tokenizer
from dorarl.tasks.evaluate import evaluate

SUBSET = 200


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(str(shipped_base_model()))


@pytest.fixture(scope="module")
def task():
    return make_task("running_sum", seed=0)


def test_shipped_folder_is_a_small_llama_with_our_tokenizer(model):
    config = json.loads((BASE_MODEL_DIR / "config.json").read_text())
    assert config["model_type"] in ("llama", "qwen2")
    params = sum(p.numel() for p in model.parameters())
    assert 1_000_000 <= params <= 5_000_000
    size = sum(f.stat().st_size for f in BASE_MODEL_DIR.iterdir() if f.is_file())
    assert size <= 20 * 2**20
    tok = AutoTokenizer.from_pretrained(str(BASE_MODEL_DIR))
    assert tok.get_vocab() == build_char_tokenizer().get_vocab()
    assert (BASE_MODEL_DIR / "generation_config.json").exists()


def test_greedy_accuracy_is_in_the_band_that_leaves_room_for_rl(model, task):
    prompts = task.eval_prompts()[:SUBSET]
    responses = hf_generate(model, task, prompts)
    accuracy = sum(task.reward(p, r[0]) for p, r in zip(prompts, responses, strict=True)) / SUBSET
    assert 0.10 <= accuracy <= 0.50, accuracy


def test_engine_greedy_evaluation_agrees_with_transformers(model, task):
    from dorarl.engine import Engine, EngineConfig

    prompts = task.eval_prompts()[:64]
    engine = Engine.from_pretrained(
        BASE_MODEL_DIR, EngineConfig(max_num_seqs=64, max_model_len=128)
    )
    result = evaluate(engine, task, prompts)
    responses = hf_generate(model, task, prompts)
    hf_accuracy = sum(task.reward(p, r[0]) for p, r in zip(prompts, responses, strict=True)) / 64
    assert result["n"] == 64
    assert result["accuracy"] == pytest.approx(hf_accuracy, abs=2 / 64)
    engine.add_request("busy", prompts[0].prompt_ids)
    with pytest.raises(ValueError, match="idle engine"):
        evaluate(engine, task, prompts)


def test_sampling_finds_correct_answers_greedy_misses(model, task):
    torch.manual_seed(0)
    figures = accuracy_and_pass_at_k(model, task, task.eval_prompts()[:64], k=8)
    assert figures["pass@8"] >= figures["greedy_accuracy"] + 0.15, figures
