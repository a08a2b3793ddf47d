"""A micro-batch through the policy to per-token log-probabilities and entropies.

When the model is a body plus a plain linear output layer (checked once, numerically), the
body runs to hidden states and only the response positions go through the output layer, in
chunks (dorarl.trainer.chunked_head): no full-vocabulary logits of the micro-batch, and no
output-layer work for prompt or padding positions. Other models fall back to full logits.
A packed micro-batch (dorarl.trainer.packing) runs with its position ids and block-causal
mask; `resolve_packing` checks once, numerically, that the model honours them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from dorarl.trainer.batch import MicroBatch, TrainSequence
from dorarl.trainer.chunked_head import chunked_head_logprobs
from dorarl.trainer.loss import token_entropy, token_logprobs
from dorarl.trainer.packing import PackedBatch, Packing, Segment, collate_packed

log = logging.getLogger(__name__)


@dataclass
class HeadSplit:
    body: torch.nn.Module
    head: torch.nn.Linear
    fused: bool = False  # the head's softmax by the trainer's C++ kernels where they take it


def split_head(model: PreTrainedModel, fused: bool = False) -> HeadSplit | None:
    """The model's body and output layer, if logits are exactly head(body(ids)).

    Checked on a few tokens: a family that post-processes its logits (soft-capping, scaling)
    or whose body is not `base_model` gets None, and the caller uses the full logits.
    """
    head = model.get_output_embeddings()
    body = model.base_model
    if not isinstance(head, torch.nn.Linear) or body is model:
        return None
    split = HeadSplit(body, head, fused)
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


def _hidden(split: HeadSplit, input_ids: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor:
    return split.body(input_ids=input_ids, use_cache=False, **inputs).last_hidden_state


def micro_batch_logprobs(
    model: PreTrainedModel,
    split: HeadSplit | None,
    batch: MicroBatch | PackedBatch,
    temperature: float,
    chunk_tokens: int,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, entropy) float32, shaped like `batch.targets`: (rows, width - 1) for a padded
    batch, zero off the response tokens (the full-logits fallback fills every position), one
    per response token for a packed one. Entropy carries a gradient if `entropy_grad`."""
    if isinstance(batch, PackedBatch):
        return _packed_logprobs(model, split, batch, temperature, chunk_tokens, entropy_grad)
    if split is None:
        logits = model(input_ids=batch.input_ids, use_cache=False).logits[:, :-1]
        logp = token_logprobs(logits, batch.targets, temperature)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            return logp, token_entropy(logits, temperature)
    hidden = _hidden(split, batch.input_ids)[:, :-1]
    mask = batch.mask
    logp, entropy = chunked_head_logprobs(
        hidden[mask], split.head, batch.targets[mask], temperature, chunk_tokens, split.fused
    )
    return _scatter(mask, logp), _scatter(mask, entropy if entropy_grad else entropy.detach())


def _scatter(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=values.dtype, device=values.device).masked_scatter(
        mask, values
    )


def _packed_logprobs(
    model: PreTrainedModel,
    split: HeadSplit | None,
    batch: PackedBatch,
    temperature: float,
    chunk_tokens: int,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = _packed_inputs(model, batch)
    if split is None:
        logits = model(input_ids=batch.input_ids, use_cache=False, **inputs).logits
        picked = logits.flatten(0, 1)[batch.sources]
        logp = token_logprobs(picked, batch.targets, temperature)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            return logp, token_entropy(picked, temperature)
    hidden = _hidden(split, batch.input_ids, **inputs).flatten(0, 1)[batch.sources]
    logp, entropy = chunked_head_logprobs(
        hidden, split.head, batch.targets, temperature, chunk_tokens, split.fused
    )
    return logp, entropy if entropy_grad else entropy.detach()


def _packed_inputs(model: PreTrainedModel, batch: PackedBatch) -> dict[str, torch.Tensor]:
    """Position ids, and the mask as an additive float tensor in the model's dtype: given a
    boolean one, sdpa makes (and keeps for backward) a float copy in every layer; this one
    tensor is shared by all of them, and eager attention adds it as it is."""
    dtype = next(model.parameters()).dtype
    additive = torch.zeros(batch.attention_mask.shape, dtype=dtype, device=batch.input_ids.device)
    additive.masked_fill_(~batch.attention_mask, float("-inf"))
    return {"position_ids": batch.position_ids, "attention_mask": additive}


def resolve_packing(models: list[PreTrainedModel], packing: Packing) -> Packing:
    """`packing`, or "padded" (with one warning) if a model cannot take packed rows."""
    if packing == "padded":
        return packing
    for model in models:
        reason = _packing_problem(model)
        if reason is not None:
            log.warning("trainer.packing=padded: %s %s", type(model).__name__, reason)
            return "padded"
    return packing


def _packing_problem(model: PreTrainedModel) -> str | None:
    """Why packed rows would not give `model`'s log-probs of separate sequences, or None.

    Checked numerically on a few tokens (two responses to one prompt, and a second segment
    in the same row): an attention that ignores a 4D mask or position ids shows up here.
    """
    if _has_sliding_window(model.config):
        return "has sliding-window attention (a 4D mask replaces it)"
    vocab = model.get_input_embeddings().weight.shape[0]
    device = next(model.parameters()).device
    segments = [
        _probe_segment([1, 2, 3], [[4, 5], [6, 7, 8]], vocab),
        _probe_segment([9], [[2]], vocab),
    ]
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            batch = collate_packed([segments], 0, device)
            inputs = _packed_inputs(model, batch)
            packed = model(input_ids=batch.input_ids, use_cache=False, **inputs).logits
            got = packed.flatten(0, 1)[batch.sources].float()
            expected = torch.cat([_alone_logits(model, s, device) for s in segments]).float()
    except (TypeError, ValueError, RuntimeError) as exc:
        return f"cannot take a 4D attention mask ({exc})"
    finally:
        model.train(training)
    tol = 1e-4 if packed.dtype == torch.float32 else 3e-2
    if not torch.allclose(got, expected, rtol=tol, atol=tol * float(expected.abs().max())):
        return "gives other log-probs with a 4D mask and position ids"
    return None


def _probe_segment(prompt: list[int], responses: list[list[int]], vocab: int) -> Segment:
    seqs = [
        TrainSequence([t % vocab for t in prompt], [t % vocab for t in r], [0.0] * len(r), 0.0)
        for r in responses
    ]
    return Segment(seqs[0].prompt_ids, seqs)


def _alone_logits(model: PreTrainedModel, segment: Segment, device: torch.device) -> torch.Tensor:
    """The logits that predict each response token, each response in its own sequence."""
    out = []
    for seq in segment.responses:
        ids = torch.tensor([seq.prompt_ids + seq.response_ids], device=device)
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
        out.append(logits[len(seq.prompt_ids) - 1 :])
    return torch.cat(out)


def _has_sliding_window(config) -> bool:
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types):
        return True
    window = getattr(config, "sliding_window", None)
    return window is not None and getattr(config, "use_sliding_window", True)
