"""A filtered group re-plans the partition: instances kept for it go to the newest version.

Found by the property test: two instances of 2 slots, groups of 3. Group 1 (v0) spans both;
one instance runs dry while v0 still runs and stays; the other runs dry as the group is
filtered and switches. Without a re-plan v1 had 2 slots for a group of 3 while the other
instance idled on v0 until the rebalance timer (the simulator calls that a deadlock).
"""

from dorarl.controller import ControllerConfig, OrchestratorConfig, RolloutConfig
from dorarl.data.lengths import LengthDist
from dorarl.sim import CostModel, RewardModel, SimRuntime


def test_a_filtered_group_does_not_strand_an_instance_on_its_version(tmp_path):
    cfg = ControllerConfig(
        mode="dora", K=1, rbs=1, tbs=1, group_size=3, instances=2, slots=2, steps=2,
        orchestrator=OrchestratorConfig(rebalance_period_s=0.5, p2p_weights=False),
        rollout=RolloutConfig(filter_groups=True, max_filtered_per_step=1),
    )  # fmt: skip
    cost = CostModel(decode_fixed_s=0.01, kv_capacity_tokens=34, weight_bytes=0.0,
                     prefill_per_token_s=0.0, decode_per_kv_token_s=0.0, train_fixed_s=0.01,
                     train_per_token_s=0.0)  # fmt: skip
    lengths = LengthDist(median=2.0, p99_ratio=1.0, group_corr=0.0, max_len=32, prompt_len=1)
    rewards = RewardModel(uniform_share=0.3, correct_share=0.0)
    sim = SimRuntime(cfg, cost, lengths, seed=1, out_dir=tmp_path, rewards=rewards)
    result = sim.run()
    counts = sim.controller.counts()
    assert counts["steps_done"] == 2 and counts["filtered"] >= 1
    assert result.summary["dropped_total"] == 0
