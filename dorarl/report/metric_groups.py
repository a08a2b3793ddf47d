"""Which of four groups (train, rollout, eval, system) a metrics.jsonl name belongs to, so
TensorBoard and Weights & Biases show them in sections; a name not listed goes to train."""

from __future__ import annotations

GROUPS = ("train", "rollout", "eval", "system")
DEFAULT_GROUP = "train"  # new names come mostly from the trainer's loss and its terms

# A name's group is that of its first listed prefix (the part before any `/` included).
_ROLLOUT = (
    "reward_", "response_len_", "truncated_fraction", "staleness", "samples", "groups",
    "consumed_groups", "filtered_groups", "consumed_tokens", "zero_advantage_groups",
    "env_errors", "env_waits", "new_segments", "tool_", "agent_refused_calls",
    "context_overflows", "mixed_version_", "migrations", "offloads", "instances_per_version",
    "rollout_logp_", "rollout_ratio_", "rollout_fresh_tokens",
)  # fmt: skip
_SYSTEM = (
    "step", "version", "new_version", "time_s", "step_time_s", "step_seconds",
    "rollout_only_s", "train_time_s", "train_compute_s", "train_paced_s", "train_over_pace",
    "tokens_per_s", "slot_utilization", "overhead_", "pace_", "peak_memory_gb",
    "cached_blocks", "prefill_", "prefix_hit_rate", "reprefill_tokens", "micro_batches",
)  # fmt: skip
_SYSTEM_SUFFIXES = ("_s", "_seconds", "_gb", "_per_s")  # times and sizes, whoever records them


def group_of(name: str) -> str:
    """The group of a metric name (a flattened one, `staleness/0`, by its first part)."""
    head = name.split("/", 1)[0]
    if head.startswith("eval_") or head == "eval":
        return "eval"
    for group, prefixes in (("system", _SYSTEM), ("rollout", _ROLLOUT)):
        if any(_matches(head, prefix) for prefix in prefixes):
            return group
    if head.endswith(_SYSTEM_SUFFIXES):
        return "system"
    return DEFAULT_GROUP


def grouped_tag(name: str) -> str:
    """`group/name`: the tag a metric is logged under."""
    return f"{group_of(name)}/{name}"


def _matches(head: str, prefix: str) -> bool:
    """A prefix ending in `_` opens a family (`reward_` takes reward_mean); any other is a
    whole name, or a family's stem (`staleness` takes staleness_max and staleness)."""
    if prefix.endswith("_"):
        return head.startswith(prefix)
    return head == prefix or head.startswith(prefix + "_")
