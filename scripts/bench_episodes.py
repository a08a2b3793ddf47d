"""Simulated multi-turn episodes on slow tools: slot utilisation and throughput with
waiting episodes holding their decode slot (`episode_overcommit` 1) against freeing it (2).

    PYTHONPATH=$PWD python scripts/bench_episodes.py [--latency-s 2.0] [--turns 4]
"""

from __future__ import annotations

import argparse

from dorarl.controller import ControllerConfig, OrchestratorConfig
from dorarl.data.lengths import LengthDist
from dorarl.sim import CostModel, EpisodeModel, SimRuntime


def run(overcommit: float, latency_s: float, turns: int, seed: int) -> dict[str, float]:
    cfg = ControllerConfig(
        mode="dora", K=2, tbs=32, rbs=96, group_size=4, instances=4, slots=16, steps=12,
        orchestrator=OrchestratorConfig(episode_overcommit=overcommit),
    )  # fmt: skip
    lengths = LengthDist(median=256.0, p99_ratio=8.0, max_len=2048, prompt_len=128)
    sim = SimRuntime(
        cfg, CostModel(), lengths, seed=seed, trace=False, trajectories=False,
        episodes=EpisodeModel(max_turns=turns, latency_s=latency_s),
    )  # fmt: skip
    summary = sim.run().summary
    return {
        "wall_s": summary["wall_time_s"],
        "slot_utilization": summary["slot_utilization"],
        "tokens_per_s": summary["throughput_tokens_per_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency-s", type=float, default=2.0, help="mean env latency a turn")
    parser.add_argument("--turns", type=int, default=4, help="turns an episode takes at most")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = {x: run(x, args.latency_s, args.turns, args.seed) for x in (1.0, 2.0)}
    print(f"env latency {args.latency_s} s mean, up to {args.turns} turns, seed {args.seed}")
    print(f"{'overcommit':>10} {'wall s':>9} {'slot util':>9} {'tokens/s':>10}")
    for x, r in rows.items():
        print(
            f"{x:>10.1f} {r['wall_s']:>9.1f} {r['slot_utilization']:>9.3f} "
            f"{r['tokens_per_s']:>10.0f}"
        )
    speed = rows[2.0]["tokens_per_s"] / rows[1.0]["tokens_per_s"]
    print(f"throughput x{speed:.2f} with overcommit 2")


if __name__ == "__main__":
    main()
