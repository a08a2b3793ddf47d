"""Expert routing in the trainer: expert load, agreement with the engine's routes, replay (R3)
and the load-balancing loss, through forward hooks on transformers' routers.

A router (`layer.mlp.gate` of an MoE family: `forward(hidden [rows, hidden]) -> (logits,
top-k weights, expert ids)`) sees a micro-batch's positions flattened as the model flattens
them (row x width + column). `RouteRows` names the positions whose output predicts a sampled
token (the response tokens the loss sees: what the engine records a route for), the sequence
each belongs to and, when the engines recorded them, their routes. At those positions the
hooks count tokens per expert, compare the trainer's own choice with the engine's (a token
differs when any sparse layer picked another set of experts), replace the choice by the
engine's with `route_replay` (the top-k weights then come from the trainer's own softmax at
the replayed experts, renormalised as the family does, so the router keeps its gradient),
and build the load-balancing loss per sequence: experts x sum_e f_e P_e, f_e the share of the
sequence's tokens sent to e (summing to top_k) and P_e its mean router probability, weighted
by the sequence's share of the loss and averaged over layers. Everything is a sum over
sequences, so micro-batches and ranks add up to the whole batch's figures. Tokens sampled by
the very weights the trainer holds (behavior version = its version) are counted apart: there
a difference is numeric, while a stale token's routes also move with the policy (what
replay removes). Hooks act only
while a micro-batch is open, and with activation checkpointing the recomputation in backward
repeats the same differentiable operations but records nothing a second time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PreTrainedModel

from dorarl.data.routes import NO_ROUTE, route_dtype
from dorarl.errors import UserInputError
from dorarl.trainer.batch import MicroBatch, TrainSequence
from dorarl.trainer.config import MoeConfig
from dorarl.trainer.packing import PackedBatch


def routers(model: PreTrainedModel) -> list[nn.Module]:
    """The model's routers in layer order (none for a dense model)."""
    layers = getattr(model.base_model, "layers", None) or []
    found = [getattr(layer.mlp, "gate", None) for layer in layers if hasattr(layer, "mlp")]
    return [r for r in found if r is not None and hasattr(r, "top_k") and hasattr(r, "weight")]


@dataclass
class RouteRows:
    """The positions of one micro-batch that predict a sampled token (see the module doc)."""

    positions: torch.Tensor  # (n,) flat index into the micro-batch's rows x width
    sequence: torch.Tensor  # (n,) the sequence it belongs to, numbered in the micro-batch
    seq_weights: torch.Tensor  # (sequences,) each sequence's share of the step's loss
    recorded: torch.Tensor | None  # (n, sparse layers, top_k) the engine's ids, -1: none
    fresh: torch.Tensor | None = None  # (n,) sampled by the weights the trainer holds
    counted: bool = True  # False for a sharded trainer's zero-weight filler pass


def route_rows(
    batch: MicroBatch | PackedBatch, num_experts: int, layers: int, top_k: int, version: int = -1
) -> RouteRows:
    seqs = batch.sequences
    device = batch.input_ids.device
    if isinstance(batch, PackedBatch):
        lengths = torch.tensor([len(s.response_ids) for s in seqs], device=device)
        owner = torch.repeat_interleave(torch.arange(len(seqs), device=device), lengths)
        positions, sequence = batch.sources[batch.mask], owner[batch.mask]
    else:
        row, column = batch.mask.nonzero(as_tuple=True)
        positions, sequence = row * batch.input_ids.shape[1] + column, row
    weights = torch.tensor([sum(s.token_weights()) for s in seqs], device=device)
    recorded = [_recorded(s.routes, s.loss_mask, num_experts, layers, top_k) for s in seqs]
    have = any(r is not None for r in recorded)
    table = _fill(recorded, seqs, layers, top_k).to(device) if have else None
    same = torch.tensor([s.version == version for s in seqs], dtype=torch.bool, device=device)
    return RouteRows(positions, sequence, weights, table, same[sequence] if seqs else None)


def _recorded(
    routes: bytes, loss_mask: list[bool], num_experts: int, layers: int, top_k: int
) -> torch.Tensor | None:
    """A sample's routes at its loss tokens, `[tokens, layers, top_k]` int64 (None if absent
    or not of this model's shape)."""
    width = layers * top_k
    dtype = getattr(torch, route_dtype(num_experts))
    if not routes or len(routes) != len(loss_mask) * width * dtype.itemsize:
        return None
    ids = torch.frombuffer(bytearray(routes), dtype=dtype).long()
    ids[ids == (255 if dtype == torch.uint8 else -1)] = NO_ROUTE
    return ids.view(len(loss_mask), layers, top_k)[torch.tensor(loss_mask, dtype=torch.bool)]


