"""Upcycle the shipped dense base model into a Mixture-of-Experts one (sparse upcycling).

Mixtral is a Llama whose MLPs are expert blocks, so the dense base (a Llama) becomes a Mixtral
with every tensor kept: embeddings, norms and attention as they are; in each layer every
expert a copy of the dense MLP plus small Gaussian noise (`--noise` times each matrix's own
standard deviation, so the experts differ and routing matters), and a fresh router (normal,
std `--router-std`: decisive enough that a token's top-k is not a near tie). The top-k
weights of Mixtral sum to one, so at the start the MoE computes what the dense model did up
to the noise, and RL starts from the base's accuracy. The experts are stored in bfloat16
(the engine and the trainer load them in float32), everything else in float32: the folder
stays a few MB. Deterministic for a seed. Held-out greedy accuracy and pass@k of the dense
base and of the MoE (Hugging Face `generate`) go to base_model_card.json.

    python scripts/upcycle_base_model.py --out assets/moe_base
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path

import torch
from hf_sampling import accuracy_and_pass_at_k
from transformers import LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

from dorarl.tasks import RunningSumTask
from dorarl.tasks.assets import BASE_MODEL_DIR

log = logging.getLogger("upcycle_base_model")
COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, default=BASE_MODEL_DIR)
    ap.add_argument("--out", type=Path, default=Path("assets/moe_base"))
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--noise", type=float, default=0.01, help="relative to each matrix's std")
    ap.add_argument("--router-std", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-prompts", type=int, default=0, help="0: the whole held-out set")
    ap.add_argument("--pass-k", type=int, default=8)
    ap.add_argument("--no-eval", action="store_true", help="skip the held-out measurement")
    return ap.parse_args(argv)


def moe_config(dense, args: argparse.Namespace) -> MixtralConfig:
    d = dense.config
    return MixtralConfig(
        vocab_size=d.vocab_size,
        hidden_size=d.hidden_size,
        intermediate_size=d.intermediate_size,
        num_hidden_layers=d.num_hidden_layers,
        num_attention_heads=d.num_attention_heads,
        num_key_value_heads=d.num_key_value_heads,
        head_dim=d.head_dim,
        max_position_embeddings=d.max_position_embeddings,
        rms_norm_eps=d.rms_norm_eps,
        rope_parameters=dict(d.rope_parameters),
        tie_word_embeddings=d.tie_word_embeddings,
        bos_token_id=d.bos_token_id,
        eos_token_id=d.eos_token_id,
        pad_token_id=d.pad_token_id,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        router_jitter_noise=0.0,
        sliding_window=None,
    )


def _noisy_copies(weight: torch.Tensor, count: int, rel: float, gen: torch.Generator):
    """`count` copies of `weight` stacked, each plus N(0, (rel x std(weight))^2) noise."""
    noise = torch.randn((count, *weight.shape), generator=gen) * (rel * float(weight.std()))
    return weight.unsqueeze(0) + noise


def upcycled_state(dense, config: MixtralConfig, args) -> dict[str, torch.Tensor]:
    """The Mixtral state dict (transformers' in-memory names) from the dense one."""
    gen = torch.Generator().manual_seed(args.seed)
    state = {}
    for name, tensor in dense.state_dict().items():
        if ".mlp." not in name:
            state[name] = tensor.clone()
    for i, layer in enumerate(dense.model.layers):
        p, mlp = f"model.layers.{i}.mlp.", layer.mlp
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()
        state[f"{p}experts.gate_up_proj"] = _noisy_copies(gate_up, args.experts, args.noise, gen)
        down = mlp.down_proj.weight.detach()
        state[f"{p}experts.down_proj"] = _noisy_copies(down, args.experts, args.noise, gen)
        router = torch.randn((args.experts, config.hidden_size), generator=gen) * args.router_std
        state[f"{p}gate.weight"] = router
    return state


def build(args: argparse.Namespace) -> tuple[LlamaForCausalLM, MixtralForCausalLM]:
    dense = LlamaForCausalLM.from_pretrained(str(args.base), dtype=torch.float32).eval()
    config = moe_config(dense, args)
    torch.manual_seed(args.seed)
    moe = MixtralForCausalLM(config).eval()
    state = upcycled_state(dense, config, args)
    moe.load_state_dict(state, strict=False)
    missing = set(moe.state_dict()) - set(state)
    assert missing <= {"lm_head.weight"}, missing  # tied: the embedding
    for layer in moe.model.layers:  # a few MB on disk; loaded back in float32
        layer.mlp.experts.to(torch.bfloat16)
    return dense, moe


def held_out(model, task: RunningSumTask, args: argparse.Namespace) -> dict[str, float]:
    prompts = task.eval_prompts()
    prompts = prompts[: args.eval_prompts] if args.eval_prompts else prompts
    torch.manual_seed(args.seed)
    return accuracy_and_pass_at_k(model.float(), task, prompts, k=args.pass_k)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    torch.set_num_threads(1)
    dense, moe = build(args)
    args.out.mkdir(parents=True, exist_ok=True)
    moe.save_pretrained(str(args.out))
    for name in COPIED:
        shutil.copy(args.base / name, args.out / name)
    card = {
        "made_by": "scripts/upcycle_base_model.py",
        "from": str(args.base.name),
        "args": {k: str(v) for k, v in vars(args).items() if k not in ("base", "out")},
        "parameters": sum(p.numel() for p in moe.parameters()),
        "active_parameters_per_token": _active(moe.config, dense),
    }
    if not args.no_eval:
        task = RunningSumTask(seed=0)
        loaded = MixtralForCausalLM.from_pretrained(str(args.out), dtype=torch.float32).eval()
        card["heldout_dense_base"] = held_out(dense, task, args)
        card["heldout"] = held_out(loaded, task, args)
        log.info("held-out: dense %s, MoE %s", card["heldout_dense_base"], card["heldout"])
    (args.out / "base_model_card.json").write_text(json.dumps(card, indent=2) + "\n")
    log.info("saved %s (%d parameters)", args.out, card["parameters"])
    return 0


def _active(config: MixtralConfig, dense) -> int:
    """Parameters a token passes through: the dense model's, with top_k expert MLPs each."""
    mlp = sum(p.numel() for p in dense.model.layers[0].mlp.parameters())
    total = sum(p.numel() for p in dense.parameters())
    router = config.num_local_experts * config.hidden_size
    return total + config.num_hidden_layers * ((config.num_experts_per_tok - 1) * mlp + router)


if __name__ == "__main__":
    raise SystemExit(main())
