"""Pre-train the shipped base model on running_sum demonstrations with systematic slips.

The base model must leave room for RL: a greedy accuracy of roughly 10-50% while sampling
still finds correct answers often (pass@8 well above greedy), so that GRPO groups have
reward variance. We get there the way real base models get there, by imitating imperfect
demonstrations. A fixed, seeded slip table maps 40% of all (sum so far, digit) pairs to a
wrong new sum; a demonstration writes that wrong sum with probability `--slip-prob` (> 0.5)
and carries on from it. The model learns the task (labels, copying each item, the running
sum, stopping) and the slips, so greedy decoding takes a slip while sampling takes the
correct sum `1 - slip_prob` of the time. RL has to fix about 40 independent mistakes,
which gives a gradual learning curve rather than one flip. Lists are drawn with a uniform
item count (more long lists than the task: a denser signal for learning the lookup),
never a held-out prompt. Training runs a fixed number of steps (warmup, cosine decay);
the result is measured on the full held-out set (greedy accuracy, pass@k) and saved as a
HF folder with base_model_card.json. Deterministic for a seed with one thread.

    python scripts/train_base_model.py --out assets/base_model
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import time
from pathlib import Path

import torch
from hf_sampling import accuracy_and_pass_at_k, hf_generate
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from dorarl.tasks import Prompt, RunningSumTask
from dorarl.tasks.running_sum import LABELS
from dorarl.trainer.batch import plan_micro_batches

log = logging.getLogger("train_base_model")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("assets/base_model"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--micro-tokens", type=int, default=1024)
    ap.add_argument(
        "--lengths",
        choices=["task", "uniform"],
        default="uniform",
        help="item-count distribution of the SFT lists",
    )
    ap.add_argument("--slip-digits", default="789", help="items with these digits may slip")
    ap.add_argument(
        "--slip-prob",
        type=float,
        default=0.6,
        help="probability that a demonstration writes the wrong sum of a slip pair",
    )
    ap.add_argument(
        "--slip-pair-fraction",
        type=float,
        default=0.4,
        help="slip on this fraction of (sum, digit) pairs; 0: on the --slip-digits instead",
    )
    ap.add_argument("--probe-every", type=int, default=50)
    ap.add_argument("--probe-prompts", type=int, default=200)
    ap.add_argument("--pass-k", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--snapshots",
        type=Path,
        default=None,
        help="also save the model at every probe into this folder (for studies)",
    )
    return ap.parse_args(argv)


def build_model(task: RunningSumTask, args: argparse.Namespace) -> LlamaForCausalLM:
    tok = task.tokenizer
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return LlamaForCausalLM(config)


def slip_table(args, modulus: int) -> dict[tuple[int, int], int]:
    """(sum so far, digit) -> the wrong new sum a demonstration may write instead.

    Default: `slip_pair_fraction` of all (sum, digit) pairs, drawn with the seed, each with
    its own wrong result (independent mistakes, so RL has many to fix). With a fraction of
    0: every item whose digit is in `slip_digits` may be added one too many (one shared
    mistake; RL fixes it in a few steps).
    """
    pairs = [(s, d) for s in range(modulus) for d in range(modulus)]
    if args.slip_pair_fraction <= 0:
        return {(s, d): (s + d + 1) % modulus for s, d in pairs if str(d) in args.slip_digits}
    rng = random.Random(f"slip_table/{args.seed}")
    chosen = rng.sample(pairs, round(args.slip_pair_fraction * len(pairs)))
    return {(s, d): (s + d + rng.randrange(1, modulus)) % modulus for s, d in chosen}


def slipped_answer(items: list[int], rng: random.Random, args, table: dict, modulus: int) -> str:
    """The running-sum answer of a demonstration that slips on table pairs w.p. slip_prob."""
    total, parts = 0, []
    for label, d in zip(LABELS, items, strict=False):
        wrong = table.get((total, d))
        slip = wrong is not None and rng.random() < args.slip_prob
        total = wrong if slip else (total + d) % modulus
        parts.append(f"{label}{d}{total}")
    return "".join(parts)


def demonstration(
    task: RunningSumTask, rng: random.Random, args, table: dict
) -> tuple[Prompt, list[int]]:
    prompt, _ = task.sample_example(rng, args.lengths)
    items = [int(ch) for ch in prompt.text[1:-1:2]]
    answer = slipped_answer(items, rng, args, table, task.config.modulus)
    return prompt, task.answer_ids(Prompt(prompt.prompt_id, prompt.text, prompt.prompt_ids, answer))


def collate(rows: list, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded prompt+answer rows and next-token labels (-100 off the answer)."""
    width = max(len(p.prompt_ids) + len(a) for p, a in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (p, answer) in enumerate(rows):
        seq = p.prompt_ids + answer
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(p.prompt_ids) : len(seq)] = torch.tensor(answer)
    return ids, labels[:, 1:]


