"""Helpers for the vLLM backend tests: references from Hugging Face transformers on the
same tokens (greedy `generate`, and log-probs of given tokens under our sampling).
Importing it skips the importing module where vllm is not installed (conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm.v1.engine.llm_engine")
BASE_MODEL = Path(__file__).resolve().parents[3] / "assets" / "base_model"


def start_engine(folder: Path, **config):
    """A VllmEngine (eager, float32, blocks of 32 tokens) on `folder`."""
    from dorarl.engine.config import EngineConfig
    from dorarl.engine.vllm.config import VllmArgs
    from dorarl.engine.vllm.engine import VllmEngine

    cfg = EngineConfig(**{"max_model_len": 256, "max_num_seqs": 32, **config})
    return VllmEngine.from_pretrained(folder, cfg, args=VllmArgs(enforce_eager=True, block_size=32))


def run_all(engine, max_steps: int = 10_000) -> dict:
    """Step until nothing is runnable; the finished outputs by request id."""
    done = {}
    for _ in range(max_steps):
        if not engine.has_runnable():
            return done
        done.update({out.request_id: out for out in engine.step()})
    raise AssertionError("requests still running after max_steps")


def hf_model(folder: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    return model.eval()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos: int) -> list[int]:
    """HF generate's greedy tokens, the EOS that ends them included (as the engines give)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
        pad_token_id=eos, attention_mask=torch.ones_like(ids),
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def hf_greedy_batch(
    model, prompts: list[list[int]], max_new_tokens: int, eos: int
) -> list[list[int]]:
    """`hf_greedy` of each prompt from one HF generate over all of them, left-padded with an
    attention mask. On the SmolLM2 and tiny-base prompts of tests/engine/vllm every output
    equals its one-prompt generate (padding moves the logits by float rounding only); a
    prompt set where it did not would need one generate per prompt length instead."""
    width = max(map(len, prompts))
    ids = torch.tensor([[eos] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(
        ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
        pad_token_id=eos, attention_mask=mask,
    )  # fmt: skip
    # a row that ended early is padded with EOS while the others go on
    return [row[: row.index(eos) + 1] if eos in row else row for row in out[:, width:].tolist()]


@torch.no_grad()
def hf_logprobs(
    model, prompt: list[int], output: list[int], temperature: float = 1.0, top_k: int = 0
) -> list[float]:
    """Each output token's log-prob under HF's logits, scaled by `temperature` and
    renormalised over the top `top_k` (0: all); temperature 0 gives the raw log-softmax."""
    return hf_logprobs_batch(model, [prompt], [output], temperature, top_k)[0]


@torch.no_grad()
def hf_logprobs_batch(
    model,
    prompts: list[list[int]],
    outputs: list[list[int]],
    temperature: float = 1.0,
    top_k: int = 0,
) -> list[list[float]]:
    """`hf_logprobs` of each (prompt, output) from one forward: rows right-padded, so the
    causal mask keeps the padding out of every real position."""
    width = max(len(p) + len(o) for p, o in zip(prompts, outputs, strict=True))
    ids = torch.tensor(
        [p + o + [0] * (width - len(p) - len(o)) for p, o in zip(prompts, outputs, strict=True)]
    )
    logits = model(ids).logits.float()
    return [
        _processed_logprobs(logits[r, len(p) - 1 : len(p) + len(o) - 1], o, temperature, top_k)
        for r, (p, o) in enumerate(zip(prompts, outputs, strict=True))
    ]


def _processed_logprobs(
    logits: torch.Tensor, output: list[int], temperature: float, top_k: int
) -> list[float]:
    if temperature > 0:
        logits = logits / temperature
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, torch.tensor(output)[:, None])[:, 0].tolist()
