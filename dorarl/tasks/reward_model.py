"""A reward model read from a local Hugging Face folder: a sequence classifier (one label,
its logit the score) or a causal-LM judge (a rubric prompt; the first number it writes).

Weights load from safetensors only (a pickled `.bin` can run code as it loads); a folder
holding only `.bin` files is refused. `check_folder` is what `--print-config` and a run's
start check; `RewardModel.score` is what the reward actor runs on a batch.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dorarl.errors import UserInputError

KINDS = ("auto", "classifier", "judge")
DEFAULT_RUBRIC = (
    "Rate how well the response answers the question, from 0 (wrong) to 1 (right).\n"
    "Question: {prompt}\nResponse: {response}\nScore:"
)
JUDGE_NEW_TOKENS = 8  # the judge writes a number, nothing else is read
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass(frozen=True)
class RewardModelSpec:
    """A run's reward model: its folder, kind, weight in the reward (`mix`; the verifier's
    is 1 - mix), its actor's GPUs, the bound on one batch, the batch's size, the judge's
    rubric and how many times a dead actor is replaced."""

    path: str
    kind: str = "auto"
    mix: float = 1.0
    num_gpus: float = 0.0
    timeout_s: float = 60.0
    max_batch: int = 64
    rubric: str = DEFAULT_RUBRIC
    restarts: int = 3


def check_folder(path: str | Path, kind: str = "auto", key: str = "task.reward_model") -> str:
    """The kind ("classifier" or "judge") of the model in `path`, checked: a folder with a
    config.json naming a sequence classifier of one label or a causal LM, and safetensors
    weights. One line naming `key` otherwise."""
    folder = Path(path)
    if not folder.is_dir():
        raise UserInputError(f"{key}: {folder} is not a folder")
    if not (folder / "config.json").is_file():
        raise UserInputError(f"{key}: {folder} has no config.json")
    config = json.loads((folder / "config.json").read_text())
    found = _kind_of(config.get("architectures") or [], folder, key)
    if kind not in KINDS:
        raise UserInputError(f"task.reward_model_kind: {kind!r} is not one of {', '.join(KINDS)}")
    if kind != "auto" and kind != found:
        raise UserInputError(
            f"task.reward_model_kind: {kind} asked, but {folder} holds a {found} "
            f"({', '.join(config.get('architectures') or [])})"
        )
    labels = len(config.get("id2label") or {"0": ""})
    if found == "classifier" and labels != 1:
        raise UserInputError(
            f"{key}: {folder} is a classifier of {labels} labels; a reward model has one"
        )
    _check_weights(folder, key)
    return found


def _kind_of(architectures: list[str], folder: Path, key: str) -> str:
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        return "classifier"
    if any(a.endswith("ForCausalLM") for a in architectures):
        return "judge"
    named = ", ".join(architectures) or "no architecture"
    raise UserInputError(
        f"{key}: {folder}'s config.json names {named}; expected a *ForSequenceClassification "
        "(a reward model) or a *ForCausalLM (a judge)"
    )


def _check_weights(folder: Path, key: str) -> None:
    if any(folder.glob("*.safetensors")):
        return
    if any(folder.glob("*.bin")):
        raise UserInputError(
            f"{key}: {folder} holds only .bin weights (pickles, not loaded); save them with "
            "save_pretrained(safe_serialization=True)"
        )
    raise UserInputError(f"{key}: {folder} has no .safetensors weights")


def check_rubric(rubric: str, key: str = "task.reward_model_rubric") -> str:
    """`rubric` if it formats with {prompt} and {response} alone; one line naming `key`."""
    try:
        rubric.format(prompt="", response="")
    except (KeyError, IndexError, ValueError) as exc:
        raise UserInputError(
            f"{key}: not a format string of {{prompt}} and {{response}} ({type(exc).__name__}: "
            f"{exc}); write a literal brace as {{{{ or }}}}"
        ) from None
    return rubric


def parse_score(text: str) -> float:
    """The first number a judge wrote (NaN when it wrote none: a reward error)."""
    found = _NUMBER.search(text)
    return float(found.group()) if found else math.nan


class RewardModel:
    """The model of a `RewardModelSpec`, loaded on `device`, scoring (prompt, response)
    text pairs a batch at a time."""

    def __init__(self, spec: RewardModelSpec, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        from dorarl.tasks.model_files import load_tokenizer

        self.spec, self.device = spec, device
        self.kind = check_folder(spec.path, spec.kind)
        self.tokenizer = load_tokenizer(spec.path)[0]
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        loader = (
            AutoModelForSequenceClassification
            if self.kind == "classifier"
            else AutoModelForCausalLM
        )
        self.model = loader.from_pretrained(spec.path, use_safetensors=True).to(device).eval()
        if self.model.config.pad_token_id is None:  # the classifier finds each text's end by it
            self.model.config.pad_token_id = self.tokenizer.pad_token_id

    def score(self, pairs: list[tuple[str, str]]) -> list[float]:
        """Each (prompt, response)'s score: the classifier's logit, or the judge's number."""
        import torch

        with torch.no_grad():
            if self.kind == "classifier":
                return self._classified([p + r for p, r in pairs])
            return self._judged([self.spec.rubric.format(prompt=p, response=r) for p, r in pairs])

    def _encoded(self, texts: list[str], side: str) -> dict[str, Any]:
        self.tokenizer.padding_side = self.tokenizer.truncation_side = side
        limit = getattr(self.model.config, "max_position_embeddings", None)
        batch = self.tokenizer(
            texts, return_tensors="pt", padding=True, truncation=limit is not None,
            max_length=limit, add_special_tokens=True,
        )  # fmt: skip
        return {k: v.to(self.device) for k, v in batch.items() if k != "token_type_ids"}

    def _classified(self, texts: list[str]) -> list[float]:
        # Truncated from the left: a text's end, which the classifier reads, stays.
        logits = self.model(**self._encoded(texts, "left")).logits
        return [float(x) for x in logits[:, 0].float().cpu()]

    def _judged(self, prompts: list[str]) -> list[float]:
        batch = self._encoded(prompts, "left")
        out = self.model.generate(
            **batch, max_new_tokens=JUDGE_NEW_TOKENS, do_sample=False,
            pad_token_id=self.tokenizer.pad_token_id,
        )  # fmt: skip
        new = out[:, batch["input_ids"].shape[1] :]
        texts = self.tokenizer.batch_decode(new, skip_special_tokens=True)
        return [parse_score(text) for text in texts]
