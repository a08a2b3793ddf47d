"""Hugging Face peers shared by the engine benches: a workload of prompts and forced
lengths, and transformers' own continuous batching run over it."""

from __future__ import annotations

import inspect
import logging
import math
import random
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any, Protocol

import torch
from transformers import GenerationConfig, PreTrainedModel

from dorarl.bench.clock import timed


class PeerSpec(Protocol):
    """What the peers read of a bench's spec (`engine.BenchSpec`, `engine_device.DeviceSpec`)."""

    max_batch: int
    prompt_len: int
    block_size: int
    prefill_chunk: int


@dataclass
class Workload:
    prompts: list[list[int]]
    lengths: list[int]

    @property
    def total_tokens(self) -> int:
        return sum(self.lengths)


def long_tail_workload(
    num_requests: int, median_len: float, sigma: float, prompt_len: int, vocab: int, seed: int
) -> Workload:
    """Stratified lognormal lengths (exact quantiles, shuffled), so the tail is always there,
    and random prompts."""
    n, dist = num_requests, NormalDist()
    mu = math.log(median_len)
    lengths = [max(1, round(math.exp(mu + sigma * dist.inv_cdf((i + 0.5) / n)))) for i in range(n)]
    rng = random.Random(seed)
    rng.shuffle(lengths)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(n)]
    return Workload(prompts, lengths)


def run_hf_continuous(model: PreTrainedModel, spec: PeerSpec, work: Workload) -> dict[str, Any]:
    """transformers' continuous batching manager with per-request forced lengths."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    # Its CPU path logs an ERROR when psutil is missing; the figures do not depend on psutil.
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)

    gen = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=-1)
    pages = math.ceil((spec.prompt_len + max(work.lengths) + 1) / spec.block_size)
    cb = continuous_batching_config(
        ContinuousBatchingConfig,
        max_requests_per_batch=spec.max_batch,
        page_size=spec.block_size,
        num_blocks=spec.max_batch * pages,
        max_batch_tokens=spec.prefill_chunk + spec.max_batch,
    )
    with torch.inference_mode():
        manager = model.init_continuous_batching(
            generation_config=gen, continuous_batching_config=cb
        )
        manager.start()
        try:
            tokens, took = timed(lambda: _drain_hf_manager(manager, work))
        finally:
            manager.stop(block=True)
    if tokens != work.total_tokens:
        raise RuntimeError(f"hf_continuous produced {tokens} tokens, expected {work.total_tokens}")
    return {"wall_s": took.wall_s, "cpu_s": took.cpu_s, "tokens": tokens}


def continuous_batching_config(cls: Any, page_size: int, **settings: Any) -> Any:
    """Build transformers' ContinuousBatchingConfig across versions: the KV page size is
    `page_size` in recent releases and is not a parameter at all in 5.17 (then its default)."""
    accepted = inspect.signature(cls).parameters
    for name in ("page_size", "block_size"):
        if name in accepted:
            settings[name] = page_size
            break
    return cls(**{k: v for k, v in settings.items() if k in accepted})


def _drain_hf_manager(manager: Any, work: Workload) -> int:
    for i, (prompt, n) in enumerate(zip(work.prompts, work.lengths, strict=True)):
        manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n)
    done: dict[str, int] = {}
    while len(done) < len(work.prompts):
        result = manager.get_result(timeout=5)
        if result is None and not manager.is_running():
            raise RuntimeError("the continuous batching thread stopped")
        if result is not None and result.is_finished():
            if result.error:
                raise RuntimeError(f"request {result.request_id} failed: {result.error}")
            done[result.request_id] = len(result.generated_tokens)
    return sum(done.values())
