"""LoRA adapters on the frozen base (peft): wrapping, merged weights, adapter folders.

The trainer trains only the adapters' A and B. Engines that hold one version get full
weights, each adapted linear merged as W + B @ A * alpha / rank by `merged_tensors` (what
peft's `merge_and_unload` gives), by the base model's HF names; engines that hold adapters
(engine.max_versions > 1) get the adapters alone, as peft names them (`adapter_tensors`).
A checkpoint of a LoRA trainer is a peft adapter
folder (`PeftModel.from_pretrained(base, folder)` loads it) whose trainer_state.json names
the base model folder (`BASE_KEY`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the driver reads adapter folders without transformers' modeling code
    from transformers import PreTrainedModel

from dorarl.errors import UserInputError
from dorarl.trainer.config import LoraConfig

ADAPTER = "default"  # peft's name of the one adapter a trainer holds
PEFT_PREFIX = "base_model.model."  # a PeftModel's names of the wrapped HF model's tensors
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft's file of an adapter folder's tensors
MERGED_DIR = "merged"  # a LoRA checkpoint's merged HF folder, once a resume needed it
BASE_KEY = "lora_base_path"  # trainer_state.json: the base model folder the adapter is on
# Fresh adapters are drawn from this seed (the global RNG is left as it was): every rank of a
# sharded trainer shards its own copy of A, so all ranks must draw the same one.
INIT_SEED = 0


def peft_config(config: LoraConfig):
    """peft's LoraConfig for trainer.lora.* (no bias trained, causal LM)."""
    from peft import LoraConfig as PeftLoraConfig

    targets = config.target_modules
    return PeftLoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=list(targets) if targets not in ([], ["all-linear"]) else "all-linear",
        bias="none",
        task_type="CAUSAL_LM",
    )


def wrap(model: PreTrainedModel, config: LoraConfig, base_path: str | Path):
    """`model` with fresh adapters (drawn from INIT_SEED) injected in place and every base
    weight frozen; returns the PeftModel around it. `base_path` is recorded in the adapter's
    config."""
    from peft import get_peft_model

    model.name_or_path = str(Path(base_path).resolve())  # adapter_config's base model
    try:
        device = next(model.parameters()).device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(INIT_SEED)
            return get_peft_model(model, peft_config(config))
    except ValueError as exc:
        raise UserInputError(f"trainer.lora.target_modules: {exc}") from None


def load_adapter(model: PreTrainedModel, folder: Path, config: LoraConfig):
    """`model` (the base) with the trainable adapters of checkpoint `folder`; refused when
    the checkpoint's rank or alpha differ from `config`'s."""
    from peft import PeftModel

    check_matches(folder, config)
    return PeftModel.from_pretrained(model, str(folder), is_trainable=True)


def check_matches(folder: Path, config: LoraConfig) -> None:
    saved = json.loads((folder / ADAPTER_CONFIG).read_text())
    wanted = peft_config(config)
    pairs = {"rank": (saved["r"], wanted.r), "alpha": (saved["lora_alpha"], wanted.lora_alpha)}
    for key, (was, now) in pairs.items():
        if was != now:
            raise UserInputError(
                f"trainer.lora.{key}: {now} differs from {was} of the checkpoint {folder}"
            )


def is_adapter_folder(folder: str | Path) -> bool:
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def scale(config: LoraConfig) -> float:
    return config.alpha / config.rank


def merged_tensors(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A LoRA model's state dict (peft's injected names) as the base's HF state dict with
    every adapter merged: `X.base_layer.weight` + `X.lora_B.default.weight` @
    `X.lora_A.default.weight` * scaling becomes `X.weight`. Other tensors keep their
    objects (tied names stay one tensor); merged ones are new tensors. The merge is computed
    in float32."""
    merged: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if ".lora_" in name:
            continue
        if ".base_layer." not in name:
            merged[name] = tensor
            continue
        prefix, leaf = name.split(".base_layer.")
        a = state.get(f"{prefix}.lora_A.{ADAPTER}.weight")
        if leaf != "weight" or a is None:
            merged[f"{prefix}.{leaf}"] = tensor
            continue
        b = state[f"{prefix}.lora_B.{ADAPTER}.weight"]
        full = torch.addmm(tensor.float(), b.float(), a.float(), alpha=scaling)
        merged[f"{prefix}.weight"] = full.to(tensor.dtype)
    return merged


def adapter_tensors(peft_model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters of `state` (the wrapped HF model's state dict, peft's injected names),
    named as peft's `get_peft_model_state_dict` names them (`...q_proj.lora_A.weight`):
    what `Engine.load_adapter` takes. The tensors are `state`'s own."""
    from peft import get_peft_model_state_dict

    prefixed = {PEFT_PREFIX + name: t for name, t in state.items() if ".lora_" in name}
    return get_peft_model_state_dict(peft_model, state_dict=prefixed)


def read_adapter(folder: str | Path) -> dict[str, torch.Tensor]:
    """An adapter folder's tensors by peft's names (safetensors), on the CPU."""
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / ADAPTER_WEIGHTS))


def base_of(folder: Path) -> Path:
    """The base model folder an adapter folder is on (its adapter_config.json says)."""
    base = json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base or not (Path(base) / "config.json").is_file():
        raise UserInputError(
            f"{folder}: the base model folder its adapters are on ({base}) is not a model "
            "folder (give it with --base)"
        )
    return Path(base)


def write_merged(folder: Path, out: Path, base: Path | None = None) -> Path:
    """The HF model folder `out` (existing, empty) of the adapter folder `folder` merged into
    its base (`base`, or the one the adapter config names), with the tokenizer files of the
    adapter folder (else the base's): what peft's merge_and_unload gives, in safetensors."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from dorarl.trainer import checkpoint as ckpt

    base = base or base_of(folder)
    model = AutoModelForCausalLM.from_pretrained(str(base), use_safetensors=True)
    merged = PeftModel.from_pretrained(model, str(folder)).merge_and_unload()
    merged.save_pretrained(str(out), safe_serialization=True)
    tokenizer = ckpt.read_tokenizer_files(folder) or ckpt.read_tokenizer_files(base)
    ckpt.write_tokenizer_files(tokenizer, out)
    return out


def merged_folder(checkpoint: Path) -> Path:
    """`checkpoint/merged`: the LoRA checkpoint merged into its base, written on first use
    (atomically) and reused after; an engine starts from it as from a full-weight one."""
    from dorarl.trainer import checkpoint as ckpt

    out = checkpoint / MERGED_DIR
    if not (out / "config.json").is_file():
        ckpt.write_atomically(out, lambda tmp: write_merged(checkpoint, tmp))
    return out
