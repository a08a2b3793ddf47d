"""How far each objective's gradient is from GRPO's on one batch as dora K=1 trains it.

From a model folder or checkpoint at version v, the engine samples 2 x `--groups` groups under
v; the trainer takes one step on the first half (v -> v + 1); then each objective's gradient
is taken on the second half, sampled by v and trained at v + 1, one version stale as under
K=1. Printed per objective: its gradient norm, its distance from GRPO's (relative to GRPO's
norm) and their cosine; and the tokens GRPO's clip stops (negative advantage and ratio under
1 - eps_low, positive and over 1 + eps_high), the ones CISPO keeps a gradient for.

    python scripts/objective_gradients.py --model RUN/checkpoints/version_00010 \\
        --config configs/smollm2-arith.yaml --objectives cispo,gspo --out grads.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import torch

from dorarl.config import load_config
from dorarl.data import Group, Sample
from dorarl.engine import SamplingParams
from dorarl.engine.instance import close_engine, open_engine
from dorarl.jobs.config import TrainConfig
from dorarl.jobs.model_defaults import with_model_defaults
from dorarl.jobs.workload import build_task
from dorarl.run_layout import STATE_FILE
from dorarl.tasks.base import Prompt, Task
from dorarl.tasks.scoring import score_all
from dorarl.trainer import Trainer
from dorarl.trainer.advantages import step_advantages
from dorarl.trainer.checkpoint import read_state
from dorarl.trainer.config import LossConfig
from dorarl.trainer.loss import token_logprobs
from dorarl.trainer.objective_presets import check_objectives, objective_loss


def sample_groups(
    train: TrainConfig, task: Task, folder: Path, version: int, prompts: list[Prompt]
) -> list[Group]:
    """One group per prompt, sampled by the weights in `folder` at the run's settings."""
    engine = open_engine(folder, train.engine, version=version)
    size, s = train.group_size, train.sampling
    for g, prompt in enumerate(prompts):
        for i in range(size):
            params = SamplingParams(
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k,
                max_new_tokens=s.max_new_tokens or task.max_new_tokens,
                stop_token_ids=list(task.stop_token_ids),
                seed=train.seed * 1_000_003 + version * 10_007 + g * size + i,
            )
            engine.add_request(f"{g}-{i}", list(prompt.prompt_ids), params)
    outputs = {}
    while engine.has_unfinished():
        outputs.update({o.request_id: o for o in engine.step()})
    close_engine(engine)
    groups = []
    for g, prompt in enumerate(prompts):
        outs = [outputs[f"{g}-{i}"] for i in range(size)]
        scored = score_all(task, [(prompt, o.output_ids) for o in outs])
        samples = [
            Sample(
                group_id=g,
                sample_index=i,
                prompt_id=prompt.prompt_id,
                prompt_ids=list(o.prompt_ids),
                response_ids=list(o.output_ids),
                logprobs=list(o.logprobs),
                versions=list(o.versions),
                finish_reason=o.finish_reason,
                reward=score.reward,
            )
            for i, (o, score) in enumerate(zip(outs, scored, strict=True))
        ]
        groups.append(Group(g, prompt.prompt_id, version, samples))
    return groups


def flat_gradient(trainer: Trainer, groups: list[Group], loss: LossConfig) -> torch.Tensor:
    """The whole batch's gradient under `loss`, float64, as one vector."""
    trainer.config.loss = loss
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.accumulate_gradients(groups)
    grads = [p.grad.reshape(-1) for p in trainer.model.parameters() if p.grad is not None]
    return torch.cat(grads).double()


