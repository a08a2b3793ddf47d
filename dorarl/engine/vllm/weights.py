"""Weights into a running vLLM engine: a worker extension (vLLM mixes it into its worker
class, `worker_extension_cls`) that checks the tensors it received, then reloads them.

The tensors go to a worker in this process by reference; to workers in other processes
(tensor parallelism), which would receive pickled tensors as lists, as a safetensors file
in shared memory (`shared_file`) that each worker reads. What is checked is what the
worker received, just before `reload_weights`: on the CPU
vLLM fuses q/k/v and gate/up and hands its linear weights to oneDNN or its packed GEMM
kernels, keeping an empty tensor in the parameter's place, so the loaded parameters cannot
be read back as Hugging Face tensors to compare. The check is the caller's (the runtime's
fingerprint against the sender's manifest: this layer knows neither), and a refusal leaves
the old weights loaded. vllm is imported by vLLM's worker before this class is used.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator

import torch
from safetensors.torch import load_file, save_file

from dorarl.engine.weights import to_checkpoint

WeightsCheck = Callable[[dict[str, torch.Tensor]], None]
"""Raises (e.g. WeightsRefused) unless the named tensors are the version the sender sent."""


class WorkerWeights:
    """Methods vLLM adds to its worker; `self` is the worker (`reload_weights` is its)."""

    def dorarl_load(
        self, weights: dict[str, torch.Tensor] | str, check: WeightsCheck | None
    ) -> int:
        """Check `weights` (named tensors, or a safetensors file of them) here, in the
        worker, then reload them in place; returns how many tensors were checked. They come
        in the trainer's names, where transformers 5 stacks an MoE layer's experts under
        `mlp.`; vLLM reloads a checkpoint's layout (its Mixtral knows no `mlp.`), so they
        are laid out as one module per expert under the family's block here."""
        named = weights if isinstance(weights, dict) else load_file(weights)
        if check is not None:
            check(named)
        model_type = self.vllm_config.model_config.hf_config.model_type  # type: ignore[attr-defined]
        self.reload_weights(  # type: ignore[attr-defined]
            weights_iterator=iter(to_checkpoint(model_type, named).items()),
            is_checkpoint_format=True,
        )
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        refresh_tied(model)
        refresh_cpu_experts(model)
        return len(named)


def refresh_cpu_experts(model: torch.nn.Module) -> int:
    """Prepack again the experts of every MoE layer on vLLM-CPU's kernel; returns how
    many. A reload copies the new experts over the packed ones in their plain layout, and
    vLLM repacks an MoE layer only on its first load (`_setup_kernel` in
    unquantized_fused_moe_method.py), so the kernel would read the new weights as packed."""
    layers = [m for m in model.modules() if hasattr(m, "w13_weight")]
    if not layers:  # a dense model: no MoE kernel to import
        return 0
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    refreshed = 0
    for module in layers:
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)
            refreshed += 1
    return refreshed


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


@contextlib.contextmanager
def shared_file(named: dict[str, torch.Tensor]) -> Iterator[str]:
    """`named` as a safetensors file in shared memory (/dev/shm where there is one), for
    workers in other processes; removed on exit."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    handle, path = tempfile.mkstemp(prefix="dorarl-weights-", suffix=".safetensors", dir=folder)
    os.close(handle)
    try:
        save_file({name: t.detach().cpu().contiguous() for name, t in named.items()}, path)
        yield path
    finally:
        os.unlink(path)
