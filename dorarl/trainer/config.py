"""Typed settings of the trainer and of its objectives; simple bounds are declared on the
fields (dorarl.config.fields), and `validate()` checks them and the keys' relations, naming
the bad key."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dorarl.config import ConfigError, check_fields
from dorarl.trainer.autocast import Autocast, check_autocast
from dorarl.trainer.schedule import LrSchedule


@dataclass(kw_only=True)
class LossConfig:
    eps_low: float = field(
        default=0.2, metadata={"help": "lower clip: ratio >= 1 - eps_low", "ge": 0, "lt": 1}
    )
    eps_high: float = field(
        default=0.28, metadata={"help": "upper clip: ratio <= 1 + eps_high", "ge": 0}
    )
    kind: Literal["ppo_clip", "cispo"] = field(
        default="ppo_clip",
        metadata={
            "help": "ppo_clip: -min(r A, clip(r) A) (PPO/GRPO); cispo: -sg(clip(r, "
            "1 - cispo_eps_low, 1 + cispo_eps_high)) A log pi, every token keeps its "
            "gradient (CISPO, MiniMax-M1)"
        },
    )
    ratio: Literal["token", "sequence", "sequence_token"] = field(
        default="token",
        metadata={
            "help": "token: r = pi/pi_base per token; sequence: GSPO's exp of the mean "
            "log-ratio over a sequence's trained tokens (per segment of an episode), "
            "clipped per sequence; sequence_token: GSPO-token, the sequence ratio's value "
            "with each token's own gradient"
        },
    )
    cispo_eps_low: float = field(
        default=1.0,
        metadata={
            "help": "kind=cispo: IS weight >= 1 - cispo_eps_low (1: no floor)",
            "ge": 0,
            "le": 1,
        },
    )
    cispo_eps_high: float = field(
        default=2.0,
        metadata={"help": "kind=cispo: IS weight <= 1 + cispo_eps_high", "ge": 0},
    )
    aggregation: Literal["token_mean", "seq_mean", "seq_sum_norm"] = field(
        default="token_mean",
        metadata={
            "help": "token_mean: over all response tokens of the batch (DAPO); "
            "seq_mean: mean over sequences of each sequence's token mean; seq_sum_norm: "
            "each sequence's token sum divided by the constant norm_length, mean over "
            "sequences (Dr. GRPO)"
        },
    )
    norm_length: int | None = field(
        default=None,
        metadata={
            "help": "aggregation=seq_sum_norm: the constant token count each sequence's sum "
            "is divided by (unset: the response cap, sampling.max_new_tokens)",
            "ge": 1,
        },
    )
    advantage: Literal["grpo", "rloo", "reinforce_pp"] = field(
        default="grpo",
        metadata={
            "help": "grpo: reward minus its group's mean (over the group std with "
            "normalize_std); rloo: reward minus the mean of the group's other rewards; "
            "reinforce_pp: (reward - batch mean) / batch std over the step's samples "
            "(REINFORCE++)"
        },
    )
    normalize_std: bool = field(
        default=True,
        metadata={"help": "advantage=grpo: divide group advantages by the group reward std"},
    )
    adv_eps: float = field(
        default=1e-6, metadata={"help": "added to the std before dividing", "ge": 0}
    )
    kl_coef: float = field(
        default=0.0,
        metadata={"help": "weight of the k3 KL to the frozen reference (0: none)", "ge": 0},
    )
    ratio_base: Literal["behavior", "proximal"] = field(
        default="behavior",
        metadata={
            "help": "behavior: ratio against the engine's sampling logprobs (clip is a "
            "trust region around the behavior policy); proximal: decoupled PPO, ratio "
            "against the trainer's pre-step policy, times the importance weight "
            "pi_proximal / pi_behavior"
        },
    )
    tis_cap: float | None = field(
        default=None,
        metadata={
            "help": "truncate the importance weight pi_proximal / pi_behavior at this "
            "value (truncated IS; ratio_base=proximal only)",
            "gt": 0,
        },
    )
    dual_clip: float | None = field(
        default=None,
        metadata={
            "help": "bound the loss of negative-advantage tokens at dual_clip * |A| "
            "(dual-clip PPO; > 1)",
            "gt": 1,
        },
    )
    entropy_coef: float = field(default=0.0, metadata={"help": "entropy bonus weight"})
    distill_coef: float = field(
        default=0.0,
        metadata={
            "help": "on-policy distillation (needs trainer.teacher): weight of the per-token "
            "reward log teacher(y_t) - log pi_behavior(y_t), minus the reverse KL of each "
            "sampled token, added to the advantage",
            "ge": 0,
        },
    )
    rl_coef: float = field(
        default=1.0,
        metadata={
            "help": "weight of the reward's advantage beside distill_coef (0: distillation alone)",
            "ge": 0,
        },
    )
    is_mask: Literal["none", "token", "sequence"] = field(
        default="none",
        metadata={
            "help": "train/rollout mismatch masking (IcePop): token: tokens whose weight "
            "pi_trainer / pi_behavior leaves [is_mask_low, is_mask_high] get no policy loss; "
            "sequence: whole sequences whose geometric-mean weight leaves it"
        },
    )
    is_mask_low: float = field(
        default=0.5, metadata={"help": "is_mask: the lowest weight kept", "ge": 0}
    )
    is_mask_high: float = field(
        default=2.0, metadata={"help": "is_mask: the highest weight kept", "gt": 0}
    )
    overlong: Literal["none", "mask", "soft"] = field(
        default="none",
        metadata={
            "help": "responses that run into the length cap (DAPO): none: trained as they "
            "are; mask: truncated ones (a turn with finish reason length) are left out of "
            "the loss; soft: a reward penalty growing linearly from 0 to -1 over the last "
            "overlong_buffer tokens before the cap (sampling.max_new_tokens, per turn; an "
            "episode takes its worst turn's)"
        },
    )
    overlong_buffer: int = field(
        default=64,
        metadata={
            "help": "overlong=soft: tokens before the cap over which the penalty grows",
            "ge": 1,
        },
    )
    # Derived in `dorarl train` (TrainConfig.DERIVED_KEYS), not settings there: the
    # engines' response cap, and (read-only) the old name of overlong=mask.
    response_cap: int | None = field(
        default=None, metadata={"help": "the engines' response cap (overlong=soft ends at it)"}
    )
    mask_truncated: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.mask_truncated = self.overlong == "mask"

    def validate(self) -> None:
        check_fields(self)
        if self.tis_cap is not None and self.ratio_base != "proximal":
            raise ConfigError(
                "tis_cap: only used with ratio_base=proximal (with ratio_base="
                "behavior the clip already bounds the importance ratio)"
            )
        self._check_objective()
        self._check_overlong()

    def _check_objective(self) -> None:
        if self.dual_clip is not None and self.kind != "ppo_clip":
            raise ConfigError("dual_clip: only used with kind=ppo_clip")
        if self.norm_length is not None and self.aggregation != "seq_sum_norm":
            raise ConfigError("norm_length: only used with aggregation=seq_sum_norm")
        if self.rl_coef == 0 and self.distill_coef == 0:
            raise ConfigError("rl_coef: 0 leaves no objective without distill_coef > 0")
        if self.is_mask != "none" and self.is_mask_low >= self.is_mask_high:
            raise ConfigError(
                f"is_mask_low: {self.is_mask_low} must be below is_mask_high={self.is_mask_high}"
            )

    def sum_norm_length(self) -> int:
        """The constant divisor of aggregation=seq_sum_norm: norm_length, else the cap."""
        length = self.norm_length or self.response_cap
        if length is None:
            raise ValueError("aggregation=seq_sum_norm needs norm_length or the response cap")
        return length

    def _check_overlong(self) -> None:
        if self.overlong != "soft" or self.response_cap is None:
            return  # the cap is checked when it is known (TrainConfig, or the first batch)
        if self.overlong_buffer >= self.response_cap:
            raise ConfigError(
                f"overlong_buffer: {self.overlong_buffer} tokens must be fewer than the "
                f"response cap sampling.max_new_tokens={self.response_cap}"
            )


LORA_UNSUPPORTED = ("lm_head", "embed_tokens")  # the chunked head and tied weights need them plain


@dataclass(kw_only=True)
class LoraConfig:
    rank: int = field(
        default=0,
        metadata={
            "help": "LoRA rank: N > 0 trains rank-N adapters on the frozen base (peft) and "
            "sends the engines the merged weights (with engine.max_versions > 1: the "
            "adapters alone); 0: full-weight training",
            "ge": 0,
        },
    )
    alpha: float = field(
        default=16.0, metadata={"help": "LoRA alpha: the update is B @ A * alpha / rank", "gt": 0}
    )
    dropout: float = field(
        default=0.0,
        metadata={
            "help": "dropout on the adapters' input in training (0: the trainer's "
            "log-probs are the policy's, as the loss assumes)",
            "ge": 0,
            "lt": 1,
        },
    )
    target_modules: list[str] = field(
        default_factory=list,
        metadata={
            "help": "module names to adapt, e.g. [q_proj,v_proj] ([]: every linear layer of "
            "the decoder, peft's all-linear; the output layer and embeddings stay full)"
        },
    )
    lr: float | None = field(
        default=None,
        metadata={
            "help": "AdamW learning rate of the adapters (unset: dorarl train takes ten "
            "times trainer.lr; a Trainer built directly, trainer.lr itself)",
            "gt": 0,
        },
    )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def validate(self) -> None:
        check_fields(self)
        bad = [name for name in self.target_modules if name in LORA_UNSUPPORTED]
        if bad:
            raise ConfigError(
                f"target_modules: {bad[0]} cannot be adapted (the output layer and the "
                "embeddings stay full weights)"
            )


@dataclass(kw_only=True)
class MoeConfig:
    """Mixture-of-Experts models: the load-balancing loss and routing replay (R3)."""

    aux_loss_coef: float = field(
        default=0.0,
        metadata={
            "help": "weight of the router's load-balancing loss (Switch style, per sequence: "
            "experts x sum of token share x mean router probability; 0: off)",
            "ge": 0,
        },
    )
    route_replay: bool = field(
        default=False,
        metadata={
            "help": "R3: route each sampled token through the experts the engine chose for "
            "it (needs engine.record_routes=true); the top-k weights still come from the "
            "trainer's router, so it keeps its gradient"
        },
    )


@dataclass(kw_only=True)
class TrainerConfig:
    lr: float | None = field(
        default=1e-6,
        metadata={
            "help": "AdamW learning rate (None: by the model, in dorarl train: 2e-4 for the "
            "shipped base; for a model folder 1e-5 under 1B parameters, 1e-6 from 1B up; a "
            "resumed checkpoint's own)",
            "gt": 0,
        },
    )
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW decoupled weight decay"})
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    warmup_steps: int = field(
        default=0, metadata={"help": "linear learning-rate warmup steps", "ge": 0}
    )
    lr_schedule: Literal["constant", "linear", "cosine"] = field(
        default="constant",
        metadata={
            "help": "the learning rate after warmup: constant; linear or cosine decay from "
            "the peak to lr_floor x the peak at lr_decay_steps, held there after"
        },
    )
    lr_floor: float = field(
        default=0.0,
        metadata={
            "help": "where linear and cosine decay end, as a fraction of the peak rate "
            "(trainer.lr, or lora.lr for adapters): 0.1 ends at a tenth",
            "ge": 0,
            "le": 1,
        },
    )
    lr_decay_steps: int | None = field(
        default=None,
        metadata={
            "help": "the optimizer step at which decay reaches lr_floor, warmup included "
            "(unset: the run's steps)",
            "ge": 1,
        },
    )
    # Derived in `dorarl train` from `steps`, not a setting there: the default decay horizon.
    run_steps: int | None = field(
        default=None, metadata={"help": "the run's steps (lr_decay_steps follows it when unset)"}
    )
    max_grad_norm: float = field(
        default=1.0, metadata={"help": "clip the global gradient norm (<= 0: no clipping)"}
    )
    micro_batch_tokens: int = field(
        default=0,
        metadata={
            "help": "tokens per forward/backward micro-batch, rows x longest row, padding "
            "included (0: as many as keep the activations saved for backward near 2 GiB, "
            "from the model's shape)",
            "ge": 0,
        },
    )
    packing: Literal["shared_prompt", "padded"] = field(
        default="shared_prompt",
        metadata={
            "help": "shared_prompt: a row holds a prompt once, then its group's responses "
            "(block-causal mask, position ids restart per response), several groups per row; "
            "padded: one right-padded row per response, the prompt in each. A model whose "
            "attention cannot take a 4D mask falls back to padded with a warning"
        },
    )
    logits_chunk_tokens: int = field(
        default=512,
        metadata={
            "help": "tokens per chunk through the output layer (log-probs and entropy are "
            "computed chunk by chunk, recomputed in backward): bounds the full-vocabulary "
            "logits in memory to chunk x vocabulary",
            "gt": 0,
        },
    )
    temperature: float = field(
        default=1.0,
        metadata={
            "help": "the engines' sampling temperature; logits are divided "
            "by it so trainer logprobs match the behavior logprobs (> 0: greedy rollouts "
            "have no logprobs to train on)",
            "gt": 0,
        },
    )
    activation_checkpointing: bool = field(
        default=False,
        metadata={
            "help": "keep only each decoder layer's input for backward and recompute the "
            "rest (about a third more compute for a fraction of the activation memory; the "
            "automatic micro-batch grows to match)"
        },
    )
    world_size: int = field(
        default=1,
        metadata={
            "help": "trainer ranks: N > 1 shards the model, gradients and AdamW state over "
            "N processes (FSDP2; gloo on cpu, NCCL on cuda) that split each step's batch "
            "(whole groups with packing=shared_prompt, single sequences with padded); 1: "
            "one process, no sharding",
            "ge": 1,
        },
    )
    dtype: Literal["float32", "bfloat16"] = field(
        default="float32", metadata={"help": "parameter dtype"}
    )
    device: str = field(
        default="cpu", metadata={"help": "torch device: cpu, or cuda (the GPU Ray assigns)"}
    )
    autocast: Autocast = field(
        default="none",
        metadata={
            "help": "bf16: the policy's matrix products in bfloat16 (torch.autocast) on a CPU "
            "with avx512_bf16 or amx_bf16, float32 weights, AdamW state, output layer, "
            "log-probs and loss; none: all float32 (trainer.dtype)"
        },
    )
    kernels: Literal["auto", "torch"] = field(
        default="auto",
        metadata={
            "help": "auto: the trainer's fused C++ CPU kernels (RMSNorm, SwiGLU, the output "
            "layer's softmax) where the trainer computes in float32 on the CPU and they "
            "build, each module checked against its own forward first; torch: torch ops only"
        },
    )
    skip_zero_advantage: bool = field(
        default=True,
        metadata={
            "help": "leave the sequences whose advantage is 0 (a group with equal rewards) out "
            "of the forward and backward when nothing else reads them (no KL, entropy "
            "bonus, teacher, nor an MoE model's expert figures): the same gradient and "
            "update, less compute; their tokens still count in the loss's normaliser, and "
            "the trainer's per-token metrics (entropy, ratios, mismatch) cover the tokens "
            "it computed"
        },
    )
    reference_path: str | None = field(
        default=None,
        metadata={"help": "frozen reference for the KL (default: the initial model)", "path": True},
    )
    teacher: str | None = field(
        default=None,
        metadata={
            "help": "on-policy distillation: a frozen teacher (HF folder, the policy's "
            "tokenizer) on the trainer's device; loss.distill_coef weighs its reward",
            "path": True,
        },
    )
    loss: LossConfig = field(default_factory=LossConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def validate(self) -> None:
        check_fields(self)  # the sections' fields too, named loss.*, moe.* and lora.*
        for name, section in (("loss", self.loss), ("lora", self.lora)):
            try:
                section.validate()
            except ConfigError as exc:
                raise ConfigError(f"{name}.{exc}") from None
        check_autocast(self.autocast, self.device, self.dtype)
        if (self.teacher is None) != (self.loss.distill_coef == 0):
            raise ConfigError(
                "teacher: on-policy distillation needs both trainer.teacher and "
                "loss.distill_coef > 0"
            )
        self.check_schedule(needs_horizon=False)  # `dorarl train` fills it from steps later

    def check_schedule(self, needs_horizon: bool = True) -> None:
        """A decay that has a horizon past its warmup."""
        if self.lr_schedule == "constant":
            return
        decay = self.decay_steps()
        if decay is None:
            if not needs_horizon:
                return
            raise ConfigError(
                f"lr_decay_steps: lr_schedule={self.lr_schedule} needs the step its decay ends at"
            )
        if decay <= self.warmup_steps:
            given = "" if self.lr_decay_steps is not None else " (unset: the run's steps)"
            raise ConfigError(
                f"lr_decay_steps: {decay}{given} must be more than warmup_steps="
                f"{self.warmup_steps} "
                f"for lr_schedule={self.lr_schedule} to decay"
            )

    def decay_steps(self) -> int | None:
        """The step where decay ends: lr_decay_steps, else the run's steps."""
        return self.lr_decay_steps if self.lr_decay_steps is not None else self.run_steps

    def schedule(self) -> LrSchedule:
        return LrSchedule(
            peak=self.peak_lr(),
            kind=self.lr_schedule,
            warmup=self.warmup_steps,
            decay_steps=self.decay_steps(),
            floor=self.lr_floor,
        )

    def peak_lr(self) -> float:
        """The learning rate after warmup: lora.lr for adapters when it is set, else lr."""
        if self.lora.enabled and self.lora.lr is not None:
            return self.lora.lr
        return self.lr