def clipped_tokens(
    trainer: Trainer, groups: list[Group], loss: LossConfig, decode
) -> list[dict[str, Any]]:
    """The tokens PPO's clip takes the gradient from: (text, ratio, position, length,
    behaviour log-prob, advantage sign)."""
    rewards = [[s.reward for s in g.samples] for g in groups]
    advantages = step_advantages(rewards, loss.advantage, loss.normalize_std, loss.adv_eps)
    low, high = 1 - loss.eps_low, 1 + loss.eps_high
    found = []
    with torch.no_grad():
        for group, advs in zip(groups, advantages, strict=True):
            for sample, adv in zip(group.samples, advs, strict=True):
                if adv == 0 or not sample.response_ids:
                    continue
                ids = torch.tensor([sample.prompt_ids + sample.response_ids])
                logits = trainer.model(input_ids=ids).logits[:, :-1]
                logp = token_logprobs(logits, ids[:, 1:], trainer.config.temperature)[0]
                logp = logp[len(sample.prompt_ids) - 1 :]
                ratio = torch.exp(logp - torch.tensor(sample.logprobs)).tolist()
                for t, r in enumerate(ratio):
                    if (adv < 0 and r < low) or (adv > 0 and r > high):
                        found.append(
                            {
                                "token": decode([sample.response_ids[t]]),
                                "ratio": round(r, 3),
                                "position": t,
                                "length": len(sample.response_ids),
                                "behavior_logp": round(float(sample.logprobs[t]), 3),
                                "advantage": "+" if adv > 0 else "-",
                            }
                        )
    return found


def compare(train: TrainConfig, folder: Path, groups_per_half: int, objectives: list[str]):
    task = build_task(train, str(train.model))
    resumable = (folder / STATE_FILE).is_file()
    version = int(read_state(folder)["version"]) if resumable else 0
    rng = random.Random(train.seed * 7_919 + version)
    prompts = rng.sample(list(task.train_prompts()), 2 * groups_per_half)
    groups = sample_groups(train, task, folder, version, prompts)
    config = dataclasses.replace(train.trainer, skip_zero_advantage=False)
    if resumable:
        trainer, _ = Trainer.resume(folder, config)
    else:
        trainer = Trainer.from_pretrained(folder, config)
    trainer.train_step(groups[:groups_per_half])  # v -> v + 1
    stale = groups[groups_per_half:]
    base = train.trainer.loss
    grpo = flat_gradient(trainer, stale, objective_loss("grpo", base))
    rows = [{"objective": "grpo", "norm": float(grpo.norm()), "distance": 0.0, "cosine": 1.0}]
    for name in objectives:
        grad = flat_gradient(trainer, stale, objective_loss(name, base))
        rows.append(
            {
                "objective": name,
                "norm": float(grad.norm()),
                "distance": float((grad - grpo).norm() / grpo.norm()),
                "cosine": float(grad @ grpo / (grad.norm() * grpo.norm())),
            }
        )
    clipped = clipped_tokens(trainer, stale, objective_loss("grpo", base), task.tokenizer.decode)
    tokens = sum(len(s.response_ids) for g in stale for s in g.samples)
    rewards = [s.reward for g in stale for s in g.samples]
    return {
        "model": str(folder),
        "version": version,
        "stale_groups": len(stale),
        "tokens": tokens,
        "reward_mean": sum(rewards) / len(rewards),
        "objectives": rows,
        "clipped_by_grpo": clipped,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a model folder or a run's checkpoint")
    parser.add_argument("--config", default=None, help="a dorarl train config (YAML)")
    parser.add_argument("--groups", type=int, default=8, help="groups in each half")
    parser.add_argument("--objectives", default="cispo", help="compared with grpo, by name")
    parser.add_argument("--out", type=Path, default=None, help="write the result (JSON)")
    parser.add_argument("overrides", nargs="*", help="key=value over the config")
    args = parser.parse_args(argv)
    names = [n for n in args.objectives.split(",") if n]
    check_objectives(names, "--objectives")
    train = load_config(TrainConfig, args.config, [*args.overrides, f"model={args.model}"])
    train, _ = with_model_defaults(train, str(train.model), None)
    result = compare(train, Path(args.model), args.groups, names)
    for row in result["objectives"]:
        print(f"{row['objective']:>14}  norm {row['norm']:.4g}  distance {row['distance']:.3f}  "
              f"cosine {row['cosine']:.4f}")  # fmt: skip
    print(f"{len(result['clipped_by_grpo'])} of {result['tokens']} tokens clipped by GRPO")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
