"""Calibrate device emulation once per run: real compute of engine and training steps, alone.

Measured in this process with one torch thread (as in the actors) before any actor starts.
`choose_pace` then picks the device times (see `PaceRule`): every pace is at least `margin`
times the real compute alone, the paced workers together keep busy at most `cpu_share` of
the cores on average (the rest absorbs the driver, Ray and contention), and a training step
lasts `train_ratio` of the expected synchronous rollout, a stated property of the workload.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from dorarl.bench.clock import timed
from dorarl.config import check_fields
from dorarl.data import Group, Sample
from dorarl.engine import EngineConfig, SamplingParams
from dorarl.engine.instance import close_engine, open_engine
from dorarl.engine.interface import InstanceEngine
from dorarl.record.pacing import DeviceModel
from dorarl.trainer import Trainer, TrainerConfig

log = logging.getLogger(__name__)


@dataclass
class Calibration:
    """Real compute, alone, one thread. Step times are seconds."""

    decode_step_s: float  # a full-batch decode step (90th percentile of the steps timed)
    decode_batch: int
    decode_context: int  # mean tokens per sequence over the timed steps
    prefill_token_s: float  # per prefilled token (median over prefill-only steps)
    train_fixed_s: float  # linear fit of a training step over its tokens
    train_token_s: float
    train_tokens: int  # tokens of the full training batch timed
    train_step_s: float  # that batch's real step time (median)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(kw_only=True)
class PaceRule:
    margin: float = field(
        default=2.0, metadata={"help": "least device time / real compute alone, per step", "ge": 1}
    )
    cpu_share: float = field(
        default=0.5,
        metadata={
            "help": "most of the cores the paced workers may keep busy, on average",
            "gt": 0,
            "le": 1,
        },
    )
    cores: int = field(
        default_factory=lambda: os.cpu_count() or 2,
        metadata={"help": "CPU cores shared", "ge": 1},
    )
    train_ratio: float = field(
        default=0.5,
        metadata={
            "help": "device time of a training step / expected sync rollout time",
            "gt": 0,
        },
    )
    kv_share: float = field(
        default=0.2,
        metadata={
            "help": "a step's KV read at a full pool, as a share of its weight read",
            "ge": 0,
        },
    )
    min_decode_s: float = field(
        default=0.02,
        metadata={
            "help": "least device time of a decode step: a real accelerator's step takes tens "
            "of ms, so the runtime's per-call latency (ms, unpaced) must stay small beside it",
            "ge": 0,
        },
    )

    def validate(self) -> None:
        check_fields(self)


# ---- engine ------------------------------------------------------------------------------
def calibrate_engine(
    model_folder: str, config: EngineConfig, prompts: Sequence[list[int]], decode_len: int
) -> tuple[float, int, float]:
    """(full-batch decode step s, its mean context, prefill s per token), one thread."""
    with _one_thread():
        engine = open_engine(model_folder, config)
        try:
            decode_s, context = _time_decode(engine, prompts, decode_len)
            prefill_s = _time_prefill(engine, prompts)
        finally:
            close_engine(engine)
    return decode_s, context, prefill_s


def _time_decode(
    engine: InstanceEngine, prompts: Sequence[list[int]], decode_len: int
) -> tuple[float, int]:
    batch = engine.config.max_num_seqs
    for i in range(batch):
        params = SamplingParams(target_len=decode_len, seed=i)
        engine.add_request(f"decode-{i}", list(prompts[i % len(prompts)]), params)
    times, contexts = [], []
    while engine.has_unfinished():
        elapsed, work = timed(engine.step)[1].wall_s, engine.last_step
        if work.decode_tokens == batch:  # a full-batch decode step (nothing prefilled)
            times.append(elapsed)
            contexts.append(work.resident_tokens / batch)
    kept = sorted(times[2:]) or sorted(times)  # the first steps warm caches up
    assert kept, "no full-batch decode step was timed"
    return kept[int(0.9 * (len(kept) - 1))], round(statistics.mean(contexts))


def _time_prefill(engine: InstanceEngine, prompts: Sequence[list[int]]) -> float:
    """Prefill-only steps of long prompts (target length 1), seconds per token."""
    config = engine.config
    length = max(1, min(config.max_model_len - 1, 4 * config.prefill_chunk_size) // 2)
    pool = [t for p in prompts for t in p] or [0]
    for i in range(config.max_num_seqs):
        ids = [pool[(i + j) % len(pool)] for j in range(length)]
        engine.add_request(f"prefill-{i}", ids, SamplingParams(target_len=1, seed=i))
    per_token = []
    while engine.has_unfinished():
        elapsed = timed(engine.step)[1].wall_s
        tokens = engine.last_step.decode_tokens + engine.last_step.prefill_tokens
        if tokens > config.max_num_seqs:  # a prefill step, not a final one-token decode
            per_token.append(elapsed / tokens)
    return statistics.median(per_token[1:] or per_token)


def sample_lengths(
    model_folder: str,
    config: EngineConfig,
    prompts: Sequence[list[int]],
    group_size: int,
    params: SamplingParams,
    seed: int = 0,
) -> list[list[int]]:
    """Response lengths of real sampling: one group of `group_size` per prompt (the shape of
    a batch when lengths are not forced), one thread."""
    with _one_thread():
        engine = open_engine(model_folder, config)
        for g, prompt in enumerate(prompts):
            for i in range(group_size):
                own = dataclasses.replace(params, seed=seed * 1_000_003 + g * group_size + i)
                engine.add_request(f"{g}-{i}", list(prompt), own)
        lengths: dict[str, int] = {}
        while engine.has_unfinished():
            lengths.update({o.request_id: len(o.output_ids) for o in engine.step()})
        close_engine(engine)
    return [[lengths[f"{g}-{i}"] for i in range(group_size)] for g in range(len(prompts))]


# ---- trainer -----------------------------------------------------------------------------
def calibrate_trainer(
    model_folder: str, config: TrainerConfig, batch: list[Group], repeats: int = 2
) -> tuple[float, float, int, float]:
    """(fixed s, s per token, full-batch tokens, full-batch step s) from half and full batches."""
    half = batch[: max(1, len(batch) // 2)]
    with _one_thread():
        trainer = Trainer.from_pretrained(model_folder, config)
        trainer.train_step(half)  # warm-up: allocator, optimizer state
        t_half = statistics.median(_time_train(trainer, half) for _ in range(repeats))
        t_full = statistics.median(_time_train(trainer, batch) for _ in range(repeats))
    n_half, n_full = _tokens(half), _tokens(batch)
    per_token = max(0.0, (t_full - t_half) / (n_full - n_half)) if n_full > n_half else 0.0
    if per_token == 0.0:
        per_token = t_full / n_full
    fixed = max(0.0, t_full - per_token * n_full)
    return fixed, per_token, n_full, t_full


def _time_train(trainer: Trainer, groups: list[Group]) -> float:
    return timed(lambda: trainer.train_step(groups))[1].wall_s


def _tokens(groups: list[Group]) -> int:
    return sum(len(s.prompt_ids) + len(s.response_ids) for g in groups for s in g.samples)


def synthetic_batch(
    prompts: Sequence[list[int]], lengths: Sequence[Sequence[int]], vocab_size: int, seed: int = 0
) -> list[Group]:
    """Groups of the workload's shape (prompt ids, response lengths), random response ids,
    mixed rewards so every advantage is non-zero: what the trainer will see, in cost."""
    rng = random.Random(seed)
    groups = []
    for gid, group_lengths in enumerate(lengths):
        prompt = list(prompts[gid % len(prompts)])
        samples = [
            Sample(
                gid,
                i,
                gid,
                prompt,
                [rng.randrange(vocab_size) for _ in range(n)],
                [-1.0] * n,
                [0] * n,
                reward=float(i % 2),
            )  # fmt: skip
            for i, n in enumerate(group_lengths)
        ]
        groups.append(Group(gid, gid, 0, samples))
    return groups


def quiet_model_loading() -> None:
    """No per-load progress bar from Hugging Face in a benchmark's printed tables."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


