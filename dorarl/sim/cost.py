"""Cost model of one rollout instance, the links and the trainer: a dataclass of parameters.

Decode is memory-bound: a step reads the weights once (`decode_fixed_s`) plus the KV of
every resident token (`decode_per_kv_token_s`), plus a small per-sequence cost. For an MoE model the token
compute (a decode row, a prefill token, a trained token) has a routed-expert share
`expert_share`, which runs `expert_imbalance` times longer: with experts spread over
accelerators, the one holding the busiest expert sets the pace (max / mean tokens per expert,
measured by a run's trainer). The
field defaults (`local()` here) are a generic 7B-class model in bf16 on one 80 GB accelerator per
instance, trainer on 4 at ~35% MFU, used by tests; the `dorarl simulate --preset` scenarios
(paper-64, paper-128, moe-500b, and `local` = this machine as the bench paces it) are
derived from public specs in `dorarl.simulate.presets`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from dorarl.config import ConfigError
from dorarl.engine.memory import kv_bytes_per_token  # the engine's pool: one arithmetic

__all__ = ["PRESETS", "CostModel", "kv_bytes_per_token", "local"]


@dataclass(kw_only=True)
class CostModel:
    decode_fixed_s: float = field(default=8e-3, metadata={"help": "decode step: weight read"})
    decode_per_seq_s: float = field(
        default=2e-5, metadata={"help": "decode step: per running sequence"}
    )
    decode_per_kv_token_s: float = field(
        default=3e-8, metadata={"help": "decode step: per resident KV token"}
    )
    prefill_per_token_s: float = field(default=4e-5, metadata={"help": "prefill compute per token"})
    kv_bytes_per_token: float = field(
        default=float(kv_bytes_per_token(28, 4, 128)), metadata={"help": "KV bytes of one token"}
    )
    kv_capacity_tokens: int = field(
        default=600_000, metadata={"help": "KV pool per instance (tokens)"}
    )
    kv_link_bytes_per_s: float = field(
        default=25e9, metadata={"help": "request migration bandwidth"}
    )
    kv_link_latency_s: float = field(
        default=2e-3, metadata={"help": "request migration latency (RPC)"}
    )
    host_link_bytes_per_s: float = field(
        default=20e9, metadata={"help": "device<->host KV offload"}
    )
    weight_bytes: float = field(default=15.2e9, metadata={"help": "bytes of one set of weights"})
    peer_link_bytes_per_s: float = field(
        default=25e9, metadata={"help": "instance -> instance weights"}
    )
    trainer_link_bytes_per_s: float = field(
        default=25e9, metadata={"help": "trainer -> instance weights"}
    )
    weight_latency_s: float = field(default=0.05, metadata={"help": "fixed cost of a weight load"})
    free_cache_s: float = field(
        default=0.01, metadata={"help": "freeing the KV cache on a version change"}
    )
    train_fixed_s: float = field(default=2.0, metadata={"help": "per training step"})
    train_per_token_s: float = field(
        default=3.3e-5, metadata={"help": "per trained token (prompt + response)"}
    )
    expert_share: float = field(
        default=0.0,
        metadata={"help": "MoE: share of a token's compute in its routed experts (0: dense)"},
    )
    expert_imbalance: float = field(
        default=1.0,
        metadata={
            "help": "MoE: tokens of the busiest expert over the mean (a run's moe_imbalance; "
            "1: perfectly balanced): the expert share of compute takes this much longer"
        },
    )

    def validate(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not value >= 0:
                raise ConfigError(f"{f.name}: must be >= 0, got {value}")
        for key in (
            "kv_link_bytes_per_s",
            "host_link_bytes_per_s",
            "peer_link_bytes_per_s",
            "trainer_link_bytes_per_s",
            "kv_capacity_tokens",
        ):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key}: must be > 0")
        if self.decode_fixed_s + self.decode_per_seq_s <= 0:
            raise ConfigError("decode_fixed_s: a decode step must take time")
        if self.expert_share > 1:
            raise ConfigError(f"expert_share: must be in [0, 1], got {self.expert_share}")
        if self.expert_imbalance < 1:
            raise ConfigError(
                f"expert_imbalance: max / mean is at least 1, got {self.expert_imbalance}"
            )

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


def local() -> CostModel:
    """The default preset (see the module docstring)."""
    return CostModel()


PRESETS = {"local": local}
