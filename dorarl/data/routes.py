"""Recorded expert routes: per sampled token, the expert ids every sparse layer chose.

A request's routes are one `bytes` value, token-major: for each output token, `width` ids
(top_k per sparse layer, layers in order) in `route_dtype(num_experts)`: uint8 up to 254
experts, else int16. An output token with no route (an environment's observation) holds
all-ones bytes, which read as 255 (uint8) or -1 (int16): `NO_ROUTE` after `decode`. A token's
route is that of the forward row whose logits sampled it, so it is computed once, in the step
that sampled the token, and travels with the request (export, import, resume) as its logprob
does. Torch-free: samples carry routes as plain bytes from the engines to the trainer.
"""

from __future__ import annotations

NO_ROUTE = -1  # an unrecorded expert id, as the trainer reads it


def route_dtype(num_experts: int) -> str:
    """The narrowest dtype that holds every expert id and the all-ones 'no route' value."""
    return "uint8" if num_experts < 255 else "int16"


def itemsize(num_experts: int) -> int:
    return 1 if route_dtype(num_experts) == "uint8" else 2


def unrecorded(tokens: int, width: int, num_experts: int) -> bytes:
    """The routes of `tokens` tokens that sampled nothing (observations)."""
    return b"\xff" * (tokens * width * itemsize(num_experts))


def route_bytes(tokens: int, width: int, num_experts: int) -> int:
    """How many bytes `tokens` tokens' routes take."""
    return tokens * width * itemsize(num_experts)
