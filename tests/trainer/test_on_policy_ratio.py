"""Fresh on-policy data has importance ratio 1: the engine records each token's logprob under
the same distribution the trainer computes (softmax of logits / T), whatever the filtering."""

import pytest
import torch

from dorarl.data import Group, Sample
from dorarl.engine import Engine, EngineConfig, SamplingParams
from dorarl.trainer import Trainer, TrainerConfig
from dorarl.trainer.loss import token_logprobs

# Every kind of option SamplingSection accepts: temperature > 0, top_p in (0, 1], top_k >= 0.
SAMPLING = [
    (1.0, 1.0, 0),
    (0.7, 1.0, 0),
    (1.5, 1.0, 0),
    (1.0, 0.9, 0),
    (0.6, 0.5, 0),
    (1.0, 1.0, 50),
    (1.0, 1.0, 5),
    (0.8, 1.0, 1),
    (1.2, 0.8, 10),
    (0.5, 0.95, 3),
]


pytestmark = pytest.mark.usefixtures("single_thread")


def _on_policy_groups(trainer: Trainer, params: SamplingParams) -> list[Group]:
    """Groups sampled by an engine holding exactly the trainer's current weights."""
    engine = Engine.from_hf_config(
        trainer.model.config,
        EngineConfig(max_num_seqs=8, block_size=4, num_blocks=64, max_model_len=64),
        trainer.named_tensors(),
        trainer.version,
    )
    gen = torch.Generator().manual_seed(3)
    prompts = [[1] + torch.randint(4, 60, (n,), generator=gen).tolist() for n in (5, 9)]
    for g, prompt in enumerate(prompts):
        for i in range(4):
            engine.add_request(f"{g}-{i}", prompt, params)
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    groups = []
    for g, prompt in enumerate(prompts):
        samples = []
        for i in range(4):
            out = outs[f"{g}-{i}"]
            samples.append(
                Sample(
                    group_id=g,
                    sample_index=i,
                    prompt_id=g,
                    prompt_ids=prompt,
                    response_ids=out.output_ids,
                    logprobs=out.logprobs,
                    versions=[trainer.version] * len(out.output_ids),
                    finish_reason=out.finish_reason,
                    reward=float(i % 2),
                )
            )
        groups.append(Group(group_id=g, prompt_id=g, version=trainer.version, samples=samples))
    return groups


def _token_ratios(trainer: Trainer, groups: list[Group]) -> torch.Tensor:
    ratios = []
    for s in (s for g in groups for s in g.samples):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = trainer.model(input_ids=ids).logits[:, :-1]
        logp = token_logprobs(logits, ids[:, 1:], trainer.config.temperature)
        ratios.append((logp[0, len(s.prompt_ids) - 1 :] - torch.tensor(s.logprobs)).exp())
    return torch.cat(ratios)


@pytest.mark.parametrize("temperature, top_p, top_k", SAMPLING)
def test_fresh_on_policy_data_has_ratio_one(tiny_model_dir, temperature, top_p, top_k):
    trainer = Trainer.from_pretrained(tiny_model_dir, TrainerConfig(temperature=temperature))
    params = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=12, seed=7
    )
    groups = _on_policy_groups(trainer, params)
    ratios = _token_ratios(trainer, groups)
    assert ratios.numel() > 20
    worst = (ratios - 1).abs().max().item()
    assert worst < 1e-5, f"max |ratio - 1| = {worst:.3g}, mean ratio {ratios.mean():.4f}"
    # The trainer's own step sees the same thing: nothing clipped, mean and max ratio 1.
    metrics = trainer.accumulate_gradients(groups)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["clip_frac_low"] == 0.0 and metrics["clip_frac_high"] == 0.0
