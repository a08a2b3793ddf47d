"""The policy objectives as pure functions over tensors (no model, no optimizer), chosen by
the data of a LossConfig: the ratio (per token, or GSPO's per sequence), the kind of term
(PPO's clip or CISPO's clipped stop-gradient weight), the mismatch mask (IcePop).

Per token t of response i, with base logprob b_t (the engine's behavior logprob, or the
trainer's own pre-step one for ratio_base=proximal):
    token ratio:     r_t = exp(logp_t - b_t)
    sequence ratio:  s_i = exp(mean over i's trained tokens of (logp_t - b_t))   (GSPO)
    sequence_token:  s_i,t = sg(s_i) * exp(logp_t - sg(logp_t))                  (GSPO-token)
    ppo_clip:        loss_t = -min(r_t * A_i, clip(r_t, 1 - eps_low, 1 + eps_high) * A_i)
    cispo:           loss_t = -sg(clip(r_t, 1 - cispo_eps_low, 1 + cispo_eps_high)) * A_i * logp_t
A "sequence" is one TrainSequence: a segment of a multi-turn episode, observations excluded.
Aggregation is a weighted sum with per-token weights fixed for the whole batch
(`token_weights`), so summing micro-batch losses gives exactly the full-batch loss and
gradient. Invariant: when logp == b the ratio is 1 and the gradient is the plain policy
gradient -A * grad(logp) times the token's weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dorarl.trainer.config import LossConfig

# exp() of a log-ratio beyond this is inf/0 in float32 and carries no useful signal.
MAX_LOG_RATIO = 20.0


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(logits / T)[target] per position; logits (..., V), targets (...)."""
    scaled = logits.float() / temperature
    picked = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / T) per position."""
    scaled = logits.float() / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi || ref) on tokens sampled from pi: exp(d) - d - 1, d = ref - logp."""
    d = (ref_logp - logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.exp(d) - d - 1.0


@dataclass
class Spans:
    """Which of `size` sequences each token belongs to (`index`, -1 off the loss) and which
    tokens the loss sees (`mask`), for per-sequence means over trained tokens."""

    index: torch.Tensor
    mask: torch.Tensor
    size: int

    @classmethod
    def of(cls, batch) -> Spans:
        """A MicroBatch's or PackedBatch's spans."""
        return cls(batch.seq_index, batch.mask, len(batch.sequences))

    def _picked(self) -> tuple[torch.Tensor, torch.Tensor]:
        keep = (self.mask & (self.index >= 0)).reshape(-1)
        return keep, self.index.reshape(-1).clamp(min=0)

    def means(self, values: torch.Tensor) -> torch.Tensor:
        """Per sequence: the mean of `values` over its trained tokens (0 with none)."""
        keep, index = self._picked()
        flat = values.reshape(-1)
        sums = flat.new_zeros(self.size).index_add(0, index[keep], flat[keep])
        ones = torch.ones_like(flat[keep])
        counts = flat.new_zeros(self.size).index_add(0, index[keep], ones)
        return sums / counts.clamp(min=1)

    def per_token(self, per_sequence: torch.Tensor) -> torch.Tensor:
        """A per-sequence value at each of the sequence's tokens (shape of `index`)."""
        _, index = self._picked()
        return per_sequence[index].reshape(self.index.shape)

    def present(self) -> torch.Tensor:
        """Which sequences have trained tokens."""
        keep, index = self._picked()
        return torch.zeros(self.size, dtype=torch.bool, device=index.device).index_fill(
            0, index[keep], True
        )


@dataclass
class PolicyTerms:
    """Per-token pieces of the objective, for the loss and its metrics."""

    loss: torch.Tensor
    ratio: torch.Tensor
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor
    importance: torch.Tensor | None = None
    truncated: torch.Tensor | None = None
    is_masked: torch.Tensor | None = None  # tokens the mismatch mask left out
    seq_ratio: torch.Tensor | None = None  # per sequence with trained tokens (ratio=sequence*)


def policy_terms(
    logp: torch.Tensor,
    behavior_logp: torch.Tensor,
    advantages: torch.Tensor,
    cfg: LossConfig,
    spans: Spans | None = None,
) -> PolicyTerms:
    """Per-token policy loss (see the module docstring); same shape as `logp`. `spans` is
    needed by the sequence ratio and the sequence mask."""
    base = behavior_logp if cfg.ratio_base == "behavior" else logp.detach()
    log_ratio, seq_ratio = _log_ratio(logp, base, cfg.ratio, spans)
    ratio = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    if cfg.kind == "cispo":
        terms = _cispo(ratio, logp, advantages, cfg)
    else:
        terms = _ppo_clip(ratio, advantages, cfg)
    terms.seq_ratio = seq_ratio
    if cfg.ratio_base == "proximal":
        _apply_importance(terms, logp.detach() - behavior_logp, cfg.tis_cap)
    if cfg.is_mask != "none":
        _apply_is_mask(terms, logp.detach() - behavior_logp, cfg, spans)
    return terms


def _log_ratio(
    logp: torch.Tensor, base: torch.Tensor, kind: str, spans: Spans | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The per-token log-ratio the objective clips, and the sequence ratios (GSPO) if any."""
    if kind == "token":
        return logp - base, None
    assert spans is not None, f"ratio={kind} needs the batch's sequence spans"
    seq_log = spans.means(logp - base).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    seq_ratio = torch.exp(seq_log.detach())[spans.present()]
    per_token = spans.per_token(seq_log)
    if kind == "sequence":
        return per_token, seq_ratio
    # GSPO-token: the sequence ratio's value, each token's own gradient.
    return per_token.detach() + logp - logp.detach(), seq_ratio


def _ppo_clip(ratio: torch.Tensor, advantages: torch.Tensor, cfg: LossConfig) -> PolicyTerms:
    low, high = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(low, high)
    loss = torch.maximum(unclipped, clipped)
    if cfg.dual_clip is not None:
        bound = -advantages * cfg.dual_clip
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
    return PolicyTerms(
        loss, ratio.detach(), (advantages < 0) & (ratio < low), (advantages > 0) & (ratio > high)
    )


def _cispo(
    ratio: torch.Tensor, logp: torch.Tensor, advantages: torch.Tensor, cfg: LossConfig
) -> PolicyTerms:
    """CISPO: a REINFORCE term weighted by the clipped ratio, itself without gradient, so a
    clipped token still carries its policy gradient (only its weight is bounded)."""
    low, high = 1.0 - cfg.cispo_eps_low, 1.0 + cfg.cispo_eps_high
    weight = ratio.detach().clamp(low, high)
    loss = -weight * advantages * logp
    return PolicyTerms(loss, ratio.detach(), ratio.detach() < low, ratio.detach() > high)


def _apply_is_mask(
    terms: PolicyTerms, log_weight: torch.Tensor, cfg: LossConfig, spans: Spans | None
) -> None:
    """IcePop: no policy loss where the trainer/behavior weight leaves [low, high] (per
    token, or by the sequence's geometric-mean weight)."""
    if cfg.is_mask == "sequence":
        assert spans is not None, "is_mask=sequence needs the batch's sequence spans"
        log_weight = spans.per_token(spans.means(log_weight))
    weight = torch.exp(log_weight.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    masked = (weight < cfg.is_mask_low) | (weight > cfg.is_mask_high)
    terms.is_masked = masked
    terms.loss = torch.where(masked, torch.zeros_like(terms.loss), terms.loss)


def _apply_importance(terms: PolicyTerms, log_weight: torch.Tensor, cap: float | None) -> None:
    """Decoupled PPO: correct the behavior/proximal gap with a (truncated) importance weight."""
    weight = torch.exp(log_weight.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    terms.truncated = (
        weight > cap if cap is not None else torch.zeros_like(weight, dtype=torch.bool)
    )
    if cap is not None:
        weight = weight.clamp(max=cap)
    terms.importance = weight
    terms.loss = terms.loss * weight


def token_weights(
    response_lengths: list[int],
    aggregation: str,
    total_tokens: int,
    total_sequences: int,
    norm_length: int | None = None,
) -> list[float]:
    """The weight of every token of each response, normalised over the whole batch.

    token_mean: 1 / total_tokens; seq_mean: 1 / (len_i * total_sequences); seq_sum_norm
    (Dr. GRPO): 1 / (norm_length * total_sequences). Responses with no tokens get no weight
    and are not counted in `total_sequences` by the caller.
    """
    if aggregation == "token_mean":
        return [1.0 / total_tokens if n else 0.0 for n in response_lengths]
    if aggregation == "seq_mean":
        return [1.0 / (n * total_sequences) if n else 0.0 for n in response_lengths]
    if aggregation == "seq_sum_norm":
        assert norm_length, "seq_sum_norm needs a norm_length"
        return [1.0 / (norm_length * total_sequences) if n else 0.0 for n in response_lengths]
    raise ValueError(f"unknown aggregation {aggregation!r}")


def distill_advantages(
    advantages: torch.Tensor,
    behavior_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    cfg: LossConfig,
) -> torch.Tensor:
    """On-policy distillation (Agarwal et al. 2024, GKD; Thinking Machines 2025): each
    sampled token's reward is minus its reverse KL to the teacher, log q(y_t) - log pi(y_t),
    the sampler's logprob standing for pi, so the policy gradient lowers KL(pi || q)."""
    return cfg.rl_coef * advantages + cfg.distill_coef * (teacher_logp - behavior_logp)


def weighted_sum(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum(values * weights); weights are 0 off the response tokens."""
    return (values * weights).sum()


def objective(
    logp: torch.Tensor,
    behavior_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    cfg: LossConfig,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    spans: Spans | None = None,
    teacher_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, PolicyTerms]:
    """The scalar loss of a (micro-)batch: policy loss + kl_coef * k3 - entropy_coef * H;
    with a teacher, the policy loss's advantages carry its distillation reward."""
    if teacher_logp is not None:
        advantages = distill_advantages(advantages, behavior_logp, teacher_logp, cfg)
    terms = policy_terms(logp, behavior_logp, advantages, cfg, spans)
    loss = weighted_sum(terms.loss, weights)
    if cfg.kl_coef > 0.0:
        assert ref_logp is not None, "kl_coef > 0 needs reference logprobs"
        loss = loss + cfg.kl_coef * weighted_sum(k3_kl(logp, ref_logp), weights)
    if cfg.entropy_coef != 0.0:
        assert entropy is not None, "entropy_coef != 0 needs entropies with gradient"
        loss = loss - cfg.entropy_coef * weighted_sum(entropy, weights)
    return loss, terms
