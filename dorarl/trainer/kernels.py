"""The trainer's fused C++ CPU kernels (csrc/fused.cpp) as autograd functions, and their
installation on a model's RMSNorm and SwiGLU modules (`trainer.kernels=auto`).

About half of a packed float32 forward+backward on the CPU is elementwise work that torch
composes of several ops, each a pass over memory (RMSNorm is seven forward, SwiGLU three, the
output layer's softmax statistics about nine). A module is given the fused forward only after
it computed the same values and gradients as its own on a random input, so a family with a
variant (Gemma's 1 + weight, another activation) keeps its own code; tensors the kernels do not
take (not float32, not on the CPU, sharded) go through the module's own forward too.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "fused.cpp"


@functools.cache
def load_ops() -> Any | None:
    """torch.ops.dorarl_trainer, built or loaded from the cache; None where it cannot be."""
    from dorarl.engine.cpu_kernels import load_library

    if not load_library(
        SOURCE, "dorarl_trainer_kernels", "the trainer's fused CPU kernels", "torch ops run"
    ):
        return None
    return torch.ops.dorarl_trainer


def takes(*tensors: torch.Tensor) -> bool:
    """Whether the kernels compute on these tensors: plain float32 CPU tensors."""
    return all(
        t.device.type == "cpu" and t.dtype == torch.float32 and not isinstance(t, DTensor)
        for t in tensors
    )


class FusedRMSNorm(torch.autograd.Function):
    """(x [..., hidden], weight [hidden], eps) -> weight * x / sqrt(mean(x^2) + eps)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        y, rstd = load_ops().rms_norm_fwd(rows, weight.contiguous(), eps)
        ctx.save_for_backward(rows, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, weight, rstd = ctx.saved_tensors
        dy = grad.reshape(rows.shape).contiguous()
        dx, dw = load_ops().rms_norm_bwd(dy, rows, weight.contiguous(), rstd)
        return dx.view(grad.shape), dw, None


class FusedSiluMul(torch.autograd.Function):
    """(gate, up) -> silu(gate) * up, SwiGLU's activation."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        return load_ops().silu_mul_fwd(gate, up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        return load_ops().silu_mul_bwd(grad.contiguous(), gate, up)


def _norm_eps(module: torch.nn.Module) -> float | None:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return None
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(eps) if isinstance(eps, int | float) else None


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if takes(hidden_states, self.weight):
        return FusedRMSNorm.apply(hidden_states, self.weight, _norm_eps(self))
    return self.own_forward(hidden_states)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    if takes(gate, up):
        return self.down_proj(FusedSiluMul.apply(gate, up))
    return self.down_proj(self.act_fn(gate) * up)


def _is_swiglu(module: torch.nn.Module) -> bool:
    parts = ("gate_proj", "up_proj", "down_proj")
    act = getattr(module, "act_fn", None)
    silu = isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"
    return silu and all(isinstance(getattr(module, p, None), torch.nn.Module) for p in parts)


def _fused_forward(module: torch.nn.Module) -> Callable | None:
    """The fused forward this module could take, or None."""
    if "RMSNorm" in type(module).__name__ and _norm_eps(module) is not None:
        return _norm_forward
    if _is_swiglu(module):
        return _mlp_forward
    return None


@functools.cache
def _fused_class(base: type, forward: Callable) -> type:
    """`base` with the fused forward; a class, not an instance attribute, because
    transformers' hub kernels reset instance forwards whenever the model changes mode."""
    return type(f"Fused{base.__name__}", (base,), {"forward": forward, "own_forward": base.forward})


def _same_function(module: torch.nn.Module, fused: type) -> bool:
    """Whether the fused class gives the module's own values and input gradients on a random
    input (each within 1e-4 of the largest magnitude: sums in another order differ by that)."""
    if not takes(next(module.parameters())):
        return False
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, _input_width(module), generator=gen)
    results = []
    with torch.enable_grad():
        for forward in (type(module).forward, fused.forward):
            leaf = x.clone().requires_grad_(True)
            out = forward(module, leaf)
            (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
            results.append((out.detach(), leaf.grad))
    module.zero_grad(set_to_none=True)
    return all(
        (a - b).abs().max() <= 1e-4 * a.abs().max() + 1e-6
        for a, b in zip(results[0], results[1], strict=True)
    )


def _input_width(module: torch.nn.Module) -> int:
    gate = getattr(module, "gate_proj", None)
    if gate is not None:
        return int(gate.in_features)
    return int(module.weight.shape[0])


def fuse_modules(model: torch.nn.Module) -> dict[str, int]:
    """Give the model's RMSNorm and SwiGLU modules the fused forward where they compute the
    same function (checked once per class); how many of each class took it. Nothing where
    the kernels cannot be built."""
    if load_ops() is None:
        return {}
    verdicts: dict[type, bool] = {}
    fused: dict[str, int] = {}
    for module in model.modules():
        forward = _fused_forward(module)
        if forward is None or getattr(module, "own_forward", None) is not None:
            continue
        base = type(module)
        if base not in verdicts:
            verdicts[base] = _same_function(module, _fused_class(base, forward))
            if not verdicts[base]:
                log.info("%s keeps its own forward (the fused one differs)", base.__name__)
        if verdicts[base]:
            module.__class__ = _fused_class(base, forward)
            fused[base.__name__] = fused.get(base.__name__, 0) + 1
    return fused


@contextlib.contextmanager
def own_forwards(model: torch.nn.Module) -> Iterator[None]:
    """The model's modules with their own forwards inside the block (a bench's plain HF
    contender on the trainer's model), the fused ones again after it."""
    swapped = [(m, type(m)) for m in model.modules() if getattr(m, "own_forward", None)]
    for module, fused in swapped:
        module.__class__ = fused.__bases__[0]
    try:
        yield
    finally:
        for module, fused in swapped:
            module.__class__ = fused
