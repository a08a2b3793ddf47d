"""The GRPO trainer: one optimizer step per call over groups, versioned weights, checkpoints.

Invariants: `version` counts published weight sets; `train_step` always moves it from v to
v + 1 (even when the batch has no tokens and no update is applied), and staleness in its
metrics is measured against v. `named_tensors()` are CPU copies, safe to hand to engines
while training continues. The reference model (KL) is frozen and never saved.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from dorarl.data import Group
from dorarl.errors import UserInputError
from dorarl.trainer import checkpoint as ckpt
from dorarl.trainer import lora, shards
from dorarl.trainer.allocator import map_large_blocks, release_free_heap
from dorarl.trainer.autocast import autocast_context
from dorarl.trainer.batch import MicroBatch, TrainSequence, build_sequences
from dorarl.trainer.config import LossConfig, TrainerConfig
from dorarl.trainer.forward import micro_batch_logprobs, resolve_packing, split_head
from dorarl.trainer.kernels import fuse_modules, load_ops
from dorarl.trainer.loss import Spans, k3_kl, objective
from dorarl.trainer.memory import PeakMemory
from dorarl.trainer.metrics import batch_metrics
from dorarl.trainer.moe import MoeRouting, RouteStats, is_moe
from dorarl.trainer.packing import PackedBatch, micro_batches
from dorarl.trainer.sizing import auto_micro_batch_tokens
from dorarl.trainer.totals import StepTotals

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_model(path: str | Path, dtype: str, device: torch.device | str) -> PreTrainedModel:
    """A causal LM from a local HF folder, safetensors only (never pickle)."""
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=DTYPES[dtype], use_safetensors=True
        )
    except (OSError, ValueError) as exc:
        raise UserInputError(f"{path}: cannot load model ({exc})") from None
    return model.to(device)


def _enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Per decoder layer, non-reentrant (recompute in backward; composes with FSDP2)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers before the rename
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def trainable_sequences(groups: list[Group], cfg: LossConfig) -> list[TrainSequence]:
    """The batch's sequences that have response tokens, weights normalised over all of them."""
    return [s for s in build_sequences(groups, cfg) if s.response_ids]


def with_skipped(summary: dict[str, float], skipped: int) -> dict[str, float]:
    """A step's loss metrics with the tokens of the sequences it skipped: `tokens` counts
    every trained token (the loss's), per-token means cover the computed ones."""
    summary["tokens"] += skipped
    summary["zero_advantage_tokens"] = float(skipped)
    return summary


