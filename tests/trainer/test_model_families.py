"""Each supported family through the trainer and back into the engine: Llama 3 (scaled
RoPE), Qwen2 / Qwen2.5 (tied), Qwen3 (q/k norms, tied and untied), and the MoE families:
Qwen3-MoE, Qwen2-MoE (shared expert, a dense layer) and Mixtral.

A trained step's weights go to an engine by name (`load_weights`) and the engine then
computes the trainer's own log-probabilities; a checkpoint loads into an engine as it is.
"""

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from dorarl.engine import Engine, EngineConfig, SamplingParams
from dorarl.trainer import Trainer, TrainerConfig

SHAPE = dict(
    vocab_size=101,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
    eos_token_id=2,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 50000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
FAMILIES = {
    "llama3": lambda: LlamaConfig(**SHAPE, rope_parameters=LLAMA3_ROPE),
    "qwen2.5-tied": lambda: Qwen2Config(**SHAPE, tie_word_embeddings=True),
    "qwen3": lambda: Qwen3Config(**SHAPE, head_dim=16),
    "qwen3-tied": lambda: Qwen3Config(**SHAPE, head_dim=8, tie_word_embeddings=True),
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **SHAPE, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        norm_topk_prob=True,
    ),
    "qwen2_moe": lambda: Qwen2MoeConfig(
        **SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, mlp_only_layers=[0],
    ),
    "mixtral": lambda: MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2),
}  # fmt: skip


def _save(folder, family: str):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES[family]())
    with torch.no_grad():  # norms away from one, so a dropped q/k norm would show
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(str(folder))
    return folder


def _engine_logprobs(engine: Engine, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    greedy = SamplingParams(temperature=0.0, max_new_tokens=n, stop_token_ids=[])
    engine.add_request("r", prompt, greedy)
    while engine.has_unfinished():
        for out in engine.step():
            return out.output_ids, out.logprobs
    raise AssertionError("the engine finished no request")


def _hf_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(1, torch.tensor(output)[:, None]).squeeze(1)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_trained_weights_reach_the_engine_and_the_checkpoint(tmp_path, make_groups, family):
    folder = _save(tmp_path / "model", family)
    trainer = Trainer.from_pretrained(folder, TrainerConfig(lr=1e-2))
    assert trainer.split is not None  # the chunked output layer applies to every family
    assert trainer.train_step(make_groups(seed=9))["update_applied"] == 1.0
    config = EngineConfig(max_num_seqs=2, max_model_len=128, block_size=4)
    engine = Engine.from_pretrained(folder, config)
    engine.load_weights(trainer.named_tensors(), version=1)
    prompt = list(range(3, 43))  # 40 tokens + 40 new: past 32 / 8, where llama3 scaling acts
    output, logprobs = _engine_logprobs(engine, prompt, 40)
    trainer.model.eval()
    want = _hf_logprobs(trainer.model, prompt, output)
    torch.testing.assert_close(torch.tensor(logprobs), want, atol=1e-4, rtol=0)
    checkpoint = trainer.save_checkpoint(tmp_path / "ckpt")
    reloaded = Engine.from_pretrained(checkpoint, config)
    trained = engine.state_dict()
    assert set(reloaded.state_dict()) == set(trained)
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
