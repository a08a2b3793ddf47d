"""Checks of a converted folder: transformers reloads it as it was converted (tied
embeddings included), and the engine's greedy tokens and logprobs match transformers'.

The engine decodes each chat prompt greedily; transformers then scores the same prompt +
response in one forward. Every engine token must be transformers' argmax on the same
prefix, so by induction transformers' own greedy decoding gives the same response. A
differing token is excused as a near-tie when transformers' top logit beats the engine's
token by less than `tie_gap` (float32 summation order decides such ties); near-ties are
reported. Logprobs must agree within `tolerance`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from dorarl.engine.config import EngineConfig, SamplingParams
from dorarl.engine.engine import Engine
from dorarl.engine.weights import weight_files

CHAT_PROMPTS = (
    "What is 51 + 29? Answer with the number only.",
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "List three colours.",
)


@dataclass
class NearTie:
    prompt: int
    position: int  # output token index
    engine_token: int
    hf_token: int
    gap: float


@dataclass
class PromptResult:
    prompt: str
    response: str
    tokens: int
    mismatches: int  # differing tokens that are not near-ties
    max_logprob_diff: float


@dataclass
class VerifyReport:
    tolerance: float
    tied_ok: bool
    tied_note: str
    reload_max_logit_diff: float | None = None  # vs the model as loaded from the GGUF
    prompts: list[PromptResult] = field(default_factory=list)
    near_ties: list[NearTie] = field(default_factory=list)

    @property
    def tokens_equal(self) -> bool:
        return all(p.mismatches == 0 for p in self.prompts)

    @property
    def max_logprob_diff(self) -> float:
        return max((p.max_logprob_diff for p in self.prompts), default=0.0)

    @property
    def ok(self) -> bool:
        reload_ok = self.reload_max_logit_diff is None or self.reload_max_logit_diff <= 1e-5
        return (
            self.tied_ok
            and reload_ok
            and self.tokens_equal
            and self.max_logprob_diff <= self.tolerance
        )

    def lines(self) -> list[str]:
        total = sum(p.tokens for p in self.prompts)
        out = [f"tied embeddings: {self.tied_note}"]
        if self.reload_max_logit_diff is not None:
            out.append(
                f"reload: from_pretrained(folder) logits vs the GGUF load, max |diff| "
                f"{self.reload_max_logit_diff:.3g}"
            )
        out.append(
            f"engine vs transformers, {len(self.prompts)} chat prompts, {total} greedy tokens: "
            f"tokens {'equal' if self.tokens_equal else 'DIFFER'}, "
            f"{len(self.near_ties)} near-tie(s) excused, max |logprob diff| "
            f"{self.max_logprob_diff:.3g} (tolerance {self.tolerance:g})"
        )
        for tie in self.near_ties:
            out.append(
                f"  near-tie: prompt {tie.prompt} token {tie.position}: engine {tie.engine_token}, "
                f"transformers {tie.hf_token}, logit gap {tie.gap:.2g}"
            )
        for i, p in enumerate(self.prompts):
            flag = "" if p.mismatches == 0 else f" [{p.mismatches} mismatch(es)]"
            out.append(f"  prompt {i}: {p.prompt!r} -> {p.response!r}{flag}")
        out.append("verification: " + ("passed" if self.ok else "FAILED"))
        return out


def verify_folder(
    folder: str | Path,
    reference: PreTrainedModel | None = None,
    prompts: tuple[str, ...] = CHAT_PROMPTS,
    max_new_tokens: int = 32,
    tolerance: float = 1e-4,
    tie_gap: float = 1e-4,
) -> VerifyReport:
    folder = Path(folder)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    tied_ok, tied_note = check_tied(model, folder)
    report = VerifyReport(tolerance, tied_ok, tied_note)
    prompt_ids = [render_chat(tokenizer, text) for text in prompts]
    if reference is not None:
        report.reload_max_logit_diff = max(
            _logits_diff(model, reference, ids) for ids in prompt_ids
        )
    outputs = engine_greedy(folder, prompt_ids, max_new_tokens)
    for index, (text, ids, out) in enumerate(zip(prompts, prompt_ids, outputs, strict=True)):
        result, ties = compare_to_hf(model, ids, out[0], out[1], tie_gap, index)
        result.prompt, result.response = text, tokenizer.decode(out[0])
        report.prompts.append(result)
        report.near_ties.extend(ties)
    return report


def render_chat(tokenizer, text: str) -> list[int]:
    """The prompt as a user turn in the model's chat template (plain text without one)."""
    if tokenizer.chat_template:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer(rendered, add_special_tokens=False)["input_ids"]
    return tokenizer(text)["input_ids"]


def check_tied(model: PreTrainedModel, folder: Path) -> tuple[bool, str]:
    """Tied models: stored once (no lm_head in the files) and tied again after loading."""
    if not model.config.tie_word_embeddings:
        return True, "not tied (separate lm_head)"
    stored = set()
    for path in weight_files(folder):
        with safe_open(str(path), "pt") as handle:
            stored.update(handle.keys())
    shared = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    if "lm_head.weight" in stored or not shared:
        where = "lm_head.weight stored" if "lm_head.weight" in stored else "not shared on load"
        return False, f"BROKEN ({where})"
    return True, "kept (embedding stored once, lm_head shares it after loading)"


@torch.inference_mode()
def _logits_diff(model: PreTrainedModel, reference: PreTrainedModel, ids: list[int]) -> float:
    x = torch.tensor([ids])
    return (model(x).logits - reference(x).logits).abs().max().item()


def engine_greedy(
    folder: Path, prompt_ids: list[list[int]], max_new_tokens: int
) -> list[tuple[list[int], list[float]]]:
    """(output ids, logprobs) per prompt, greedy, stopping at the model's EOS."""
    max_len = max(len(ids) for ids in prompt_ids) + max_new_tokens + 1
    config = EngineConfig(max_num_seqs=len(prompt_ids), max_model_len=max_len)
    engine = Engine.from_pretrained(folder, config)
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    for i, ids in enumerate(prompt_ids):
        engine.add_request(str(i), ids, params)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = (out.output_ids, out.logprobs)
    return [done[str(i)] for i in range(len(prompt_ids))]


@torch.inference_mode()
def compare_to_hf(
    model: PreTrainedModel,
    prompt: list[int],
    output: list[int],
    logprobs: list[float],
    tie_gap: float,
    index: int,
) -> tuple[PromptResult, list[NearTie]]:
    """Score prompt + output in one transformers forward and compare token by token."""
    logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    hf_logprobs = torch.log_softmax(logits, dim=-1)
    ties, mismatches, worst = [], 0, 0.0
    for pos, (token, logprob) in enumerate(zip(output, logprobs, strict=True)):
        best = int(logits[pos].argmax())
        if best != token:
            gap = float(logits[pos, best] - logits[pos, token])
            if gap < tie_gap:
                ties.append(NearTie(index, pos, token, best, gap))
            else:
                mismatches += 1
        worst = max(worst, abs(float(hf_logprobs[pos, token]) - logprob))
    return PromptResult("", "", len(output), mismatches, worst), ties
