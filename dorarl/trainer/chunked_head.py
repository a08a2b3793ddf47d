"""Token log-probabilities and entropies through the output layer, chunk by chunk over tokens.

The full-vocabulary logits of a micro-batch (tokens x vocabulary, float32) never exist at
once: forward keeps only each token's log-sum-exp, backward recomputes one chunk of logits
at a time from the saved hidden states. Peak memory of the head is a few chunk x vocabulary
arrays whatever the batch. Values follow `loss.token_logprobs` / `loss.token_entropy`
exactly: log softmax(logits.float() / T).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dorarl.trainer.kernels import load_ops, takes


def _scaled_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    # F.linear's output is fresh: divide in place rather than allocate another chunk x vocab.
    return F.linear(hidden, weight, bias).float().div_(temperature)


def _entropy(scaled: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    logp = scaled - lse.unsqueeze(-1)
    return -(logp.exp() * logp).sum(-1)


class ChunkedHeadLogprobs(torch.autograd.Function):
    """(hidden (N, H), weight (V, H), bias, targets (N,)) -> (logp (N,), entropy (N,))."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_tokens, fused):
        n = hidden.shape[0]
        logp = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        stats = _fused_stats if fused else _torch_stats
        for start in range(0, n, chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            scaled = _scaled_logits(hidden[rows], weight, bias, temperature)
            lse[rows], logp[rows], entropy[rows] = stats(scaled, targets[rows])
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature, ctx.chunk_tokens, ctx.fused = temperature, chunk_tokens, fused
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        temperature = ctx.temperature
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if want_hidden else None
        # Accumulate the head's gradient over chunks in at least float32 (bfloat16 weights).
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_weight = torch.zeros_like(weight, dtype=acc) if want_weight else None
        grad_bias = torch.zeros_like(bias, dtype=acc) if want_bias else None
        if grad_logp is None and grad_entropy is None:
            return grad_hidden, grad_weight, grad_bias, None, None, None, None
        grad_of = _fused_grad if ctx.fused else _torch_grad
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            scaled = _scaled_logits(hidden[rows], weight, bias, temperature)
            grad_logits = grad_of(
                scaled,
                lse[rows],
                targets[rows],
                entropy[rows],
                None if grad_logp is None else grad_logp[rows],
                None if grad_entropy is None else grad_entropy[rows],
                temperature,
            )
            if want_hidden:
                grad_hidden[rows] = grad_logits.to(weight.dtype) @ weight
            if want_weight:
                grad_weight.addmm_(grad_logits.t().to(acc), hidden[rows].to(acc))
            if want_bias:
                grad_bias += grad_logits.sum(0).to(acc)
        grad_weight = grad_weight.to(weight.dtype) if want_weight else None
        grad_bias = grad_bias.to(bias.dtype) if want_bias else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _torch_stats(scaled: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(lse, logp, entropy) of one chunk by torch ops."""
    lse = torch.logsumexp(scaled, dim=-1)
    picked = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return lse, picked - lse, _entropy(scaled, lse)


def _fused_stats(scaled: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The same in one pass per row (dorarl.trainer.kernels)."""
    return load_ops().head_stats(scaled, targets.contiguous())


def _torch_grad(scaled, lse, targets, entropy, grad_logp, grad_entropy, temperature):
    grad = _grad_scaled(scaled, lse, targets, entropy, grad_logp, grad_entropy)
    return grad.div_(temperature)  # d scaled / d logits = 1 / T


def _fused_grad(scaled, lse, targets, entropy, grad_logp, grad_entropy, temperature):
    """The gradient over the logits, written over `scaled` in one pass per row."""
    zero = torch.zeros_like(lse)
    load_ops().head_grad_(
        scaled,
        lse.contiguous(),
        targets.contiguous(),
        entropy.contiguous(),
        zero if grad_logp is None else grad_logp.float().contiguous(),
        zero if grad_entropy is None else grad_entropy.float().contiguous(),
        1.0 / temperature,
    )
    return scaled


def _grad_scaled(
    scaled: torch.Tensor,
    lse: torch.Tensor,
    targets: torch.Tensor,
    entropy: torch.Tensor,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
) -> torch.Tensor:
    """d/dz of sum(g_logp * logp + g_H * H) for z = scaled logits of one chunk.

    d logp_t / dz = onehot(t) - p;  dH / dz = -p * (log p + H).
    """
    logp_all = scaled.sub_(lse.unsqueeze(-1))  # `scaled` is not needed any more
    probs = logp_all.exp()
    if grad_logp is None:
        grad = torch.zeros_like(probs)
    else:
        grad = probs * grad_logp.neg().unsqueeze(-1)
        grad.scatter_add_(-1, targets.unsqueeze(-1), grad_logp.unsqueeze(-1))
    if grad_entropy is not None:
        logp_all.add_(entropy.unsqueeze(-1)).mul_(probs)
        grad.addcmul_(logp_all, grad_entropy.unsqueeze(-1), value=-1.0)
    return grad


def chunked_head_logprobs(
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of `targets` and entropies under softmax(head(hidden) / T).

    hidden (N, H) and targets (N,) are flat over tokens; returns two float32 (N,) tensors.
    Both carry gradients to `hidden` and to the head's parameters. `fused`: the softmax
    statistics and their gradient by the trainer's C++ kernels where they take the logits
    (float32 on the CPU, kernels built).
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be > 0, got {chunk_tokens}")
    # Under autocast (trainer.autocast) the logits stay in the head's dtype: bfloat16 logits
    # would shift log-probs by their rounding, and backward (run outside autocast) recomputes
    # them in that dtype anyway.
    with torch.autocast(hidden.device.type, enabled=False):
        return ChunkedHeadLogprobs.apply(
            hidden.to(head.weight.dtype),
            head.weight,
            head.bias,
            targets,
            float(temperature),
            int(chunk_tokens),
            fused and takes(head.weight) and load_ops() is not None,
        )
