"""Cost model of one rollout instance, the links and the trainer: a dataclass of parameters.

Decode is memory-bound: a step reads the weights once (`decode_fixed_s`) plus the KV of
every resident token (`decode_per_kv_token_s`), plus a small per-sequence cost. Prefill is
per token; with `prefix_cache` (the engine's `engine.prefix_cache=on`) requests of one
prompt placed together prefill it once, and each other request only what follows it (at
least its last prompt token, for its logits). For an MoE model the token
compute (a decode row, a prefill token, a trained token) has a routed-expert share
`expert_share`, which runs `expert_imbalance` times longer: with experts spread over
accelerators, the one holding the busiest expert sets the pace (max / mean tokens per expert,
measured by a run's trainer). The
field defaults (`local()` here) are a generic 7B-class model in bf16 on one 80 GB accelerator per
instance, trainer on 4 at ~35% MFU, used by tests (`instance_devices` and `trainer_devices`
say how many; only `dorarl simulate --whatif split` reads them, to move devices between the
two); the `dorarl simulate --preset` scenarios
(paper-64, paper-128, moe-500b, and `local` = this machine as the bench paces it) are
derived from public specs in `dorarl.simulate.presets`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from dorarl.config import ConfigError, check_fields
from dorarl.engine.memory import kv_bytes_per_token  # the engine's pool: one arithmetic

__all__ = ["PRESETS", "CostModel", "kv_bytes_per_token", "local"]


@dataclass(kw_only=True)
class CostModel:
    decode_fixed_s: float = field(
        default=8e-3, metadata={"help": "decode step: weight read", "ge": 0}
    )
    decode_per_seq_s: float = field(
        default=2e-5, metadata={"help": "decode step: per running sequence", "ge": 0}
    )
    decode_per_kv_token_s: float = field(
        default=3e-8, metadata={"help": "decode step: per resident KV token", "ge": 0}
    )
    prefill_per_token_s: float = field(
        default=4e-5, metadata={"help": "prefill compute per token", "ge": 0}
    )
    prefix_cache: bool = field(
        default=True,
        metadata={"help": "engines share a prompt's KV: a group prefills its prompt once"},
    )
    kv_bytes_per_token: float = field(
        default=float(kv_bytes_per_token(28, 4, 128)),
        metadata={"help": "KV bytes of one token", "ge": 0},
    )
    kv_capacity_tokens: int = field(
        default=600_000, metadata={"help": "KV pool per instance (tokens)", "gt": 0}
    )
    kv_link_bytes_per_s: float = field(
        default=25e9, metadata={"help": "request migration bandwidth", "gt": 0}
    )
    kv_link_latency_s: float = field(
        default=2e-3, metadata={"help": "request migration latency (RPC)", "ge": 0}
    )
    host_link_bytes_per_s: float = field(
        default=20e9, metadata={"help": "device<->host KV offload", "gt": 0}
    )
    weight_bytes: float = field(
        default=15.2e9, metadata={"help": "bytes of one set of weights", "ge": 0}
    )
    peer_link_bytes_per_s: float = field(
        default=25e9, metadata={"help": "instance -> instance weights", "gt": 0}
    )
    trainer_link_bytes_per_s: float = field(
        default=25e9, metadata={"help": "trainer -> instance weights", "gt": 0}
    )
    weight_latency_s: float = field(
        default=0.05, metadata={"help": "fixed cost of a weight load", "ge": 0}
    )
    free_cache_s: float = field(
        default=0.01, metadata={"help": "freeing the KV cache on a version change", "ge": 0}
    )
    train_fixed_s: float = field(default=2.0, metadata={"help": "per training step", "ge": 0})
    train_per_token_s: float = field(
        default=3.3e-5,
        metadata={
            "help": "per trained token (prompt + response), on trainer_devices devices",
            "ge": 0,
        },
    )
    instance_devices: int = field(
        default=1,
        metadata={"help": "devices of one rollout instance (the what-if's split)", "ge": 1},
    )
    trainer_devices: int = field(
        default=4, metadata={"help": "devices of the trainer (the what-if's split)", "ge": 1}
    )
    expert_share: float = field(
        default=0.0,
        metadata={
            "help": "MoE: share of a token's compute in its routed experts (0: dense)",
            "ge": 0,
            "le": 1,
        },
    )
    expert_imbalance: float = field(
        default=1.0,
        metadata={
            "help": "MoE: tokens of the busiest expert over the mean (a run's moe_imbalance; "
            "1: perfectly balanced): the expert share of compute takes this much longer",
            "ge": 1,
        },
    )

    def validate(self) -> None:
        check_fields(self)
        if self.decode_fixed_s + self.decode_per_seq_s <= 0:
            raise ConfigError("decode_fixed_s: a decode step must take time")

    @property
    def compute_factor(self) -> float:
        """How much longer token compute takes than with perfectly balanced experts."""
        return 1.0 + self.expert_share * (self.expert_imbalance - 1.0)

    def decode_step_s(self, batch: int, resident_tokens: float) -> float:
        return (
            self.decode_fixed_s
            + self.decode_per_seq_s * self.compute_factor * batch
            + self.decode_per_kv_token_s * resident_tokens
        )

    def prefill_tokens(self, prompt_len: int, contexts: list[int], cached: bool = False) -> int:
        """Tokens computed to place requests of one prompt (each with `contexts[i]` tokens)
        on one instance together: all of them without the prefix cache; with it the first
        computes its own (unless the instance holds the prompt already: `cached`), each
        other one what follows the prompt, at least one token."""
        if not self.prefix_cache or not contexts:
            return sum(contexts)
        rest = sum(max(1, c - prompt_len) for c in contexts)
        return rest if cached else contexts[0] + rest - max(1, contexts[0] - prompt_len)

    def prefill_s(self, tokens: float) -> float:
        return self.prefill_per_token_s * self.compute_factor * tokens

    def weight_load_s(self, from_trainer: bool) -> float:
        bandwidth = self.trainer_link_bytes_per_s if from_trainer else self.peer_link_bytes_per_s
        return self.weight_latency_s + self.weight_bytes / bandwidth

    def migration_s(self, tokens: float) -> float:
        return self.kv_link_latency_s + tokens * self.kv_bytes_per_token / self.kv_link_bytes_per_s

    def host_transfer_s(self, tokens: float) -> float:
        return tokens * self.kv_bytes_per_token / self.host_link_bytes_per_s

    def train_s(self, tokens: int) -> float:
        return self.train_fixed_s + self.train_per_token_s * self.compute_factor * tokens

    def with_trainer_devices(self, devices: int) -> CostModel:
        """The trainer on `devices` devices: the per-token work (forward and backward,
        compute bound, data parallel) is shared out over them; the per-step part (optimizer
        update, gradient all-reduce setup) is not, and the weights to send are the same."""
        per_token = self.train_per_token_s * self.trainer_devices / devices
        return replace(self, trainer_devices=devices, train_per_token_s=per_token)


def local() -> CostModel:
    """The default preset (see the module docstring)."""
    return CostModel()


PRESETS = {"local": local}