def _fill(
    recorded: list[torch.Tensor | None], seqs: list[TrainSequence], layers: int, top_k: int
) -> torch.Tensor:
    """Every sequence's loss-token routes in order, 'no route' for a sequence without."""
    parts = [
        r if r is not None else torch.full((s.trained_tokens, layers, top_k), NO_ROUTE)
        for r, s in zip(recorded, seqs, strict=True)
    ]
    return torch.cat(parts) if parts else torch.empty(0, layers, top_k, dtype=torch.long)


@dataclass
class RouteStats:
    """One step's routing figures, summed over micro-batches (and ranks)."""

    counts: torch.Tensor  # (sparse layers, experts) tokens routed to each expert
    compared: int = 0  # tokens with an engine route to compare
    differed: int = 0  # of them, tokens whose experts differed in some layer
    compared_fresh: int = 0  # of the compared, those sampled by the trainer's own weights
    differed_fresh: int = 0
    aux: float = 0.0  # the load-balancing loss of the step (0 when off)

    def as_floats(self) -> list[float]:
        tallies = [self.compared, self.differed, self.compared_fresh, self.differed_fresh]
        return [*self.counts.flatten().tolist(), *tallies, self.aux]

    @classmethod
    def from_floats(cls, values: list[float], layers: int, experts: int) -> RouteStats:
        counts = torch.tensor(values[: layers * experts], dtype=torch.float64)
        *tallies, aux = values[layers * experts :]
        return cls(counts.view(layers, experts), *(int(t) for t in tallies), aux)

    def metrics(self, aux_on: bool) -> dict[str, float | dict[str, float]]:
        """tokens per expert (over layers), imbalance max/mean (mean and worst layer), the
        share of compared tokens whose routes differed, the aux loss."""
        counts = self.counts.double()
        mean = counts.mean(dim=1).clamp(min=1e-12)
        per_layer = counts.max(dim=1).values / mean
        out: dict[str, float | dict[str, float]] = {
            "moe_tokens_per_expert": {str(e): float(n) for e, n in enumerate(counts.sum(0))},
            "moe_imbalance": float(per_layer.mean()) if counts.sum() > 0 else 1.0,
            "moe_imbalance_max": float(per_layer.max()) if counts.sum() > 0 else 1.0,
            "moe_routes_compared": float(self.compared),
            "moe_route_mismatch": _share(self.differed, self.compared),
            "moe_routes_compared_same_version": float(self.compared_fresh),
            "moe_route_mismatch_same_version": _share(self.differed_fresh, self.compared_fresh),
        }
        if aux_on:
            out["moe_aux_loss"] = self.aux
        return out


@dataclass
class _Open:
    """The micro-batch the hooks act on."""

    rows: RouteRows
    recomputing: bool = False  # backward's recomputation (activation checkpointing)
    aux_terms: list[torch.Tensor] = field(default_factory=list)
    differs: torch.Tensor | None = None  # (n,) bool, over the layers so far


