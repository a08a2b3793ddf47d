"""Legacy instances that ran dry go to the newest version once their version's plan shrinks,
every one of them, not only the one whose sample ended.

Two instances of 3 slots, groups of 4, a KV pool that holds about one long sequence: after
a publish, one v3 instance runs dry while the other still decodes v3 stragglers, and the
KV-packing floor keeps it on v3. When the last straggler ends, both must take v4; with only
the reporting one switched, v4 has 3 slots for a group of 4 while the other idles on v3
until the rebalance timer (the simulator calls that a deadlock).
"""

from dorarl.controller import ControllerConfig, OrchestratorConfig
from dorarl.data.lengths import LengthDist
from dorarl.sim import CostModel, SimRuntime


def test_every_dry_instance_of_a_shrinking_version_takes_the_newest(tmp_path):
    cfg = ControllerConfig(
        mode="dora", K=1, rbs=3, tbs=3, group_size=4, instances=2, slots=3, steps=5,
        orchestrator=OrchestratorConfig(kv_offload_threshold=0.5, rebalance_period_s=0.5,
                                        p2p_weights=False, kv_packing=True),
    )  # fmt: skip
    cost = CostModel(decode_fixed_s=0.001, kv_capacity_tokens=34, weight_bytes=0.0,
                     prefill_per_token_s=0.0, decode_per_kv_token_s=0.0, train_fixed_s=0.01,
                     train_per_token_s=0.0)  # fmt: skip
    lengths = LengthDist(median=2.0, p99_ratio=60.0, group_corr=0.0, max_len=32, prompt_len=1)
    sim = SimRuntime(cfg, cost, lengths, seed=0, out_dir=tmp_path)
    result = sim.run()
    assert sim.controller.counts()["steps_done"] == 5
    assert result.summary["dropped_total"] == 0
