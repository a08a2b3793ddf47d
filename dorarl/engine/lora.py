"""Resident LoRA adapters over the one base: stacked per adapted layer, and each row of a step
adds the delta of its own adapter (slot 0: none, the base) in one pair of products for all rows."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from dorarl.engine.linear import Linear
from dorarl.engine.model_spec import ModelSpec
from dorarl.engine.weights import ModelWeights
from dorarl.errors import UserInputError

BASE_SLOT = 0  # a row of the full-weight version: no adapter
# peft's names, from `get_peft_model_state_dict` (no adapter name) or a PeftModel's
# state dict (`lora_A.default.weight`), with or without the `base_model.model.` prefix.
_NAME = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)_proj"
    r"\.lora_([AB])(?:\.[^.]+)?\.weight$"
)
# HF projection -> (the engine layer it is part of, its part of that layer's output)
_TARGETS = {
    ("self_attn", "q"): ("qkv", 0),
    ("self_attn", "k"): ("qkv", 1),
    ("self_attn", "v"): ("qkv", 2),
    ("self_attn", "o"): ("o", 0),
    ("mlp", "gate"): ("gate_up", 0),
    ("mlp", "up"): ("gate_up", 1),
    ("mlp", "down"): ("down", 0),
}


@dataclass
class RowScales:
    """The step's per-row adapter weights, shared by every adapted layer: `[rows, slots]`,
    row r holding its adapter's alpha / rank in its slot's column and zeros elsewhere; None
    when every row of the step is the base's (the adapted layers then run the base alone)."""

    scales: torch.Tensor | None = None


