"""One rank of a data-parallel trainer: FSDP2-sharded weights, gradients and AdamW state.

Every rank gets the whole batch and takes its own share of it (`distributed.rank_shares`,
the same on every rank: whole groups when rows are packed), planned into padded or packed
micro-batches as one process plans them; ranks with fewer micro-batches run zero-weight
filler passes so that collectives pair up. Per-token weights are normalised over the whole batch before the
split and gradients are summed over ranks, so loss, gradient and update equal one
process's (to float rounding). The step's metrics are reduced over ranks; weights for the
engines and checkpoints are gathered on rank 0. Every public method is collective: all
ranks call it, in the same order.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import PreTrainedModel

from dorarl.data import Group
from dorarl.trainer import checkpoint as ckpt
from dorarl.trainer import lora, shards
from dorarl.trainer.batch import MicroBatch, TrainSequence
from dorarl.trainer.config import TrainerConfig
from dorarl.trainer.distributed import (
    RankGroup,
    gather_over_ranks,
    rank_shares,
    reduce_over_ranks,
    shard,
)
from dorarl.trainer.forward import HeadSplit, micro_batch_logprobs
from dorarl.trainer.moe import RouteStats
from dorarl.trainer.packing import PackedBatch, collate_planned, micro_batches, plan_step
from dorarl.trainer.totals import StepTotals
from dorarl.trainer.trainer import Trainer, _jsonable_extra, with_skipped

log = logging.getLogger(__name__)

SUMMED = (
    "tokens",
    "loss",
    "pg_loss",
    "ratio",
    "clipped_low",
    "clipped_high",
    "entropy",
    "kl_behavior",
    "kl_ref",
    "importance",
    "truncated",
    "is_masked",
    "seq_ratio",
    "sequences",
    "distill_kl",
)
OPTIONAL = ("kl_ref", "importance", "is_masked", "seq_ratio", "distill_kl")


class PolicyForward(torch.nn.Module):
    """The FSDP root: body and chunked output layer in one forward, so the root's
    all-gather and gradient reduce-scatter wrap the whole computation (the output layer is
    called outside the HF model's own forward). Takes only integer and boolean tensors,
    which mixed precision leaves alone: a packed batch's block mask stays boolean here and
    becomes the additive one inside, in the compute dtype."""

    def __init__(self, model: PreTrainedModel, split: HeadSplit | None, config: TrainerConfig):
        super().__init__()
        self.model, self.split, self.config = model, split, config

    def forward(
        self, input_ids, targets, mask, position_ids=None, attention_mask=None, sources=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return micro_batch_logprobs(
            self.model,
            self.split,
            _model_batch(input_ids, targets, mask, position_ids, attention_mask, sources),
            self.config.temperature,
            self.config.logits_chunk_tokens,
            entropy_grad=self.config.loss.entropy_coef != 0.0,
        )


def _model_batch(input_ids, targets, mask, position_ids, attention_mask, sources):
    """The batch `micro_batch_logprobs` reads (its loss tensors are not needed there)."""
    if sources is None:
        return MicroBatch(input_ids, targets, None, None, None, mask)  # type: ignore[arg-type]
    return PackedBatch(
        input_ids, position_ids, attention_mask, sources, targets, None, None, None, mask
    )  # type: ignore[arg-type]


def _model_inputs(batch: MicroBatch | PackedBatch) -> dict[str, torch.Tensor]:
    inputs = {"input_ids": batch.input_ids, "targets": batch.targets, "mask": batch.mask}
    if isinstance(batch, PackedBatch):
        inputs.update(
            position_ids=batch.position_ids,
            attention_mask=batch.attention_mask,
            sources=batch.sources,
        )
    return inputs


class ShardedTrainer(Trainer):
    def __init__(self, model: PreTrainedModel, config: TrainerConfig, *, group: RankGroup, **kw):
        self.group = group
        super().__init__(model, config, **kw)

    @classmethod
    def from_pretrained_group(
        cls, path: str | Path, config: TrainerConfig, group: RankGroup, device="cpu"
    ) -> ShardedTrainer:
        """This rank's trainer from a HF folder (every rank loads it, then keeps its shard)."""
        from dorarl.trainer.trainer import load_model

        return cls(
            load_model(path, config.dtype, device),
            config,
            group=group,
            device=device,
            source_dir=path,
            reference_path=config.reference_path or path,
        )

    def _shard_model(self) -> None:
        layers = getattr(self.model.base_model, "layers", None)
        if layers is None:
            raise ValueError(f"{type(self.model).__name__}: no decoder layers to shard")
        self.policy = PolicyForward(self.model, self.split, self.config)
        shard(self.policy, list(layers), self.group)

    def _policy_logprobs(
        self, batch: MicroBatch | PackedBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.policy(**_model_inputs(batch))

    # ---- training -------------------------------------------------------------------------

    def train_step(self, groups: list[Group]) -> dict[str, float | dict]:
        metrics = super().train_step(groups)
        metrics["peak_memory_gb"] = reduce_over_ranks(
            [metrics["peak_memory_gb"]], self.group, "max"
        )[0]
        return metrics

    def accumulate_gradients(self, groups: list[Group]) -> dict[str, float]:
        seqs, skipped = self.step_sequences(groups)
        budget, packing = self.micro_batch_tokens, self.packing
        shares = rank_shares(seqs, self.group.world_size, packing, budget)
        plans = [plan_step(share, budget, packing, self.model.config) for share in shares]
        mine = plans[self.group.rank]
        totals = StepTotals()
        for index in range(max(len(p) for p in plans)):
            if index < len(mine):
                batch = collate_planned(mine[index], packing, self.pad_id, self.device)
                self._micro_step(batch, totals)
            else:
                self._micro_step(self._filler(), StepTotals(), counted=False)
        summary = self._reduce(totals).summary()
        summary["micro_batches"] = float(sum(len(p) for p in plans))
        # every rank saw the whole batch: `skipped` is the step's, not this rank's
        return with_skipped(summary, skipped) | self._routing_metrics(self._reduce_routes)

    def _reduce_routes(self, stats: RouteStats) -> RouteStats:
        summed = reduce_over_ranks(stats.as_floats(), self.group)
        layers, experts = stats.counts.shape
        return RouteStats.from_floats(summed, layers, experts)

    def _filler(self) -> MicroBatch | PackedBatch:
        """A pass that runs every FSDP unit's collectives and adds exactly zero gradient
        (one pad token answering one pad token, weight 0, in this trainer's packing)."""
        pad = self.pad_id
        filler = TrainSequence([pad], [pad], [0.0], 0.0, 0.0)
        return micro_batches([filler], self.micro_batch_tokens, self.packing, pad, self.device)[0]

    def _reduce(self, totals: StepTotals) -> StepTotals:
        values = [float(getattr(totals, k) or 0.0) for k in SUMMED]
        present = [float(getattr(totals, k) is not None) for k in OPTIONAL]
        summed = reduce_over_ranks(values + present, self.group)
        out = StepTotals(**{k: v for k, v in zip(SUMMED, summed, strict=False)})
        out.tokens, out.clipped_low, out.clipped_high = (
            int(out.tokens),
            int(out.clipped_low),
            int(out.clipped_high),
        )
        out.truncated, out.sequences = int(out.truncated), int(out.sequences)
        for key, count in zip(OPTIONAL, summed[len(SUMMED) :], strict=True):
            if count == 0:
                setattr(out, key, None)
        if out.is_masked is not None:
            out.is_masked = int(out.is_masked)
        maxima = [totals.ratio_max, totals.seq_ratio_max, -totals.seq_ratio_min]
        out.ratio_max, out.seq_ratio_max, low = reduce_over_ranks(maxima, self.group, "max")
        out.seq_ratio_min = -low
        out.mismatch = totals.mismatch.gathered(lambda t: gather_over_ranks(t, self.group))
        return out

    # ---- weights and checkpoints -----------------------------------------------------------

    def named_tensors(self, on_device: bool = False) -> dict[str, torch.Tensor]:
        """Full weights on rank 0 (CPU copies by HF name, as one process gives them, LoRA
        adapters merged; with `on_device`, on the device); {} on the other ranks, which only
        take part in the gathers. A tied weight is gathered once and its names share that
        one tensor, as they share a parameter in one process (senders drop such aliases by
        storage)."""
        gathered = self._gathered(on_device)
        return self._for_engines(gathered) if gathered else gathered

    def adapter_tensors(self, on_device: bool = False) -> dict[str, torch.Tensor]:
        """The adapters alone on rank 0 (as one process gives them), gathered without the
        base; {} on the other ranks, which only take part in the gathers."""
        assert self.peft is not None, "adapter_tensors of a full-weight trainer"
        gathered = self._gathered(on_device, only_adapters=True)
        return lora.adapter_tensors(self.peft, gathered) if gathered else gathered

    def _gathered(
        self, on_device: bool = False, only_adapters: bool = False
    ) -> dict[str, torch.Tensor]:
        """The model's full (unmerged) state dict on rank 0, one tensor per parameter (with
        `only_adapters`, the LoRA tensors: every rank gathers the same ones, in order);
        {} on the other ranks."""
        gathered: dict[str, torch.Tensor] = {}
        by_param: dict[int, torch.Tensor | None] = {}
        keep = self.group.is_coordinator
        with torch.no_grad():
            for name, tensor in self.model.state_dict(keep_vars=True).items():
                if only_adapters and ".lora_" not in name:
                    continue
                if id(tensor) not in by_param:
                    full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
                    by_param[id(tensor)] = _copy(full.detach(), on_device) if keep else None
                if keep:
                    gathered[name] = by_param[id(tensor)]
        return gathered

    def save_checkpoint(
        self, folder: str | Path, extra_state: dict[str, Any] | None = None
    ) -> Path:
        """Sharded DCP files from every rank plus, from rank 0, the consolidated HF folder,
        optimizer metadata, RNG and state; written into `.tmp` and swapped in by rank 0."""
        extra, folder = _jsonable_extra(extra_state), Path(folder)
        if self.group.is_coordinator:
            ckpt.prepare_temporary(folder)
        dist.barrier()
        tmp = ckpt.temporary_of(folder)
        names = self._param_names()
        shards.save_shards(tmp / shards.SHARDS_DIR, self.model, self.optimizer, names)
        full = self._gathered()
        if self.group.is_coordinator:
            self._save_weights(tmp, full)
            _, opt_meta = ckpt.optimizer_state_by_name(self.optimizer, names)
            self._write_state(tmp, opt_meta, extra, world_size=self.group.world_size)
            ckpt.swap_in(folder)
        dist.barrier()
        return folder

    def _lay_out_like(self, param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        if isinstance(param, DTensor) and tuple(value.shape) == tuple(param.shape):
            local = param.to_local()
            return distribute_tensor(value.to(local.device), param.device_mesh, param.placements)
        return value


def _copy(tensor: torch.Tensor, on_device: bool) -> torch.Tensor:
    return tensor if on_device else tensor.to("cpu", copy=True)