class MoeRouting:
    """The hooks on a model's routers and the step's routing figures."""

    def __init__(self, model: PreTrainedModel, config: MoeConfig) -> None:
        self.config = config
        self.routers = routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no expert routers")
        jitter = getattr(model.config, "router_jitter_noise", 0.0) or 0.0
        if jitter > 0:
            raise UserInputError(
                f"router_jitter_noise {jitter}: the trainer's routing would be random and "
                "differ from the engine's; set it to 0 in the model's config.json"
            )
        first = self.routers[0]
        self.num_experts, self.top_k = int(first.num_experts), int(first.top_k)
        self.stats = self._empty()
        self._open: _Open | None = None
        for index, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(index))

    def _empty(self) -> RouteStats:
        return RouteStats(torch.zeros(len(self.routers), self.num_experts, dtype=torch.float64))

    # ---- a micro-batch -----------------------------------------------------------------
    def open(
        self, batch: MicroBatch | PackedBatch, counted: bool = True, version: int = -1
    ) -> None:
        """Hooks act on `batch` from here; `version` is the weights the trainer holds."""
        rows = route_rows(batch, self.num_experts, len(self.routers), self.top_k, version)
        rows.counted = counted
        self._open = _Open(rows)

    def forward_done(self) -> torch.Tensor | None:
        """After the forward: the micro-batch's load-balancing loss (None when off); hooks
        from here on are backward's recomputation."""
        state = self._require()
        state.recomputing = True
        self._count_mismatch(state)
        if self.config.aux_loss_coef <= 0 or not state.aux_terms:
            return None
        aux = torch.stack(state.aux_terms).mean()
        if state.rows.counted:
            self.stats.aux += float(aux.detach())
        return aux

    def close(self) -> None:
        self._open = None

    def take_stats(self) -> RouteStats:
        stats, self.stats = self.stats, self._empty()
        return stats

    def _require(self) -> _Open:
        assert self._open is not None, "MoeRouting: no micro-batch is open"
        return self._open

    def _count_mismatch(self, state: _Open) -> None:
        rows = state.rows
        if rows.recorded is None or not rows.counted or state.differs is None:
            return
        valid = (rows.recorded >= 0).all(dim=2).all(dim=1)
        self.stats.compared += int(valid.sum())
        self.stats.differed += int((state.differs & valid).sum())
        if rows.fresh is not None:
            fresh = valid & rows.fresh
            self.stats.compared_fresh += int(fresh.sum())
            self.stats.differed_fresh += int((state.differs & fresh).sum())

    # ---- the hook ------------------------------------------------------------------------
    def _hook(self, layer: int):
        def hook(module: nn.Module, args, output):
            state = self._open
            if state is None:
                return None
            return self._route(module, layer, state, *output)

        return hook

    def _route(
        self,
        module: nn.Module,
        layer: int,
        state: _Open,
        logits: torch.Tensor,
        weights: torch.Tensor,
        experts: torch.Tensor,
    ):
        """The router's output, replayed where it should be, after counting and comparing."""
        rows = state.rows
        own = experts.index_select(0, rows.positions)
        used = own
        if rows.recorded is not None:
            engine = rows.recorded[:, layer]
            known = (engine >= 0).all(dim=1, keepdim=True)
            if not state.recomputing:
                self._note_difference(state, own, engine, known.squeeze(1))
            if self.config.route_replay:
                used = torch.where(known, engine, own)
        if not state.recomputing and rows.counted:
            self.stats.counts[layer] += torch.bincount(
                used.flatten(), minlength=self.num_experts
            ).to(self.stats.counts)
        if self.config.aux_loss_coef > 0:
            aux = self._aux(logits, used, rows)
            if not state.recomputing:
                state.aux_terms.append(aux)
        if used is own:
            return None
        replayed = experts.index_put((rows.positions,), used)
        return logits, _weights_at(module, logits, replayed, weights.dtype), replayed

    def _note_difference(
        self, state: _Open, own: torch.Tensor, engine: torch.Tensor, known: torch.Tensor
    ) -> None:
        differ = (own.sort(dim=1).values != engine.sort(dim=1).values).any(dim=1) & known
        state.differs = differ if state.differs is None else state.differs | differ

    def _aux(self, logits: torch.Tensor, used: torch.Tensor, rows: RouteRows) -> torch.Tensor:
        """This layer's load-balancing term: sum over sequences s of weight_s x experts x
        sum_e f_se P_se (see the module doc)."""
        probs = torch.softmax(logits.index_select(0, rows.positions), dim=-1, dtype=torch.float32)
        count = rows.seq_weights.numel()
        tokens = torch.bincount(rows.sequence, minlength=count).clamp(min=1).to(probs)
        share = torch.zeros(count, self.num_experts, device=probs.device, dtype=probs.dtype)
        share.index_put_(
            (rows.sequence[:, None], used),
            torch.ones_like(used, dtype=probs.dtype),
            accumulate=True,
        )
        mean_p = torch.zeros_like(share).index_add(0, rows.sequence, probs)
        per_seq = (share * mean_p).sum(dim=1) / tokens**2 * self.num_experts
        return (per_seq * rows.seq_weights.to(per_seq)).sum()


def _share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def _weights_at(
    module: nn.Module, logits: torch.Tensor, experts: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The top-k weights a router gives `experts`: its softmax in float32 there,
    renormalised if it renormalises (Mixtral's always does), in the dtype it returns."""
    top = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(1, experts)
    if getattr(module, "norm_topk_prob", True):
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(dtype)


def is_moe(model: PreTrainedModel) -> bool:
    return bool(routers(model))
