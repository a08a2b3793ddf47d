"""The async GRPO objective as pure functions over tensors (no model, no optimizer).

Per token t of response i, with behavior logprob b_t recorded by the engine that sampled it:
    ratio_t = exp(logp_t - b_t)
    loss_t  = -min(ratio_t * A_i, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A_i)
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
class PolicyTerms:
    """Per-token pieces of the clipped objective, for the loss and its metrics."""

    loss: torch.Tensor
    ratio: torch.Tensor
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor
    importance: torch.Tensor | None = None
    truncated: torch.Tensor | None = None


def policy_terms(
    logp: torch.Tensor, behavior_logp: torch.Tensor, advantages: torch.Tensor, cfg: LossConfig
) -> PolicyTerms:
    """Per-token clipped policy loss (see the module docstring); same shape as `logp`."""
    base = behavior_logp if cfg.ratio_base == "behavior" else logp.detach()
    ratio = torch.exp((logp - base).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    low, high = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(low, high)
    loss = torch.maximum(unclipped, clipped)
    if cfg.dual_clip is not None:
        bound = -advantages * cfg.dual_clip
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
    terms = PolicyTerms(
        loss, ratio.detach(), (advantages < 0) & (ratio < low), (advantages > 0) & (ratio > high)
    )
    if cfg.ratio_base == "proximal":
        _apply_importance(terms, logp.detach() - behavior_logp, cfg.tis_cap)
    return terms


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
    response_lengths: list[int], aggregation: str, total_tokens: int, total_sequences: int
) -> list[float]:
    """The weight of every token of each response, normalised over the whole batch.

    token_mean: 1 / total_tokens; seq_mean: 1 / (len_i * total_sequences). Responses with no
    tokens get no weight and are not counted in `total_sequences` by the caller.
    """
    if aggregation == "token_mean":
        return [1.0 / total_tokens if n else 0.0 for n in response_lengths]
    if aggregation == "seq_mean":
        return [1.0 / (n * total_sequences) if n else 0.0 for n in response_lengths]
    raise ValueError(f"unknown aggregation {aggregation!r}")


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
) -> tuple[torch.Tensor, PolicyTerms]:
    """The scalar loss of a (micro-)batch: policy loss + kl_coef * k3 - entropy_coef * H."""
    terms = policy_terms(logp, behavior_logp, advantages, cfg)
    loss = weighted_sum(terms.loss, weights)
    if cfg.kl_coef > 0.0:
        assert ref_logp is not None, "kl_coef > 0 needs reference logprobs"
        loss = loss + cfg.kl_coef * weighted_sum(k3_kl(logp, ref_logp), weights)
    if cfg.entropy_coef != 0.0:
        assert entropy is not None, "entropy_coef != 0 needs entropies with gradient"
        loss = loss - cfg.entropy_coef * weighted_sum(entropy, weights)
    return loss, terms
