"""Fine-tune the shipped base model into the multi-turn base (`assets/multiturn_base`).

The running_sum base has never seen text after its stop token, so a second turn of
`multiturn_sum` is out of its reach and RL would have nothing to reinforce. This script
starts from `assets/base_model` and imitates multi-turn transcripts (the environment's
reveals, then each turn's answer and <eos>; the loss on the answers only) mixed with
single-turn running_sum demonstrations, with the base script's seeded slip table, so the
result answers every turn in the right form but slips often enough to leave RL room
(greedy episode accuracy well under pass@k). Deterministic for a seed with one thread.

    python scripts/train_multiturn_base.py --out assets/multiturn_base
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from pathlib import Path

import torch
from train_base_model import lr_scale, save, slip_table, slipped_answer
from transformers import LlamaForCausalLM

from dorarl.engine import Engine, EngineConfig, SamplingParams
from dorarl.tasks.episodes import run_episodes
from dorarl.tasks.multiturn_sum import MultiTurnSumTask, chunks, reveal
from dorarl.trainer.batch import plan_micro_batches

log = logging.getLogger("train_multiturn_base")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, default=Path("assets/base_model"))
    ap.add_argument("--out", type=Path, default=Path("assets/multiturn_base"))
    ap.add_argument("--seed", type=int, default=0)
    # The sum carried across a turn boundary is learnt here, not by RL: 300 steps with few
    # single-turn demonstrations teach it; 200 with a quarter single-turn left RL's gains
    # short of +20 points in some seeds.
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--micro-tokens", type=int, default=2048)
    ap.add_argument("--single-turn-share", type=float, default=0.1)
    ap.add_argument("--slip-digits", default="789")
    ap.add_argument("--slip-prob", type=float, default=0.6)
    ap.add_argument("--slip-pair-fraction", type=float, default=0.4)
    ap.add_argument("--probe-prompts", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    return ap.parse_args(argv)


def transcript(task: MultiTurnSumTask, rng: random.Random, args, table) -> tuple[list, list]:
    """(token ids, trained mask) of one demonstrated episode; never a held-out prompt."""
    prompt, _ = task.sample_example(rng, "task")
    prompt = type(prompt)(rng.getrandbits(40), prompt.text, prompt.prompt_ids, prompt.answer)
    parts = chunks(prompt, task.mt.max_chunk, seed=rng.getrandbits(32))
    if rng.random() < args.single_turn_share:
        parts = [[d for c in parts for d in c]]
    items = [d for c in parts for d in c]
    answer = slipped_answer(items, rng, args, table, task.config.modulus)
    ids, mask, offset = list(task.bos_ids), [False] * len(task.bos_ids), 0
    eos = task.tokenizer.eos_token_id
    for chunk in parts:
        obs = task.tokenizer(reveal(chunk, offset), add_special_tokens=False)["input_ids"]
        turn = task.tokenizer(answer[3 * offset : 3 * (offset + len(chunk))])["input_ids"][1:]
        ids += obs + turn + [eos]
        mask += [False] * len(obs) + [True] * (len(turn) + 1)
        offset += len(chunk)
    return ids, mask


def sft_step(model, task, rng: random.Random, args, table) -> float:
    rows = [transcript(task, rng, args, table) for _ in range(args.batch)]
    total = sum(sum(m) for _, m in rows)
    loss_sum = 0.0
    for indices in plan_micro_batches([len(r[0]) for r in rows], args.micro_tokens):
        width = max(len(rows[i][0]) for i in indices)
        ids = torch.full((len(indices), width), task.tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full((len(indices), width), -100, dtype=torch.long)
        for r, i in enumerate(indices):
            seq, mask = rows[i]
            ids[r, : len(seq)] = torch.tensor(seq)
            labels[r, : len(seq)] = torch.where(torch.tensor(mask), torch.tensor(seq), -100)
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), reduction="sum"
        )
        (loss / total).backward()
        loss_sum += loss.item() / total
    return loss_sum


def episode_accuracy(folder: Path, task, samples: int = 0) -> dict:
    """Greedy episode accuracy on held-out prompts through the engine, turn counts too."""
    engine = Engine.from_pretrained(folder, EngineConfig(max_num_seqs=64, max_model_len=256))
    prompts = task.eval_prompts()
    params = SamplingParams(
        temperature=0.0,
        max_new_tokens=task.max_new_tokens,
        stop_token_ids=task.stop_token_ids,
        multi_turn=True,
    )
    results = run_episodes(engine, task, prompts, params)
    turns = [len(e.turns) for e, _ in results.values()]
    rewards = [e.reward for e, _ in results.values()]
    # Accuracy counts full episodes, as the training run's evaluation does; the mean reward
    # also credits the items right before a wrong answer (the task's partial credit).
    return {
        "greedy_accuracy": sum(r >= 1.0 for r in rewards) / len(results),
        "mean_reward": sum(rewards) / len(results),
        "episodes": len(results),
        "turns_max": max(turns),
        "episodes_3_turns_or_more": sum(t >= 3 for t in turns),
    }


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    task = MultiTurnSumTask()
    model = LlamaForCausalLM.from_pretrained(str(args.base))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_scale(s, args))
    rng = random.Random(f"multiturn_base/{args.seed}")
    table = slip_table(args, task.config.modulus)
    start = time.time()
    for step in range(1, args.steps + 1):
        loss = sft_step(model, task, rng, args, table)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        sched.step()
        if step % 50 == 0:
            log.info("step %d loss %.4f (%.0fs)", step, loss, time.time() - start)
    seconds = time.time() - start
    card = {
        "task": "multiturn_sum",
        "from": str(args.base),
        "args": {k: str(v) for k, v in vars(args).items() if k not in ("out", "base")},
        "train_seconds": round(seconds, 1),
    }
    save(model, task, args.out, card)
    card["heldout"] = episode_accuracy(args.out, task)
    (args.out / "base_model_card.json").write_text(json.dumps(card, indent=2) + "\n")
    log.info("saved %s: %s", args.out, card["heldout"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
