"""The engine's matrix products: oneDNN's prepacked kernel on CPU in float32, F.linear elsewhere.

On x86 CPUs oneDNN's JIT kernels on a weight reordered once into their blocked layout beat the
BLAS sgemm behind `F.linear` (on AMD Zen 4 at 32 rows by 10-35%, the 49k-wide output layer by
1.8x), and their results are row-independent: a row's output is bit-identical whatever rows
share the product, for every row count of 2 or more (one row can take a GEMV path that sums
in another order, so it runs padded to two). That makes a request's logits independent of
its batch companions. Weights are packed whenever they are (at start and on every
`load_weights`; SmolLM2-135M: 0.21 s against 0.16 s for the plain layout alone), and the
packed copy sits beside the plain tensors, which `state_dict` serves (one more copy of the
matrices in memory). CUDA, other dtypes and CPU builds without oneDNN use F.linear.

`Experts` runs an MoE layer's experts on the tokens routed to them: the (token, expert) pairs
sorted by expert, each expert's rows one product (on oneDNN, one packed matrix per expert,
so a token's result does not depend on which tokens share its expert; elsewhere one
`F.grouped_mm` over all experts, with no host sync), then weighted and summed per token.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dorarl.config import ConfigError

# The row count oneDNN picks its blocked weight layout for. Any hint of 32 or more gives the
# same layout and results here, so engines of any batch size compute bit-identically.
_PACK_HINT_ROWS = 64


class Linear:
    """y = x W^T + b (+ residual) for 2-D x, on the kernel chosen when it was built."""

    __slots__ = ("bias", "packed", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str) -> None:
        self.weight = weight  # [out, in], the plain tensor (state_dict, the F.linear path)
        self.bias = bias
        self.packed = _pack(weight) if kernel == "onednn" else None

    @property
    def kernel(self) -> str:
        return "torch" if self.packed is None else "onednn"

    def repack(self) -> None:
        """Reorder `weight` again after it was written in place (a new version)."""
        if self.packed is not None:
            self.packed = _pack(self.weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        if x.shape[0] == 1:  # Linear's own product (lora.LoraLinear adds its delta after)
            return Linear.__call__(self, x.expand(2, -1))[:1]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + (x W^T + b). On oneDNN the plain product, then an in-place add: the
        fused binary post-op rounds the same but ran slower inside a decode step (SmolLM2,
        batch 32: about 3 ms a step over 60 products), and it is the plain product that the
        bench's floor times."""
        if self.packed is None:
            return residual + F.linear(x, self.weight, self.bias)
        return Linear.__call__(self, x).add_(residual)


class Experts:
    """An MoE layer's experts, stacked as transformers 5 holds them: gate|up
    `[experts, 2 x width, hidden]` and down `[experts, hidden, width]`, SiLU-gated."""

    __slots__ = ("down", "gate_up", "packed")

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, kernel: str) -> None:
        self.gate_up, self.down = gate_up, down  # the plain tensors (state_dict, grouped_mm)
        self.packed = self._pack() if kernel == "onednn" else None

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    def _pack(self) -> list[tuple[Linear, Linear]]:
        return [
            (Linear(self.gate_up[e], None, "onednn"), Linear(self.down[e], None, "onednn"))
            for e in range(self.num_experts)
        ]

    def repack(self) -> None:
        """Reorder every expert again after the stacks were written in place."""
        if self.packed is not None:
            self.packed = self._pack()

    def __call__(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """For each token t of `x` [tokens, hidden]: sum over its k slots of
        weights[t, j] * expert_{experts[t, j]}(x[t]), with experts, weights [tokens, k]."""
        tokens, k = experts.shape
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)  # pairs grouped by expert, in token order within
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        rows = x.index_select(0, order // k)
        out = self._grouped(rows, counts) if self.packed is None else self._each(rows, counts)
        weighted = out * weights.reshape(-1).index_select(0, order)[:, None]
        pairs = torch.empty_like(weighted).index_copy_(0, order, weighted)
        return pairs.view(tokens, k, -1).sum(dim=1).to(x.dtype)

    def _each(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """One packed product per expert with tokens (a loop over experts, not tokens)."""
        assert self.packed is not None
        out = rows.new_empty(rows.shape[0], self.down.shape[1])
        start = 0
        for (gate_up, down), n in zip(self.packed, counts.tolist(), strict=True):
            if n:
                gate, up = gate_up(rows[start : start + n]).chunk(2, dim=-1)
                out[start : start + n] = down(F.silu(gate) * up)
                start += n
        return out

    def _grouped(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offsets = counts.cumsum(0).to(torch.int32)
        gate_up = F.grouped_mm(rows, self.gate_up.transpose(-2, -1), offs=offsets)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.grouped_mm(F.silu(gate) * up, self.down.transpose(-2, -1), offs=offsets)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_HINT_ROWS)


def choose_kernel(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """`onednn` or `torch` for `engine.linear_kernel` (auto: oneDNN where it runs and is exact)."""
    usable = device.type == "cpu" and dtype == torch.float32 and onednn_works()
    if requested == "onednn" and not usable:
        why = "no oneDNN in this torch build" if not onednn_works() else "CPU float32 only"
        raise ConfigError(f"engine.linear_kernel: onednn is not usable here ({why})")
    if requested == "auto":
        return "onednn" if usable else "torch"
    return requested


@functools.cache
def onednn_works() -> bool:
    """Whether this torch build runs oneDNN's packed linear, checked once against F.linear."""
    if not torch.backends.mkldnn.is_available():
        return False
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(24, 16, generator=gen), torch.randn(24, generator=gen)
    x = torch.randn(3, 16, generator=gen)
    try:
        got = Linear(w, b, "onednn")(x)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return torch.allclose(got, F.linear(x, w, b), atol=1e-5, rtol=1e-5)
