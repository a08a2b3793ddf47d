"""Sharded checkpoints: model and AdamW tensors through torch.distributed.checkpoint (DCP).

Each rank writes its own shards as safetensors (DCP's Hugging Face storage, offsets in
the files' JSON headers), so nothing is pickled and a reader at any world size, one
process included, loads its own slices of every tensor (DCP reshards). Keys are
`model.NAME` and `state.NAME.FIELD` (the names of `checkpoint.optimizer_to_files`);
the JSON-able rest of the optimizer lives in trainer_state.json as for one process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

from dorarl.trainer import checkpoint as ckpt

SHARDS_DIR = "shards"


def save_shards(
    folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, names: dict[int, str]
) -> None:
    """Collective at world size > 1: every rank writes its shards into `folder` (of the
    trained parameters: a frozen LoRA base is read from its own folder)."""
    state = {f"model.{name}": p.detach() for name, p in model.named_parameters() if p.requires_grad}
    tensors, _ = ckpt.optimizer_state_by_name(optimizer, names)
    state.update(tensors)
    folder.mkdir(parents=True, exist_ok=True)
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(folder), save_distributed=True))


def load_shards(
    folder: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    names: dict[int, str],
    meta: dict[str, Any],
) -> None:
    """Weights into the parameters in place, AdamW state into the optimizer; each rank
    reads the slices its (possibly sharded) tensors hold."""
    params = dict(model.named_parameters())
    saved = HuggingFaceStorageReader(str(folder)).read_metadata().state_dict_metadata
    template = {key: _slot(key, info, params) for key, info in saved.items()}
    dcp.load(template, storage_reader=HuggingFaceStorageReader(str(folder)))
    state = {k: v for k, v in template.items() if k.startswith("state.")}
    ckpt.optimizer_from_files(optimizer, names, state, meta)


def _slot(key: str, info: Any, params: dict[str, torch.nn.Parameter]) -> torch.Tensor:
    """Where a saved tensor lands: the parameter itself, or a tensor laid out like it (a
    moment of AdamW), or a plain one (AdamW's step count)."""
    kind, rest = key.split(".", 1)
    if kind == "model":
        return params[rest].detach()
    param = params[rest.rsplit(".", 1)[0]]
    dtype = info.properties.dtype
    if tuple(info.size) == tuple(param.shape):
        return torch.zeros_like(param.detach(), dtype=dtype)
    return torch.zeros(tuple(info.size), dtype=dtype)  # AdamW keeps its step on the CPU


def has_shards(folder: Path) -> bool:
    return (Path(folder) / SHARDS_DIR).is_dir()