class LoraLinear(Linear):
    """A base `Linear` (its very tensors and packed copy) plus the resident adapters' deltas.

    A fused layer (q|k|v, gate|up) holds `parts` adapters per slot: part p's A takes ranks
    [p R, (p + 1) R) of the slot, its B the rows of p's output slice and those ranks only, so
    an adapter on q_proj changes q's columns of the fused output and nothing else. All slots
    are flattened into A `[slots x parts x R, in]` and B `[out, slots x parts x R]`; a row
    multiplies the shrunk activations of the slots it does not use by zero. That is one product
    pair for the whole step, where gathering A and B per row would copy `[rows, R, in]` per
    layer. Both products are `Linear`s on the base's kernel (re-packed after each adapter
    load), so on oneDNN a row's result, delta included, is bit-identical whatever rows and
    adapters share its step; a base row adds exact zeros.
    """

    __slots__ = ("expand", "offsets", "rank", "rows", "shrink", "sizes", "slots")

    def __init__(
        self, base: Linear, sizes: list[int], slots: int, rank: int, rows: RowScales
    ) -> None:
        # not Linear.__init__: the base's weights are shared, not packed again
        self.weight, self.bias, self.packed = base.weight, base.bias, base.packed
        self.sizes, self.slots, self.rank, self.rows = sizes, slots, rank, rows
        self.offsets = [sum(sizes[:p]) for p in range(len(sizes))]
        out, width = self.weight.shape
        a = self.weight.new_zeros(slots * self.slot_width, width)
        self.shrink = Linear(a, None, base.kernel)  # x -> x A^T, every slot's ranks
        self.expand = Linear(self.weight.new_zeros(out, a.shape[0]), None, base.kernel)

    @property
    def slot_width(self) -> int:
        return len(self.sizes) * self.rank

    def slot_a(self, slot: int) -> torch.Tensor:
        """Slot `slot`'s A `[parts x R, in]` (slots count from 1: 0 is the base)."""
        w = self.slot_width
        return self.shrink.weight[(slot - 1) * w : slot * w]

    def slot_b(self, slot: int) -> torch.Tensor:
        """Slot `slot`'s B `[out, parts x R]`."""
        w = self.slot_width
        return self.expand.weight[:, (slot - 1) * w : slot * w]

    def write(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Part `part`'s A `[r, in]` and B `[size, r]` (r <= R) into `slot`; the padding
        ranks stay zero."""
        r, start = a.shape[0], part * self.rank
        rows = slice(self.offsets[part], self.offsets[part] + self.sizes[part])
        self.slot_a(slot)[start : start + r].copy_(a)
        self.slot_b(slot)[rows, start : start + r].copy_(b)

    def read(self, slot: int, part: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Part `part`'s A `[r, in]` and B `[size, r]` as `write` wrote them (views)."""
        start = part * self.rank
        rows = slice(self.offsets[part], self.offsets[part] + self.sizes[part])
        return self.slot_a(slot)[start : start + r], self.slot_b(slot)[rows, start : start + r]

    def clear(self, slot: int) -> None:
        self.slot_a(slot).zero_()
        self.slot_b(slot).zero_()

    def repack_adapters(self) -> None:
        """Reorder A and B again after slots were written (oneDNN's copies)."""
        self.shrink.repack()
        self.expand.repack()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._add_delta(super().__call__(x), x)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self._add_delta(super().add_to(residual, x), x)

    def _add_delta(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y + scale_row * (x A_row^T) B_row^T for every row, in place (y is fresh)."""
        scales = self.rows.scales
        if scales is None:
            return y
        rows = x.shape[0]
        shrunk = self.shrink(x).view(rows, self.slots, self.slot_width) * scales[:, :, None]
        return y.add_(self.expand(shrunk.view(rows, -1)))


@dataclass
class Adapter:
    """One adapter's checked tensors: (layer, engine layer kind) -> part -> (A, B), and the
    names they came by: (layer, kind, part) -> (A's name, B's name)."""

    rank: int
    alpha: float
    parts: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = field(
        default_factory=dict
    )
    names: dict[tuple[int, str, int], tuple[str, str]] = field(default_factory=dict)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def parse_adapter(
    tensors: dict[str, torch.Tensor],
    alpha: float,
    rank: int,
    layers: dict[tuple[int, str], LoraLinear],
    where: str,
) -> Adapter:
    """peft's A / B tensors by name, each checked against the layer it adapts; raises
    UserInputError naming the first problem (nothing is written before all pass)."""
    if not tensors:
        raise UserInputError(f"{where}: no adapter tensors")
    if not math.isfinite(alpha) or alpha <= 0:
        raise UserInputError(f"{where}: alpha must be a finite number > 0, got {alpha}")
    pairs: dict[tuple[int, str, int], dict[str, tuple[str, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        key, which = _target(name, layers, where)
        pairs.setdefault(key, {})[which] = (name, tensor)
    adapter = Adapter(rank, alpha)
    for (index, kind, part), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            ((name, _),) = ab.values()
            raise UserInputError(f"{where}: {name!r} has no lora_A / lora_B partner")
        layer = layers[(index, kind)]
        want = {"A": (rank, layer.weight.shape[1]), "B": (layer.sizes[part], rank)}
        for which, (name, tensor) in ab.items():
            _check(name, tensor, want[which], rank, where)
        adapter.parts.setdefault((index, kind), {})[part] = (
            ab["A"][1].detach(),
            ab["B"][1].detach(),
        )
        adapter.names[(index, kind, part)] = (ab["A"][0], ab["B"][0])
    return adapter


def merge_adapter(
    named: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], alpha: float, rank: int
) -> dict[str, torch.Tensor]:
    """`named` (full weights by HF name) with the adapter `tensors` (peft's names) merged
    into their projections, W + B @ A * alpha / rank computed in float32 (what peft's
    `merge_and_unload` gives); every other tensor is `named`'s own."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _NAME.match(name)
        if match is None:
            raise UserInputError(f"merge_adapter: {name!r} is not a LoRA A or B of a projection")
        target = f"model.layers.{match[1]}.{match[2]}.{match[3]}_proj.weight"
        pairs.setdefault(target, {})[match[4]] = tensor
    merged = dict(named)
    for target, ab in pairs.items():
        w = named[target]
        a, b = ab["A"].to(w.device, torch.float32), ab["B"].to(w.device, torch.float32)
        merged[target] = torch.addmm(w.float(), b, a, alpha=alpha / rank).to(w.dtype)
    return merged


def _target(
    name: str, layers: dict[tuple[int, str], LoraLinear], where: str
) -> tuple[tuple[int, str, int], str]:
    match = _NAME.match(name)
    target = _TARGETS.get((match[2], match[3])) if match else None
    if match is None or target is None or (int(match[1]), target[0]) not in layers:
        raise UserInputError(
            f"{where}: tensor {name!r} is not a LoRA A or B of a dense decoder projection "
            "(q|k|v|o|gate|up|down_proj) of this model"
        )
    return (int(match[1]), target[0], target[1]), match[4]


def _check(name: str, tensor: torch.Tensor, shape: tuple[int, int], rank: int, where: str) -> None:
    if tuple(tensor.shape) != shape or not tensor.is_floating_point():
        raise UserInputError(
            f"{where}: tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)}, the model "
            f"expects a float {shape} at rank {rank}"
        )


class ResidentAdapters:
    """The adapters an engine holds, one per slot 1..slots, by version, over its weights."""

    def __init__(self, spec: ModelSpec, weights: ModelWeights, slots: int, max_rank: int) -> None:
        self.rows = RowScales()
        self.versions: list[int | None] = [None] * (slots + 1)  # index 0: the base, never held
        # each held slot's rank, alpha and tensor names (not its tensors: they are the slots')
        self.held: dict[int, Adapter] = {}
        first = weights.layers[0].qkv.weight
        # row s: slot s's scale in its column (row 0, the base: zeros); rows gather from it
        self.table = first.new_zeros(slots + 1, slots)
        self.layers = _attach(spec, weights, slots, max_rank, self.rows)

    def resident(self) -> list[int]:
        return sorted(v for v in self.versions if v is not None)

    def slot_of(self, version: int) -> int | None:
        return self.versions.index(version) if version in self.versions else None

    def free_slot(self) -> int | None:
        free = [s for s in range(1, len(self.versions)) if self.versions[s] is None]
        return free[0] if free else None

    def load(self, version: int, adapter: Adapter, slot: int) -> None:
        """Write a parsed adapter into a free slot (every other slot untouched)."""
        with torch.inference_mode():
            for key, layer in self.layers.items():
                layer.clear(slot)
                for part, (a, b) in adapter.parts.get(key, {}).items():
                    layer.write(slot, part, a, b)
                layer.repack_adapters()
            self.table[slot].zero_()
            self.table[slot, slot - 1] = adapter.scale
        self.versions[slot] = version
        self.held[slot] = Adapter(adapter.rank, adapter.alpha, names=dict(adapter.names))

    def tensors(self, slot: int) -> dict[str, torch.Tensor]:
        """A held slot's A and B by the names they were loaded by, read back from the slot
        (views): what the engine computes with."""
        held = self.held[slot]
        out: dict[str, torch.Tensor] = {}
        for (index, kind, part), (a_name, b_name) in held.names.items():
            out[a_name], out[b_name] = self.layers[(index, kind)].read(slot, part, held.rank)
        return out

    def unload(self, slot: int) -> None:
        with torch.inference_mode():
            for layer in self.layers.values():
                layer.clear(slot)
                layer.repack_adapters()
            self.table[slot].zero_()
        self.versions[slot] = None
        self.held.pop(slot, None)

    def begin_step(self, slots: list[int], rows_per_item: list[int]) -> None:
        """The step's rows (item i runs `rows_per_item[i]` rows under adapter slot
        `slots[i]`): their scales, or None where all of them are the base's."""
        if not any(slots):
            self.rows.scales = None
            return
        device = self.table.device
        per_item = torch.tensor(slots, dtype=torch.long, device=device)
        counts = torch.tensor(rows_per_item, dtype=torch.long, device=device)
        self.rows.scales = self.table.index_select(0, per_item.repeat_interleave(counts))


def _attach(
    spec: ModelSpec, weights: ModelWeights, slots: int, rank: int, rows: RowScales
) -> dict[tuple[int, str], LoraLinear]:
    """Every dense layer's q|k|v, o, gate|up and down become `LoraLinear`s in place (an
    MoE layer's experts keep no adapters)."""
    adapted = {}
    for index, layer in enumerate(weights.layers):
        sizes = {"qkv": [spec.q_size, spec.kv_size, spec.kv_size], "o": [spec.hidden_size]}
        if layer.gate_up is not None and layer.down is not None:
            width = layer.down.weight.shape[1]
            sizes |= {"gate_up": [width, width], "down": [spec.hidden_size]}
        for kind, parts in sizes.items():
            wrapped = LoraLinear(getattr(layer, kind), parts, slots, rank, rows)
            setattr(layer, kind, wrapped)
            adapted[(index, kind)] = wrapped
    return adapted
