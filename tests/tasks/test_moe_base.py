"""The shipped MoE base (assets/moe_base): a Mixtral upcycled from the dense base, remade bit
for bit by its script, a few MB, and as accurate as the dense base it came from."""

import json

import pytest
import torch
from hf_sampling import hf_generate
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from upcycle_base_model import main as upcycle

from dorarl.engine import Engine, EngineConfig
from dorarl.tasks import make_task
from dorarl.tasks.assets import MOE_BASE_DIR
from dorarl.tasks.evaluate import evaluate

SUBSET = 64


def test_the_script_remakes_the_shipped_weights_bit_for_bit(tmp_path):
    assert upcycle(["--out", str(tmp_path), "--no-eval"]) == 0
    shipped = load_file(str(MOE_BASE_DIR / "model.safetensors"))
    remade = load_file(str(tmp_path / "model.safetensors"))
    assert shipped.keys() == remade.keys()
    for name, tensor in shipped.items():
        assert torch.equal(tensor, remade[name]), name


def test_the_folder_is_a_small_mixtral_as_accurate_as_the_dense_base():
    config = json.loads((MOE_BASE_DIR / "config.json").read_text())
    assert config["model_type"] == "mixtral" and config["num_local_experts"] == 4
    size = sum(f.stat().st_size for f in MOE_BASE_DIR.iterdir() if f.is_file())
    assert size <= 10 * 2**20
    card = json.loads((MOE_BASE_DIR / "base_model_card.json").read_text())
    assert 0.10 <= card["heldout"]["greedy_accuracy"] <= 0.50
    dense = card["heldout_dense_base"]["greedy_accuracy"]
    assert card["heldout"]["greedy_accuracy"] == pytest.approx(dense, abs=0.02)


@pytest.mark.usefixtures("single_thread")
def test_engine_greedy_evaluation_agrees_with_transformers():
    task = make_task("running_sum", seed=0)
    prompts = task.eval_prompts()[:SUBSET]
    engine = Engine.from_pretrained(MOE_BASE_DIR, EngineConfig(max_num_seqs=64, max_model_len=128))
    result = evaluate(engine, task, prompts)
    model = AutoModelForCausalLM.from_pretrained(str(MOE_BASE_DIR), dtype=torch.float32).eval()
    responses = hf_generate(model, task, prompts)
    hf_accuracy = sum(task.reward(p, r[0]) for p, r in zip(prompts, responses, strict=True))
    assert result["accuracy"] == pytest.approx(hf_accuracy / SUBSET, abs=2 / SUBSET)
