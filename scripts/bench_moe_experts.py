"""How an engine decode step's cost grows with the number of experts and the batch, on this CPU.

Random Qwen3-MoE models of one shape (hidden 256, 4 layers, 8 heads, top-2 of E experts of
width 256) at E = 4, 16, 64, and their dense twin (a Qwen3 whose MLP is 2 x 256 wide: the
same matmul work per token), each in an engine on one thread; the median decode step at
batches 1, 8, 32 and 64 (context ~64), with both expert kernels (`linear_kernel=onednn`: one
packed product per expert with tokens; `torch`: one `F.grouped_mm`). The number of experts a
step touches is min(E, batch x top_k) at most, and each touched expert is one product.

    python scripts/bench_moe_experts.py --out moe_experts.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3MoeConfig

from dorarl.bench.clock import Laps, load_window
from dorarl.engine import Engine, EngineConfig, SamplingParams

SHAPE = dict(
    hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
    head_dim=32, vocab_size=512, max_position_embeddings=512,
)  # fmt: skip
WIDTH, TOP_K = 256, 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--experts", default="4,16,64")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed per batch")
    return ap.parse_args(argv)


def config(experts: int):
    if experts == 0:  # the dense twin
        return Qwen3Config(**SHAPE, intermediate_size=TOP_K * WIDTH)
    return Qwen3MoeConfig(
        **SHAPE, intermediate_size=TOP_K * WIDTH, moe_intermediate_size=WIDTH,
        num_experts=experts, num_experts_per_tok=TOP_K, norm_topk_prob=True,
    )  # fmt: skip


def decode_ms(experts: int, batch: int, kernel: str, steps: int) -> float:
    """The median decode step of `batch` requests 64 tokens into their context."""
    engine = Engine.from_hf_config(
        config(experts),
        EngineConfig(max_num_seqs=batch, max_model_len=256, linear_kernel=kernel),
        seed=0,
    )
    gen = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(0, 512, (60,), generator=gen).tolist()
        engine.add_request(f"r{i}", prompt, SamplingParams(target_len=steps + 8, seed=i))
    while engine.last_step.prefill_tokens or engine.stats().steps == 0:
        engine.step()  # prefill done
    laps = Laps()
    for _ in range(steps):
        laps.time(engine.step)
    return laps.median().wall_s * 1e3


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    experts = [int(e) for e in args.experts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    with load_window() as load:
        for e in [0, *experts]:
            for kernel in ("onednn", "torch") if e else ("onednn",):
                row = {"experts": e, "kernel": kernel}
                row |= {str(b): round(decode_ms(e, b, kernel, args.steps), 3) for b in batches}
                rows.append(row)
                print(json.dumps(row), flush=True)
    doc = {**load.fields(), "threads": 1, "rows": rows}
    if args.out is not None:
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
