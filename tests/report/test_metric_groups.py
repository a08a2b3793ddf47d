"""Every metrics.jsonl name lands in one TensorBoard group: train/, rollout/, eval/, system/."""

import pytest

from dorarl.report.metric_groups import DEFAULT_GROUP, GROUPS, group_of, grouped_tag
from dorarl.report.tensorboard import ScalarLogger, flatten_scalars

# a dorarl train row (flattened as TensorBoard gets it), an agent's and an MoE model's keys,
# and the evaluation keys a row joins
ROW = {
    "step": 0, "version": 0, "new_version": 1, "time_s": 2.0, "step_time_s": 2.0,
    "rollout_only_s": 1.0, "train_time_s": 1.0, "consumed_groups": 2, "filtered_groups": 0,
    "consumed_tokens": 90, "tokens_per_s": 45.0, "reward_mean": 0.5, "reward_std": 0.1,
    "staleness": {"0": 2}, "instances_per_version": {"0": 2},
    "overhead_s": {"load_balance": 0.0}, "overhead_share": {"load_balance": 0.0},
    "slot_utilization": 0.2, "reprefill_tokens": 0, "prefill_tokens": 10,
    "prefill_saved_tokens": 0, "prefix_hit_rate": 0.0, "cached_blocks": 3, "migrations": 0,
    "offloads": 0, "mixed_version_steps": 0, "groups": 2, "samples": 4, "reward_errors": 0,
    "response_len_mean": 12.0, "response_len_max": 16, "truncated_fraction": 0.25,
    "tool_calls": 0, "tool_call_errors": 0, "tool_use": 0.0, "new_segments": 0,
    "zero_advantage_groups": 0.5, "mixed_version_samples": 0, "staleness_mean": 0.0,
    "staleness_max": 0, "staleness_hist": {"0": 4}, "staleness_token_mean": 0.0,
    "env_errors": 0, "loss": 0.1, "pg_loss": 0.1, "clip_frac_low": 0.0, "clip_frac_high": 0.0,
    "ratio_mean": 1.0, "ratio_max": 1.0, "kl_behavior": 0.0, "kl_ref": 0.0, "entropy": 1.0,
    "tokens": 64, "micro_batches": 1, "grad_norm": 0.3, "update_applied": 1.0, "lr": 1e-6,
    "step_seconds": 1.0, "peak_memory_gb": 1.2, "train_compute_s": 0.2, "train_paced_s": 0.2,
    "train_over_pace": 0, "pace_train": {"steps": 1, "paced_s": 0.2},
    "pace_engine": {"worst_ratio": 1.0}, "agent_refused_calls": 0, "context_overflows": 0,
    "moe_imbalance": 1.1, "moe_tokens_per_expert": {"0": 5}, "eval_accuracy": 0.3,
    "eval_version": 0, "eval_mean@4": 0.3, "eval_pass@4": 0.5, "eval_n": 120,
    "rollout_fresh_tokens": 60, "rollout_logp_abs_diff": 0.02, "rollout_logp_abs_diff_fresh": 1e-3,
    "rollout_ratio_p1": 0.9, "rollout_ratio_p99": 1.1, "rollout_ratio_p1_fresh": 0.99,
    "rollout_ratio_p99_fresh": 1.01,
}  # fmt: skip

EXPECTED = {
    "train": {"loss", "pg_loss", "clip_frac_low", "clip_frac_high", "kl_behavior", "kl_ref",
              "entropy", "grad_norm", "lr", "ratio_mean", "update_applied",
              "moe_tokens_per_expert/0"},
    "rollout": {"reward_mean", "reward_std", "response_len_mean", "truncated_fraction",
                "staleness/0", "staleness_hist/0", "staleness_mean", "filtered_groups",
                "env_errors", "tool_calls", "agent_refused_calls", "instances_per_version/0",
                "rollout_fresh_tokens", "rollout_logp_abs_diff", "rollout_logp_abs_diff_fresh",
                "rollout_ratio_p1", "rollout_ratio_p99", "rollout_ratio_p1_fresh",
                "rollout_ratio_p99_fresh"},
    "eval": {"eval_accuracy", "eval_mean@4", "eval_pass@4", "eval_version", "eval_n"},
    "system": {"step_time_s", "rollout_only_s", "tokens_per_s", "slot_utilization",
               "overhead_s/load_balance", "pace_train/paced_s", "peak_memory_gb",
               "prefix_hit_rate", "time_s", "new_version", "train_over_pace"},
}  # fmt: skip


def test_every_name_of_a_row_lands_in_exactly_one_group():
    names = flatten_scalars(ROW)
    by_group = {g: {n for n in names if group_of(n) == g} for g in GROUPS}
    assert set().union(*by_group.values()) == set(names)
    assert sum(len(v) for v in by_group.values()) == len(names)  # disjoint
    for group, expected in EXPECTED.items():
        assert expected <= by_group[group], (group, expected - by_group[group])


@pytest.mark.parametrize(
    "name, group",
    [
        ("adv_mean", DEFAULT_GROUP),  # a new loss term: the trainer's
        ("new_objective/term", DEFAULT_GROUP),
        ("reward_format", "rollout"),  # a new reward family
        ("weight_sync_s", "system"),  # a new time, whoever records it
        ("eval_mean@8", "eval"),
    ],
)
def test_unknown_names_go_to_a_sensible_group(name, group):
    assert DEFAULT_GROUP == "train" and group_of(name) == group
    assert grouped_tag(name) == f"{group}/{name}"


def test_tensorboard_tags_are_grouped(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = ScalarLogger(tmp_path)
    logger.log({"step": 1, "reward_mean": 0.5, "loss": 0.1, "eval_accuracy": 0.3,
                "tokens_per_s": 9.0, "staleness": {"1": 2}})  # fmt: skip
    logger.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {
        "rollout/reward_mean", "train/loss", "eval/eval_accuracy", "system/tokens_per_s",
        "rollout/staleness/1",
    }  # fmt: skip
