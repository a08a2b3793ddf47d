"""Model weights: checked against the spec, packed for the forward pass, unpacked by HF name.

The forward pass uses fused q|k|v and gate|up matrices (fewer, larger matmuls), each a
`Linear` on the engine's matmul kernel (dorarl/engine/linear.py), and an MoE layer's experts
as one `Experts` over transformers' stacked tensors; the outside world only sees Hugging Face
state-dict names (transformers 5's in-memory ones: a checkpoint's per-expert tensors are
stacked on reading, `from_checkpoint`). `pack` builds the engine's own tensors once; a new
version is copied into them tensor by tensor (`load_in_place`), after `check_named` accepted
all of it, so a refused update leaves the engine's weights untouched. Files are read with
safetensors only (never pickle).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from dorarl.engine.linear import Experts, Linear
from dorarl.engine.model_spec import FAMILIES, ModelSpec
from dorarl.errors import UserInputError

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class ExpertBlock:
    """An MoE layer's MLP: the router, the experts, and a gated shared expert if any."""

    router: Linear  # [experts, hidden]
    experts: Experts
    shared_gate_up: Linear | None = None
    shared_down: Linear | None = None
    shared_gate: Linear | None = None  # [1, hidden]: sigmoid(.) scales the shared expert


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear | None  # the dense MLP (None in a layer with experts)
    down: Linear | None
    q_norm: torch.Tensor | None = None  # per-head RMSNorm weights (qk_norm families)
    k_norm: torch.Tensor | None = None
    moe: ExpertBlock | None = None  # the expert block of a sparse layer


@dataclass
class ModelWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: Linear  # its weight is the embedding itself when tied

    @property
    def kernel(self) -> str:
        """The matmul kernel every product runs on: onednn | torch."""
        return self.lm_head.kernel


def check_named(spec: ModelSpec, named: dict[str, torch.Tensor], where: str) -> None:
    """Raise UserInputError unless `named` holds exactly the spec's tensors, shapes included."""
    expected = spec.weight_shapes()
    given = {k: v for k, v in named.items() if not k.endswith(_IGNORED_SUFFIXES)}
    if spec.tie_word_embeddings and "lm_head.weight" in given:
        # Tied checkpoints may carry the alias; it must still match the embedding.
        expected = {**expected, "lm_head.weight": (spec.vocab_size, spec.hidden_size)}
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(set(given) - set(expected))
    if missing:
        raise UserInputError(f"{where}: missing {len(missing)} tensor(s), e.g. {missing[:3]}")
    if unexpected:
        raise UserInputError(
            f"{where}: unexpected {len(unexpected)} tensor(s), e.g. {unexpected[:3]}"
        )
    for name, shape in expected.items():
        got = tuple(given[name].shape)
        if got != shape:
            raise UserInputError(
                f"{where}: tensor {name!r} has shape {got}, the model expects {shape}"
            )
        if not given[name].is_floating_point():
            raise UserInputError(
                f"{where}: tensor {name!r} has dtype {given[name].dtype}, not a float"
            )


