"""What a rollout engine backend can do beyond the calls every backend answers
(interface.py), so the runtime and controller plan by capability (a migration with KV or
as a re-prefill), never by a backend's name."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Capabilities:
    """Optional abilities of one engine backend, beyond `InstanceEngine`."""

    kv_export: bool  # export_request / import_request carry a request's KV (else re-prefill)
    offload: bool  # offload: a request's KV moves to host memory and back
    adapters: bool  # several resident versions as LoRA adapters (load_adapter)
    route_recording: bool  # MoE: each sampled token's experts (engine.record_routes)
    serves_weights: bool  # state_dict: the hosted weights by HF name, to serve a peer
    exact_logprobs: bool  # behaviour log-probs bit-identical to the trainer's forward


DORARL_CAPABILITIES = Capabilities(
    kv_export=True, offload=True, adapters=True, route_recording=True,
    serves_weights=True, exact_logprobs=True,
)  # fmt: skip
"""Our engine: KV travels with a migrated request and moves to host memory, adapters share
a step, MoE routes are recorded, the weights are served to peers, log-probs are the
trainer's."""