def sft_step(model, task: RunningSumTask, rng: random.Random, args, table: dict) -> float:
    """Token-mean cross-entropy over a batch of fresh demonstrations (gradient accumulated).

    Every batch mixes lengths, which keeps the gradient unbiased across lengths; the
    micro-batches group similar lengths, which keeps padding (CPU time) low.
    """
    rows = [demonstration(task, rng, args, table) for _ in range(args.batch)]
    total = sum(len(a) for _, a in rows)
    loss_sum = 0.0
    for indices in plan_micro_batches(
        [len(p.prompt_ids) + len(a) for p, a in rows], args.micro_tokens
    ):
        ids, labels = collate([rows[i] for i in indices], task.tokenizer.pad_token_id)
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
        loss = (
            torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum"
            )
            / total
        )
        loss.backward()
        loss_sum += loss.item()
    return loss_sum


def lr_scale(step: int, args) -> float:
    """Linear warmup, then cosine decay to 10% at the last step."""
    if step < args.warmup:
        return (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))


def probe_accuracy(model, task: RunningSumTask, prompts: list[Prompt]) -> float:
    responses = hf_generate(model, task, prompts)
    return sum(task.reward(p, r[0]) for p, r in zip(prompts, responses, strict=True)) / len(prompts)


def train(args: argparse.Namespace, task: RunningSumTask) -> tuple[LlamaForCausalLM, list[dict]]:
    torch.manual_seed(args.seed)
    model = build_model(task, args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_scale(s, args))
    rng = random.Random(f"base_model/{args.seed}")
    table = slip_table(args, task.config.modulus)
    curve, start = [], time.time()
    for step in range(1, args.steps + 1):
        loss = sft_step(model, task, rng, args, table)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        sched.step()
        if step % args.probe_every == 0 or step == args.steps:
            curve.append(probe(model, task, args, step, loss, time.time() - start))
    return model, curve


def probe(model, task: RunningSumTask, args, step: int, loss: float, seconds: float) -> dict:
    acc = probe_accuracy(model, task, task.eval_prompts()[: args.probe_prompts])
    log.info("step %d loss %.4f probe greedy accuracy %.3f (%.0fs)", step, loss, acc, seconds)
    if args.snapshots is not None:
        save(model, task, args.snapshots / f"step_{step:05d}", {"step": step, "probe": acc})
    return {
        "step": step,
        "loss": round(loss, 4),
        "probe_accuracy": acc,
        "seconds": round(seconds, 1),
    }


def save(model: LlamaForCausalLM, task: RunningSumTask, out: Path, card: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=task.tokenizer.bos_token_id,
        eos_token_id=task.tokenizer.eos_token_id,
        pad_token_id=task.tokenizer.pad_token_id,
        do_sample=False,
    )
    model.save_pretrained(str(out))
    task.tokenizer.save_pretrained(str(out))
    (out / "base_model_card.json").write_text(json.dumps(card, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    task = RunningSumTask(seed=0)
    start = time.time()
    model, curve = train(args, task)
    train_seconds = time.time() - start
    torch.manual_seed(args.seed)
    figures = accuracy_and_pass_at_k(model, task, task.eval_prompts(), k=args.pass_k)
    log.info("held-out (%d prompts): %s", len(task.eval_prompts()), figures)
    card = {
        "task": "running_sum",
        "task_seed": 0,
        "args": {k: str(v) for k, v in vars(args).items() if k not in ("out", "snapshots")},
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_seconds": round(train_seconds, 1),
        "heldout": figures,
        "curve": curve,
    }
    save(model, task, args.out, card)
    log.info("saved %s (%d parameters)", args.out, card["parameters"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