class _one_thread:
    """Calibrate as the actors run: one torch thread (restored on exit)."""

    def __enter__(self) -> None:
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.threads)


def calibrate(
    model_folder: str,
    engine: EngineConfig,
    trainer: TrainerConfig,
    prompts: Sequence[list[int]],
    lengths: Sequence[Sequence[int]],
    vocab_size: int,
    decode_len: int,
    seed: int = 0,
) -> Calibration:
    """Engine at full batch decoding `decode_len` tokens, trainer on a batch of the workload's
    shape (one group per entry of `lengths`, prompts in order)."""
    decode_s, context, prefill_s = calibrate_engine(model_folder, engine, prompts, decode_len)
    batch = synthetic_batch(prompts, lengths, vocab_size, seed)
    fixed, per_token, tokens, step_s = calibrate_trainer(model_folder, trainer, batch)
    return Calibration(
        decode_s, engine.max_num_seqs, context, prefill_s, fixed, per_token, tokens, step_s
    )


# ---- the pace ----------------------------------------------------------------------------
def choose_pace(
    cal: Calibration,
    rule: PaceRule,
    *,
    num_instances: int,
    kv_pool_tokens: int,
    sync_rollout_steps: float,
) -> tuple[DeviceModel, dict[str, Any]]:
    """Device times from the calibration; returns the model and how it was derived.

    `sync_rollout_steps`: expected engine steps of one synchronous rollout. With the train
    step tied to the decode step (T = train_ratio x sync_rollout_steps x D), the decode step
    D is the least that meets: D >= margin x real decode; T >= margin x real train;
    N x real decode / D + real train / T <= cpu_share x cores (mean CPU demand); and
    D >= min_decode_s."""
    rule.validate()
    steps = rule.train_ratio * sync_rollout_steps  # T = steps x D
    demand = num_instances * cal.decode_step_s + cal.train_step_s / steps  # CPU-s per D
    candidates = {
        "decode_margin": rule.margin * cal.decode_step_s,
        "train_margin": rule.margin * cal.train_step_s / steps,
        "cpu_share": demand / (rule.cpu_share * rule.cores),
        "min_decode": rule.min_decode_s,
    }
    bound = max(candidates, key=candidates.get)
    decode = candidates[bound]
    scale = steps * decode / cal.train_step_s  # the same factor on fixed and per-token time
    device = DeviceModel(
        decode_step_s=decode,
        kv_token_s=rule.kv_share * decode / max(1, kv_pool_tokens),
        prefill_token_s=rule.margin * cal.prefill_token_s,
        train_fixed_s=scale * cal.train_fixed_s,
        train_token_s=scale * cal.train_token_s,
    )
    train = device.train_step_s(cal.train_tokens)
    derivation = {
        "bound": bound,
        "candidates_decode_s": candidates,
        "cpu_demand_cores": demand / decode,
        "sync_rollout_steps": sync_rollout_steps,
        "expected_sync_rollout_s": sync_rollout_steps * decode,
        "train_step_s": train,
        "decode_pace_over_real": decode / cal.decode_step_s,
        "train_pace_over_real": train / cal.train_step_s,
    }
    return device, derivation
