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
def hf_logprobs(
    model, prompt: list[int], output: list[int], temperature: float = 1.0, top_k: int = 0
) -> list[float]:
    """Each output token's log-prob under HF's logits, scaled by `temperature` and
    renormalised over the top `top_k` (0: all); temperature 0 gives the raw log-softmax."""
    ids = torch.tensor([prompt + output])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    if temperature > 0:
        logits = logits / temperature
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, torch.tensor(output)[:, None])[:, 0].tolist()
