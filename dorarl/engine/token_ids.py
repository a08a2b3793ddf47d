"""Token ids from users, checked: integers (numpy/torch integer scalars too) become ints,
anything else (float, bool, None, str) is a one-line UserInputError naming request and position.
A request's prompt and a snapshot to continue are checked against the context and the
vocabulary here too, the same for every engine backend.

Torch-free, like `SamplingParams`: the controller imports the engine's plain types without torch.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

from dorarl.errors import UserInputError


def checked_token_ids(request_id: str, ids: Any, what: str = "prompt") -> list[int]:
    """`ids` as a list of ints; `what` names the field in the error ("prompt", "output_ids")."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise UserInputError(
            f"request {request_id!r}: {what} must be a list of token ids, got {type(ids).__name__}"
        )
    return [_token_id(request_id, what, i, t) for i, t in enumerate(ids)]


def check_prompt(request_id: str, prompt: list[int], max_model_len: int, vocab_size: int) -> None:
    """A new request's prompt: not empty, room for one new token, ids in the vocabulary."""
    if not prompt:
        raise UserInputError(f"request {request_id!r}: empty prompt")
    if len(prompt) >= max_model_len:
        raise UserInputError(
            f"request {request_id!r}: prompt has {len(prompt)} tokens, max_model_len is "
            f"{max_model_len} (the prompt must leave room for at least one new token; "
            "engine.max_model_len)"
        )
    check_vocabulary(request_id, prompt, vocab_size, "")


def check_vocabulary(request_id: str, token_ids: list[int], vocab_size: int, what: str) -> None:
    """Refuse token ids outside a vocabulary of `vocab_size` (`what` names the tokens)."""
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise UserInputError(
            f"request {request_id!r}: {what}token id {bad[0]} is outside the vocabulary "
            f"(size {vocab_size})"
        )


def segment_prompt(
    request_id: str, prompt_ids: Any, vocab_size: int, max_model_len: int, needs: int
) -> list[int] | None:
    """A new segment's prompt, checked (non-empty, ids within the vocabulary); None when it
    leaves fewer than `needs` tokens of room under max_model_len (nothing is opened)."""
    prompt = checked_token_ids(request_id, prompt_ids, "prompt_ids")
    if not prompt:
        raise UserInputError(f"request {request_id!r}: a new segment with an empty prompt")
    check_vocabulary(request_id, prompt, vocab_size, "segment prompt ")
    return prompt if max_model_len - len(prompt) >= needs else None


def check_snapshot(snap: Any, max_model_len: int) -> None:
    """A request snapshot to continue: its per-token lists agree and it leaves room for a
    token under `max_model_len`; one line naming the request otherwise."""
    if not len(snap.output_ids) == len(snap.logprobs) == len(snap.versions):
        raise UserInputError(
            f"request {snap.request_id!r}: output_ids, logprobs and versions differ in length"
        )
    if snap.num_tokens >= max_model_len:
        raise UserInputError(
            f"request {snap.request_id!r}: {snap.num_tokens} tokens leave no room under "
            f"max_model_len {max_model_len}"
        )


def _token_id(request_id: str, what: str, position: int, value: Any) -> int:
    # int() would truncate 6.7 to 6 and accept True as 1; operator.index takes only integers.
    if not _is_bool(value):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise UserInputError(
        f"request {request_id!r}: {what} token at position {position} is {value!r} "
        f"({type(value).__name__}), not an integer token id"
    )


def _is_bool(value: Any) -> bool:
    # Python bools are ints to operator.index; so are torch bool tensors.
    return isinstance(value, bool) or "bool" in str(getattr(value, "dtype", ""))