class Trainer:
    """Owns the policy (and the frozen reference), its AdamW state and the version counter."""

    def __init__(
        self,
        model: PreTrainedModel,
        config: TrainerConfig,
        *,
        device="cpu",
        version: int = 0,
        source_dir: str | Path | None = None,
        reference_path: str | Path | None = None,
        adapter_dir: str | Path | None = None,
    ):
        config.validate()
        config.check_schedule()
        if config.lr is None:  # `dorarl train` chooses it by the model (jobs/model_defaults.py)
            raise ValueError("TrainerConfig.lr: None is for dorarl train to choose; give a rate")
        self.config = config
        self.device = torch.device(device)
        if self.device.type == "cpu":
            map_large_blocks()  # freed activations leave the process (dorarl.trainer.allocator)
        self.model = model.to(self.device)
        self.peft = None  # the PeftModel around `model` when trainer.lora.rank > 0
        self.base_path: str | None = None  # the frozen base a LoRA trainer's adapters are on
        if config.lora.enabled:
            self._add_adapters(source_dir, adapter_dir)
        self.model.train()
        if config.activation_checkpointing:
            _enable_activation_checkpointing(self.model)
        self.version = version
        self.optimizer_steps = 0
        self.source_dir = Path(source_dir) if source_dir is not None else None
        # held in memory: `checkpoint_keep` may prune the folder this trainer resumed from
        self.tokenizer_files = ckpt.read_tokenizer_files(self.source_dir) if source_dir else {}
        self.reference_path = str(reference_path) if reference_path is not None else None
        self._load_frozen()
        self._split_heads()
        models = [self.model, *(m for m in (self.reference, self.teacher) if m is not None)]
        self.packing = resolve_packing(models, config.packing)
        self.peak_memory = PeakMemory(self.device)
        self.micro_batch_tokens = config.micro_batch_tokens or auto_micro_batch_tokens(
            model.config,
            next(model.parameters()).element_size(),
            packed=self.packing == "shared_prompt",
            checkpointing=config.activation_checkpointing,
        )
        self.pad_id = int(model.config.pad_token_id or 0)
        self.routing = self._routing()
        self._shard_model()
        self.optimizer = self._make_optimizer()

    def _make_optimizer(self) -> torch.optim.AdamW:
        """AdamW over what trains: every weight, or only the adapters under LoRA."""
        config = self.config
        return torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=config.peak_lr(),
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
        )

    def _add_adapters(self, source_dir: str | Path | None, adapter_dir: str | Path | None) -> None:
        """Wrap the (base) model with peft: fresh adapters, or those of `adapter_dir`. The
        HF model stays `self.model` (peft injects its layers in place), so the forward, the
        chunked head and sharding see the usual module tree."""
        if source_dir is None:
            raise UserInputError("trainer.lora.rank > 0 needs the base model's folder")
        self.base_path = str(Path(source_dir).resolve())
        if adapter_dir is not None:
            self.peft = lora.load_adapter(self.model, Path(adapter_dir), self.config.lora)
        else:
            self.peft = lora.wrap(self.model, self.config.lora, self.base_path)
        self.model = self.peft.base_model.model
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in self.model.parameters())
        log.info(
            "LoRA rank %d: %d of %d parameters trainable", self.config.lora.rank, trainable, total
        )

    @classmethod
    def from_pretrained(
        cls, path: str | Path, config: TrainerConfig, device="cpu", version: int = 0
    ) -> Trainer:
        """Start from a HF model folder; the KL reference (if any) defaults to this model."""
        model = load_model(path, config.dtype, device)
        return cls(
            model,
            config,
            device=device,
            version=version,
            source_dir=path,
            reference_path=config.reference_path or path,
        )

    @classmethod
    def resume(
        cls, folder: str | Path, config: TrainerConfig, device="cpu", **kwargs: Any
    ) -> tuple[Trainer, dict[str, Any]]:
        """Continue from `save_checkpoint`: weights, optimizer, version, RNG; returns
        extra_state. A sharded checkpoint (any world size) loads through DCP."""
        folder = Path(folder)
        state = ckpt.read_state(folder)
        base = _check_lora_resume(folder, state, config)
        model = load_model(base or folder, config.dtype, device)
        trainer = cls(
            model,
            config,
            device=device,
            version=state["version"],
            source_dir=base or folder,
            reference_path=config.reference_path or state.get("reference_path"),
            adapter_dir=folder if base else None,
            **kwargs,
        )
        trainer.tokenizer_files = ckpt.read_tokenizer_files(folder) or trainer.tokenizer_files
        trainer.optimizer_steps = state["optimizer_steps"]
        if state["optimizer"] is not None:
            trainer._restore_optimizer(folder, state["optimizer"])
        else:  # an older checkpoint: the newer one beside it took the optimizer state
            log.warning("%s holds no optimizer state: AdamW starts afresh", folder)
        trainer._apply_hyperparameters()
        ckpt.restore_rng(ckpt.load_tensors(folder / ckpt.RNG_FILE), state["rng"])
        log.info("resumed %s at version %d", folder, trainer.version)
        return trainer, state["extra_state"]

    def _restore_optimizer(self, folder: Path, meta: dict[str, Any]) -> None:
        names = self._param_names()
        if shards.has_shards(folder):
            shards.load_shards(folder / shards.SHARDS_DIR, self.model, self.optimizer, names, meta)
            return
        tensors = ckpt.load_tensors(folder / ckpt.OPTIMIZER_FILE)
        params = dict(self.model.named_parameters())
        for key, value in tensors.items():
            tensors[key] = self._lay_out_like(params[key.split(".", 1)[1].rsplit(".", 1)[0]], value)
        ckpt.optimizer_from_files(self.optimizer, names, tensors, meta)

    def _lay_out_like(self, param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """A full optimizer tensor as this trainer holds it (a sharded one shards it)."""
        return value

    def _shard_model(self) -> None:
        """Where a sharded trainer wraps its model, before the optimizer sees parameters."""

    def _routing(self) -> MoeRouting | None:
        """The router hooks of an MoE policy (trainer.moe); None for a dense one."""
        moe = self.config.moe
        if is_moe(self.model):
            return MoeRouting(self.model, moe)
        if moe.aux_loss_coef > 0 or moe.route_replay:
            log.warning("trainer.moe: %s has no experts; ignored", type(self.model).__name__)
        return None

    def _load_frozen(self) -> None:
        """The frozen models the loss reads: the KL reference, the distillation teacher."""
        self.reference = self._load_reference() if self.config.loss.kl_coef > 0 else None
        teacher = self.config.teacher
        self.teacher = self._frozen(teacher) if teacher is not None else None

    def _split_heads(self) -> None:
        """Each model's body and output layer (forward.split_head), kernels fused first."""
        self.fused = self._fuse_kernels()
        self.split, self.reference_split, self.teacher_split = (
            split_head(m, self.fused) if m is not None else None
            for m in (self.model, self.reference, self.teacher)
        )

    def _fuse_kernels(self) -> bool:
        """trainer.kernels=auto on the CPU: every model's RMSNorm and SwiGLU modules, and its
        output layer's softmax, through the fused kernels (dorarl.trainer.kernels)."""
        if self.config.kernels != "auto" or self.device.type != "cpu" or load_ops() is None:
            return False
        for model in (self.model, self.reference, self.teacher):
            if model is not None:
                fused = fuse_modules(model)
                log.info("fused kernels on %s: %s", type(model).__name__, fused or "none")
        return True

    def _load_reference(self) -> PreTrainedModel:
        if self.reference_path is None:
            raise UserInputError("loss.kl_coef > 0 needs a reference model (reference_path)")
        return self._frozen(self.reference_path)

    def _frozen(self, path: str) -> PreTrainedModel:
        model = load_model(path, self.config.dtype, self.device)
        model.eval().requires_grad_(False)
        return model

    # ---- training -------------------------------------------------------------------------

    def train_step(self, groups: list[Group]) -> dict[str, float | dict]:
        """One optimizer step on `groups` (rewards filled in); version v -> v + 1."""
        start = time.perf_counter()
        self.peak_memory.start()
        metrics: dict[str, float | dict] = batch_metrics(groups, self.version)
        lr = self._lr()  # this step's, before the update moves the schedule on
        loss_metrics = self.accumulate_gradients(groups)
        if (
            loss_metrics["tokens"] > 0
            and loss_metrics["tokens"] == loss_metrics["zero_advantage_tokens"]
        ):
            self._zero_gradients()  # every sequence skipped: the update a zero gradient makes
        if loss_metrics["tokens"] > 0:
            grad_norm, applied = self._optimizer_step()
        else:
            log.warning(
                "training step at version %d has no response tokens; no update", self.version
            )
            grad_norm, applied = 0.0, False
        self.version += 1
        if self.device.type == "cpu":
            release_free_heap()
        metrics.update(loss_metrics)
        metrics.update(
            grad_norm=grad_norm,
            update_applied=float(applied),
            lr=lr,
            version=float(self.version),
            step_seconds=time.perf_counter() - start,
            peak_memory_gb=self.peak_memory.peak_gb(),
        )
        return metrics

    def accumulate_gradients(self, groups: list[Group]) -> dict[str, float]:
        """Forward/backward over token-budget micro-batches; leaves the full-batch gradient
        in `.grad` (no optimizer step) and returns the loss metrics."""
        seqs, skipped = self.step_sequences(groups)
        totals = StepTotals()
        batches = micro_batches(
            seqs, self.micro_batch_tokens, self.packing, self.pad_id, self.device, self.model.config
        )
        for batch in batches:
            self._micro_step(batch, totals)
        summary = {**totals.summary(), "micro_batches": float(len(batches))}
        return with_skipped(summary, skipped) | self._routing_metrics(lambda stats: stats)

    def step_sequences(self, groups: list[Group]) -> tuple[list[TrainSequence], int]:
        """The batch's sequences this step computes, and the trained tokens of those it
        leaves out: with `skip_zero_advantage`, a sequence whose advantage is 0 adds exactly
        nothing to the loss or its gradient unless another term reads its tokens. Weights
        are assigned before, over the whole batch, so the loss's normaliser keeps them."""
        seqs = trainable_sequences(groups, self.config.loss)
        if not self._skips_zero_advantage():
            return seqs, 0
        kept = [s for s in seqs if s.advantage != 0.0]
        return kept, sum(s.trained_tokens for s in seqs if s.advantage == 0.0)

    def _skips_zero_advantage(self) -> bool:
        # An MoE model's expert load, balancing loss and route-replay checks read every token.
        loss = self.config.loss
        other_terms = loss.kl_coef != 0 or loss.entropy_coef != 0 or self.teacher is not None
        return self.config.skip_zero_advantage and not (other_terms or self.routing is not None)

    def _zero_gradients(self) -> None:
        """Zero gradients where backward left none, so AdamW steps as after a backward that
        gave zeros (its moments still move the weights)."""
        for param in self.model.parameters():
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)

    def _routing_metrics(self, reduce) -> dict[str, float | dict[str, float]]:
        """The step's expert load and route agreement (MoE), after `reduce` over ranks."""
        if self.routing is None:
            return {}
        stats: RouteStats = reduce(self.routing.take_stats())
        return stats.metrics(self.config.moe.aux_loss_coef > 0)

    def _policy_logprobs(
        self, batch: MicroBatch | PackedBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return micro_batch_logprobs(
            self.model,
            self.split,
            batch,
            self.config.temperature,
            self.config.logits_chunk_tokens,
            entropy_grad=self.config.loss.entropy_coef != 0.0,
        )

    def _micro_step(
        self, batch: MicroBatch | PackedBatch, totals: StepTotals, counted: bool = True
    ) -> None:
        if self.routing is None:
            self._loss_step(batch, totals)
            return
        self.routing.open(batch, counted, self.version)  # the router hooks act on this batch
        try:
            self._loss_step(batch, totals)
        finally:
            self.routing.close()

    def _loss_step(self, batch: MicroBatch | PackedBatch, totals: StepTotals) -> None:
        cfg = self.config.loss
        with autocast_context(self.config.autocast, self.device):
            logp, entropy = self._policy_logprobs(batch)
            aux = self.routing.forward_done() if self.routing is not None else None
            ref_logp = self._reference_logprobs(batch) if self.reference is not None else None
            teacher_logp = self._teacher_logprobs(batch) if self.teacher is not None else None
        loss, terms = objective(
            logp,
            batch.behavior_logp,
            batch.advantages,
            batch.weights,
            cfg,
            ref_logp=ref_logp,
            entropy=entropy,
            spans=Spans.of(batch),
            teacher_logp=teacher_logp,
        )
        if aux is not None:  # the load-balancing loss: its gradient, not in the loss metric
            (loss + self.config.moe.aux_loss_coef * aux).backward()
        else:
            loss.backward()
        kl_ref = k3_kl(logp.detach(), ref_logp) if ref_logp is not None else None
        totals.add(batch, loss.detach(), terms, logp.detach(), entropy.detach(), kl_ref)
        totals.add_mismatch(batch, logp.detach(), self.version)
        if teacher_logp is not None:
            totals.add_distill(batch, teacher_logp)

    def _reference_logprobs(self, batch: MicroBatch | PackedBatch) -> torch.Tensor:
        return self._frozen_logprobs(self.reference, self.reference_split, batch)

    def _teacher_logprobs(self, batch: MicroBatch | PackedBatch) -> torch.Tensor:
        return self._frozen_logprobs(self.teacher, self.teacher_split, batch)

    @torch.no_grad()
    def _frozen_logprobs(self, model, split, batch: MicroBatch | PackedBatch) -> torch.Tensor:
        logp, _ = micro_batch_logprobs(
            model, split, batch, self.config.temperature, self.config.logits_chunk_tokens
        )
        return logp

    def _optimizer_step(self) -> tuple[float, bool]:
        """Clip, step, zero. A non-finite gradient skips the update rather than corrupt weights."""
        for group in self.optimizer.param_groups:
            group["lr"] = self._lr()
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm > 0 else math.inf
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        applied = math.isfinite(grad_norm)
        if applied:
            self.optimizer.step()
            self.optimizer_steps += 1
        else:
            log.warning("non-finite gradient norm at version %d; update skipped", self.version)
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, applied

    def _lr(self) -> float:
        """The rate of the next update: the schedule at the optimizer steps made so far,
        which a checkpoint carries, so a resumed trainer goes on where it stopped."""
        return self.config.schedule().at(self.optimizer_steps)

    def _apply_hyperparameters(self) -> None:
        """The given config wins over the hyper-parameters stored with a checkpoint.

        The learning rate is not touched here: `_optimizer_step` sets it from the schedule.
        """
        for group in self.optimizer.param_groups:
            group.update(
                weight_decay=self.config.weight_decay,
                eps=self.config.adam_eps,
                betas=(self.config.adam_beta1, self.config.adam_beta2),
            )

    # ---- weights and checkpoints -----------------------------------------------------------

    def named_tensors(self, on_device: bool = False) -> dict[str, torch.Tensor]:
        """The current weights by HF state-dict name, as CPU copies (not views of live
        params); `on_device`: the live tensors themselves, for a caller that copies them."""
        live = {name: t.detach() for name, t in self.model.state_dict().items()}
        state = self._for_engines(live)
        if on_device:
            return state
        views = {id(t) for t in live.values()}  # merged LoRA weights are new tensors already
        return {name: t.to("cpu", copy=id(t) in views) for name, t in state.items()}

    def adapter_tensors(self, on_device: bool = False) -> dict[str, torch.Tensor]:
        """A LoRA trainer's adapters alone, by peft's names (lora.adapter_tensors), as CPU
        copies; `on_device`: the live tensors, for a caller that copies them."""
        assert self.peft is not None, "adapter_tensors of a full-weight trainer"
        live = {n: t.detach() for n, t in self.model.state_dict().items() if ".lora_" in n}
        named = lora.adapter_tensors(self.peft, live)
        if on_device:
            return named
        return {name: t.to("cpu", copy=True) for name, t in named.items()}

    def _for_engines(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The weights a version is for the engines: with LoRA, the base with every adapter
        merged, by the base model's HF names (a full-weight version on the wire)."""
        if self.peft is None:
            return state
        return lora.merged_tensors(state, lora.scale(self.config.lora))

    def _param_names(self) -> dict[int, str]:
        return {id(p): name for name, p in self.model.named_parameters()}

    def save_checkpoint(
        self, folder: str | Path, extra_state: dict[str, Any] | None = None
    ) -> Path:
        """Write weights (HF folder), optimizer, RNG, version and the caller's `extra_state`.

        `extra_state` must be JSON-serialisable (e.g. the data position).
        """
        extra = _jsonable_extra(extra_state)
        return ckpt.write_atomically(Path(folder), lambda tmp: self._write_checkpoint(tmp, extra))

    def _write_checkpoint(self, folder: Path, extra: dict[str, Any]) -> None:
        self._save_weights(folder)
        opt_tensors, opt_meta = ckpt.optimizer_to_files(self.optimizer, self._param_names())
        ckpt.save_tensors(folder / ckpt.OPTIMIZER_FILE, opt_tensors)
        self._write_state(folder, opt_meta, extra)

    def _save_weights(self, folder: Path, state: dict[str, torch.Tensor] | None = None) -> None:
        """The model part of a checkpoint (from `state`, the full unmerged state dict, when
        given; else the model's own): an HF model folder, or with LoRA a peft adapter folder
        (adapter_config.json and adapter_model.safetensors: the adapters only)."""
        if self.peft is None:
            self.model.save_pretrained(str(folder), state_dict=state)
            return
        if state is not None:
            state = {lora.PEFT_PREFIX + k: v for k, v in state.items()}
        self.peft.save_pretrained(str(folder), state_dict=state)

    def _write_state(
        self, folder: Path, opt_meta: dict[str, Any], extra: dict[str, Any], **more: Any
    ) -> None:
        """Tokenizer files, RNG and trainer_state.json: what every checkpoint has."""
        ckpt.write_tokenizer_files(self.tokenizer_files, folder)
        rng_tensors, rng_meta = ckpt.capture_rng()
        ckpt.save_tensors(folder / ckpt.RNG_FILE, rng_tensors)
        state = {
            "format": 1,
            "version": self.version,
            "optimizer_steps": self.optimizer_steps,
            "reference_path": self.reference_path,
            "optimizer": opt_meta,
            "rng": rng_meta,
            "config": dataclasses.asdict(self.config),
            "extra_state": extra,
            **({lora.BASE_KEY: self.base_path} if self.peft is not None else {}),
            **more,
        }
        (folder / ckpt.STATE_FILE).write_text(json.dumps(state))


def _check_lora_resume(folder: Path, state: dict[str, Any], config: TrainerConfig) -> str | None:
    """The base model folder of a LoRA checkpoint (None for a full-weight one); a LoRA
    checkpoint resumed without trainer.lora.rank, or the other way round, is refused."""
    base = state.get(lora.BASE_KEY)
    if base and not config.lora.enabled:
        raise UserInputError(
            f"trainer.lora.rank: {folder} holds LoRA adapters; resume it with "
            "trainer.lora.rank set as in its run"
        )
    if config.lora.enabled and not base:
        raise UserInputError(
            f"trainer.lora.rank: {folder} is a full-weight checkpoint; LoRA starts from a "
            "model folder (model=FOLDER), not from a full-weight run's checkpoint"
        )
    return base


def _jsonable_extra(extra_state: dict[str, Any] | None) -> dict[str, Any]:
    extra = extra_state or {}
    try:
        json.dumps(extra)
    except TypeError as exc:
        raise TypeError(f"extra_state must be JSON-serialisable: {exc}") from None
    return extra