def pack(
    spec: ModelSpec,
    named: dict[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    kernel: str = "torch",
) -> ModelWeights:
    """Fresh device tensors in the forward pass's layout, on matmul `kernel` (onednn | torch;
    call `check_named` first). Never views of `named`: `load_in_place` writes into them."""

    def get(name: str) -> torch.Tensor:  # a copy always: later loads write into it
        src = named[name].detach()
        return torch.empty(src.shape, device=device, dtype=dtype).copy_(src)

    def cat(*names: str) -> torch.Tensor:
        return torch.cat([named[n].detach().to(device=device, dtype=dtype) for n in names])

    def linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        return Linear(weight, bias, kernel)

    def experts(gate_up: torch.Tensor, down: torch.Tensor) -> Experts:
        return Experts(gate_up, down, kernel)

    layers = [_pack_layer(spec, i, get, cat, linear, experts) for i in range(spec.num_layers)]
    embed = get("model.embed_tokens.weight")
    lm_head = linear(embed if spec.tie_word_embeddings else get("lm_head.weight"), None)
    return ModelWeights(embed, layers, get("model.norm.weight"), lm_head)


def _pack_layer(spec: ModelSpec, index: int, get, cat, linear, experts) -> LayerWeights:
    p = f"model.layers.{index}."
    a, m = f"{p}self_attn.", f"{p}mlp."
    qkv_b = cat(*(f"{a}{x}_proj.bias" for x in "qkv")) if spec.qkv_bias else None
    sparse = spec.sparse(index)
    dense = (None, None) if sparse else _pack_mlp(m, spec.mlp_bias, get, cat, linear)
    return LayerWeights(
        input_norm=get(f"{p}input_layernorm.weight"),
        qkv=linear(cat(*(f"{a}{x}_proj.weight" for x in "qkv")), qkv_b),
        o=linear(get(f"{a}o_proj.weight"), get(f"{a}o_proj.bias") if spec.o_bias else None),
        post_norm=get(f"{p}post_attention_layernorm.weight"),
        gate_up=dense[0],
        down=dense[1],
        q_norm=get(f"{a}q_norm.weight") if spec.qk_norm else None,
        k_norm=get(f"{a}k_norm.weight") if spec.qk_norm else None,
        moe=_pack_experts(spec, m, get, cat, linear, experts) if sparse else None,
    )


def _pack_mlp(m: str, bias: bool, get, cat, linear) -> tuple[Linear, Linear]:
    gate_up_b = cat(f"{m}gate_proj.bias", f"{m}up_proj.bias") if bias else None
    gate_up = linear(cat(f"{m}gate_proj.weight", f"{m}up_proj.weight"), gate_up_b)
    return gate_up, linear(get(f"{m}down_proj.weight"), get(f"{m}down_proj.bias") if bias else None)


def _pack_experts(spec: ModelSpec, m: str, get, cat, linear, experts) -> ExpertBlock:
    block = ExpertBlock(
        router=linear(get(f"{m}gate.weight"), None),
        experts=experts(get(f"{m}experts.gate_up_proj"), get(f"{m}experts.down_proj")),
    )
    if spec.moe is not None and spec.moe.shared_expert_size:
        block.shared_gate_up, block.shared_down = _pack_mlp(
            f"{m}shared_expert.", False, get, cat, linear
        )
        block.shared_gate = linear(get(f"{m}shared_expert_gate.weight"), None)
    return block


def load_in_place(spec: ModelSpec, live: ModelWeights, named: dict[str, torch.Tensor]) -> None:
    """Copy `named` (checked by `check_named`: nothing here can refuse it) into the live
    weights, tensor by tensor, through the views `unpack` gives (fused matrices take their
    parts in their slices): no second weight set is ever built, the storage stays where
    it is (captured CUDA graphs keep reading it), and oneDNN's reordered copies are made
    again one product at a time."""
    with torch.inference_mode():
        for name, target in unpack(spec, live).items():
            target.copy_(named[name].detach())
        for linear in _linears(live):
            linear.repack()


def _linears(weights: ModelWeights) -> list[Linear | Experts]:
    products: list[Linear | Experts] = [weights.lm_head]
    for layer in weights.layers:
        products += [layer.qkv, layer.o]
        products += [p for p in (layer.gate_up, layer.down) if p is not None]
        if layer.moe is not None:
            b = layer.moe
            products += [b.router, b.experts]
            shared = (b.shared_gate_up, b.shared_down, b.shared_gate)
            products += [p for p in shared if p is not None]
    return products


def unpack(spec: ModelSpec, weights: ModelWeights) -> dict[str, torch.Tensor]:
    """The weights by Hugging Face name: views of the packed tensors, so writing into them
    writes the live weights (only `load_in_place` does, after `check_named`)."""
    named = {"model.embed_tokens.weight": weights.embed}
    for i, layer in enumerate(weights.layers):
        named.update(_unpack_layer(spec, f"model.layers.{i}.", layer))
    named["model.norm.weight"] = weights.norm
    if not spec.tie_word_embeddings:
        named["lm_head.weight"] = weights.lm_head.weight
    return named


def _unpack_layer(spec: ModelSpec, p: str, w: LayerWeights) -> dict[str, torch.Tensor]:
    a, m = f"{p}self_attn.", f"{p}mlp."
    qkv = [spec.q_size, spec.kv_size, spec.kv_size]
    named = {
        f"{p}input_layernorm.weight": w.input_norm,
        f"{p}post_attention_layernorm.weight": w.post_norm,
        f"{a}o_proj.weight": w.o.weight,
    }
    named |= _split([f"{a}{x}_proj.weight" for x in "qkv"], w.qkv.weight, qkv)
    if w.qkv.bias is not None:
        named |= _split([f"{a}{x}_proj.bias" for x in "qkv"], w.qkv.bias, qkv)
    if w.o.bias is not None:
        named[f"{a}o_proj.bias"] = w.o.bias
    if w.gate_up is not None and w.down is not None:
        named |= _unpack_mlp(m, w.gate_up, w.down)
    if w.moe is not None:
        named |= _unpack_experts(m, w.moe)
    if w.q_norm is not None and w.k_norm is not None:
        named[f"{a}q_norm.weight"], named[f"{a}k_norm.weight"] = w.q_norm, w.k_norm
    return named


def _unpack_mlp(m: str, gate_up: Linear, down: Linear) -> dict[str, torch.Tensor]:
    width = [down.weight.shape[1]] * 2
    named = {f"{m}down_proj.weight": down.weight}
    named |= _split([f"{m}gate_proj.weight", f"{m}up_proj.weight"], gate_up.weight, width)
    if gate_up.bias is not None and down.bias is not None:
        named |= _split([f"{m}gate_proj.bias", f"{m}up_proj.bias"], gate_up.bias, width)
        named[f"{m}down_proj.bias"] = down.bias
    return named


def _unpack_experts(m: str, block: ExpertBlock) -> dict[str, torch.Tensor]:
    named = {
        f"{m}gate.weight": block.router.weight,
        f"{m}experts.gate_up_proj": block.experts.gate_up,
        f"{m}experts.down_proj": block.experts.down,
    }
    if block.shared_gate_up and block.shared_down and block.shared_gate is not None:
        named |= _unpack_mlp(f"{m}shared_expert.", block.shared_gate_up, block.shared_down)
        named[f"{m}shared_expert_gate.weight"] = block.shared_gate.weight
    return named


def _split(names: list[str], fused: torch.Tensor, sizes: list[int]) -> dict[str, torch.Tensor]:
    return dict(zip(names, fused.split(sizes), strict=True))


def random_named(spec: ModelSpec, seed: int, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Random init like Hugging Face's: normal(0, std) matrices, unit norms, zero biases."""
    gen = torch.Generator().manual_seed(seed)
    named = {}
    for name, shape in spec.weight_shapes().items():
        if name.endswith("norm.weight"):
            named[name] = torch.ones(shape)
        elif name.endswith(".bias"):
            named[name] = torch.zeros(shape)
        else:
            named[name] = torch.randn(shape, generator=gen) * std
    return named


def from_checkpoint(spec: ModelSpec, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`named` as read from a model folder, in the in-memory names: checkpoints keep one
    module per expert (`mlp.experts.{j}.gate_proj.weight`; Mixtral's
    `block_sparse_moe.experts.{j}.w1.weight`), stacked here as transformers 5 stacks them on
    loading. A folder already in the stacked names (or a dense model) passes unchanged."""
    family = FAMILIES[spec.model_type].experts
    if spec.moe is None or family is None:
        return named
    out = dict(named)
    for layer in spec.moe.sparse_layers:
        p = f"model.layers.{layer}."
        _stack_experts(out, f"{p}{family.block}.", f"{p}mlp.", family.names, spec.moe.num_experts)
    return out


def _stack_experts(
    named: dict[str, torch.Tensor], src: str, dst: str, names: tuple[str, str, str], count: int
) -> None:
    """In place: `{src}experts.{j}.{gate|up|down}.weight` stacked into `{dst}experts.*`, and
    the block's other tensors (the router, a shared expert) renamed from `src` to `dst`."""
    gate, up, down = (f"{src}experts.{{}}.{n}.weight" for n in names)
    if gate.format(0) in named:
        try:
            gates = [named.pop(gate.format(j)) for j in range(count)]
            ups = [named.pop(up.format(j)) for j in range(count)]
            downs = [named.pop(down.format(j)) for j in range(count)]
        except KeyError as missing:
            raise UserInputError(f"checkpoint: expert tensor {missing} is missing") from None
        named[f"{dst}experts.gate_up_proj"] = torch.cat(
            [torch.stack(gates), torch.stack(ups)], dim=1
        )
        named[f"{dst}experts.down_proj"] = torch.stack(downs)
    if src != dst:
        for name in [n for n in named if n.startswith(src)]:
            named[dst + name[len(src) :]] = named.pop(name)


def to_checkpoint(model_type: str, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`named` in the in-memory names (the trainer's) as a checkpoint lays them out, one
    module per expert under the family's block: `from_checkpoint` undone, with views of the
    stacked tensors. A dense model, or a family this engine does not know, passes unchanged."""
    family = FAMILIES.get(model_type)
    experts = family.experts if family else None
    stacked = "mlp.experts.gate_up_proj"
    layers = [n[: -len(stacked)] for n in named if n.endswith(stacked)]
    if experts is None or not layers:
        return named
    out = dict(named)
    for p in layers:
        gate_up, down = out.pop(f"{p}{stacked}"), out.pop(f"{p}mlp.experts.down_proj")
        for name in [n for n in out if n.startswith(f"{p}mlp.")]:  # the router, a shared expert
            out[f"{p}{experts.block}.{name[len(p) + 4 :]}"] = out.pop(name)
        width = gate_up.shape[1] // 2
        for j, (g, u, d) in enumerate(
            zip(gate_up[:, :width], gate_up[:, width:], down, strict=True)
        ):
            for key, tensor in zip(experts.names, (g, u, d), strict=True):
                out[f"{p}{experts.block}.experts.{j}.{key}.weight"] = tensor
    return out


def weight_files(folder: str | Path) -> list[Path]:
    """The model's safetensors files, by the Hugging Face layout: the shards an index names,
    else model.safetensors, else model-*.safetensors. Other safetensors files in the folder
    (a trainer checkpoint's optimizer and RNG state) are not weights."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        missing = [name for name in shards if not (folder / name).is_file()]
        if missing or not shards:
            raise UserInputError(f"{index}: weight_map names missing shards {missing}")
        return [folder / name for name in shards]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    return sorted(folder.glob("model-*.safetensors"))


def load_folder(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a model folder's weight files (sharded or not)."""
    files = weight_files(folder)
    if not files:
        raise UserInputError(f"{folder}: no model.safetensors (or indexed shards) in the folder")
    named: dict[str, torch.Tensor] = {}
    for path in files:
        named.update(load_file(str(path), device="cpu"))
    return named
