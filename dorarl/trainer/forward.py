"""A micro-batch through the policy to per-token log-probabilities and entropies.

When the model is a body plus a plain linear output layer (checked once, numerically), the
body runs to hidden states and only the response positions go through the output layer, in
chunks (dorarl.trainer.chunked_head): no full-vocabulary logits of the micro-batch, and no
output-layer work for prompt or padding positions. Other models fall back to full logits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from dorarl.trainer.batch import MicroBatch
from dorarl.trainer.chunked_head import chunked_head_logprobs
from dorarl.trainer.loss import token_entropy, token_logprobs

log = logging.getLogger(__name__)


@dataclass
class HeadSplit:
    body: torch.nn.Module
    head: torch.nn.Linear


def split_head(model: PreTrainedModel) -> HeadSplit | None:
    """The model's body and output layer, if logits are exactly head(body(ids)).

    Checked on a few tokens: a family that post-processes its logits (soft-capping, scaling)
    or whose body is not `base_model` gets None, and the caller uses the full logits.
    """
    head = model.get_output_embeddings()
    body = model.base_model
    if not isinstance(head, torch.nn.Linear) or body is model:
        return None
    split = HeadSplit(body, head)
    vocab = head.weight.shape[0]
    ids = torch.arange(8, device=head.weight.device).remainder(vocab).unsqueeze(0)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            expected = model(input_ids=ids, use_cache=False).logits
            got = head(_hidden(split, ids))
    except (TypeError, AttributeError) as exc:
        log.warning("output layer not split from %s (%s): full logits", type(model).__name__, exc)
        return None
    finally:
        model.train(training)
    if got.shape != expected.shape or not torch.allclose(got, expected, rtol=1e-4, atol=1e-5):
        log.warning("%s post-processes its logits: full logits", type(model).__name__)
        return None
    return split


def _hidden(split: HeadSplit, input_ids: torch.Tensor) -> torch.Tensor:
    return split.body(input_ids=input_ids, use_cache=False).last_hidden_state


def micro_batch_logprobs(
    model: PreTrainedModel,
    split: HeadSplit | None,
    batch: MicroBatch,
    temperature: float,
    chunk_tokens: int,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, entropy), each (rows, width - 1) float32, zero off the response tokens (the
    full-logits fallback fills every position). Entropy carries a gradient if `entropy_grad`."""
    if split is None:
        logits = model(input_ids=batch.input_ids, use_cache=False).logits[:, :-1]
        logp = token_logprobs(logits, batch.targets, temperature)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            return logp, token_entropy(logits, temperature)
    hidden = _hidden(split, batch.input_ids)[:, :-1]
    mask = batch.mask
    logp, entropy = chunked_head_logprobs(
        hidden[mask], split.head, batch.targets[mask], temperature, chunk_tokens
    )
    return _scatter(mask, logp), _scatter(mask, entropy if entropy_grad else entropy.detach())


def _scatter(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=values.dtype, device=values.device).masked_scatter(
        mask, values
    )
