"""Weights into a running vLLM engine: a worker extension (vLLM mixes it into its worker
class, `worker_extension_cls`) that checks the tensors it received, then reloads them.

What is checked is what the worker received, just before `reload_weights`: on the CPU
vLLM fuses q/k/v and gate/up and hands its linear weights to oneDNN or its packed GEMM
kernels, keeping an empty tensor in the parameter's place, so the loaded parameters cannot
be read back as Hugging Face tensors to compare. The check is the caller's (the runtime's
fingerprint against the sender's manifest: this layer knows neither), and a refusal leaves
the old weights loaded. vllm is imported by vLLM's worker before this class is used.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

WeightsCheck = Callable[[dict[str, torch.Tensor]], None]
"""Raises (e.g. WeightsRefused) unless the named tensors are the version the sender sent."""

EXTENSION = "dorarl.engine.vllm.weights.WorkerWeights"


class WorkerWeights:
    """Methods vLLM adds to its worker; `self` is the worker (`reload_weights` is its)."""

    def dorarl_load(self, named: dict[str, torch.Tensor], check: WeightsCheck | None) -> int:
        """Check `named` here, in the worker, then reload them in place (HF names, the
        checkpoint's layout); returns how many tensors were loaded."""
        if check is not None:
            check(named)
        self.reload_weights(  # type: ignore[attr-defined]
            weights_iterator=iter(named.items()), is_checkpoint_format=True
        )
        refresh_tied(self.model_runner.get_model())  # type: ignore[attr-defined]
        return len(named)


def refresh_tied(model: torch.nn.Module) -> int:
    """Process again every layer whose weight is another layer's (a tied output layer);
    returns how many. `reload_weights` processes the layers whose names it loaded, and a
    tied `lm_head`'s name never comes (its weight is the embedding's): on the CPU its
    packed copy for the GEMM kernel would keep the old version's embedding."""
    owners: set[int] = set()
    refreshed = 0
    for module in model.modules():
        weight, method = getattr(module, "weight", None), getattr(module, "quant_method", None)
        if not isinstance(weight, torch.nn.Parameter) or method is None:
            continue
        if id(weight) in owners:
            method.process_weights_after_loading(module)
            refreshed += 1
        owners.add(id(weight))
    return refreshed
