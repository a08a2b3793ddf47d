"""Checkpoint files without pickle: optimizer and RNG tensors in safetensors, the rest in JSON.

A checkpoint folder is a Hugging Face model folder (config, model.safetensors, generation
config, tokenizer files) plus `optimizer.safetensors`, `rng.safetensors` and
`trainer_state.json`. The optimizer state (twice the weights, in float32) is kept only where
a resume reads it: once a newer checkpoint is complete, the older ones beside it drop theirs
(`drop_older_optimizer_state`; their trainer_state.json then says `"optimizer": null`, and a
resume from one starts a fresh optimizer). Invariants: nothing is ever read with
torch.load/pickle; a folder is written under a temporary name and renamed into place, so a
crash never leaves a half-written checkpoint under the final name, and a crash at any point
of a write leaves the previous complete checkpoint readable (a rewrite's displaced copy,
`NAME.old`, stands for `NAME` until the new one is in place; see `write_atomically`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from dorarl.errors import UserInputError
from dorarl.run_layout import STATE_FILE, unfinished_writes, version_folders

OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


def optimizer_to_files(
    optimizer: torch.optim.Optimizer, names: dict[int, str]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split the optimizer state into named tensors and a JSON-able rest.

    `names` maps id(parameter) to its model name, so the files do not depend on
    parameter order.
    """
    tensors, meta = optimizer_state_by_name(optimizer, names)
    return {k: v.detach().cpu().contiguous() for k, v in tensors.items()}, meta


def optimizer_state_by_name(
    optimizer: torch.optim.Optimizer, names: dict[int, str]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The optimizer's tensors as `state.NAME.FIELD` (as they are: sharded ones stay
    DTensors) and the JSON-able rest (param groups by name, non-tensor state)."""
    sd = optimizer.state_dict()
    index_names = _index_names(optimizer, names)
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, state in sd["state"].items():
        name = index_names[idx]
        for key, value in state.items():
            if torch.is_tensor(value):
                tensors[f"state.{name}.{key}"] = value
            else:
                scalars.setdefault(name, {})[key] = value
    groups = [
        {
            **{k: _jsonable(v) for k, v in g.items() if k != "params"},
            "params": [index_names[i] for i in g["params"]],
        }
        for g in sd["param_groups"]
    ]
    return tensors, {"param_groups": groups, "scalars": scalars}


def optimizer_from_files(
    optimizer: torch.optim.Optimizer,
    names: dict[int, str],
    tensors: dict[str, torch.Tensor],
    meta: dict[str, Any],
) -> None:
    """Load state written by `optimizer_to_files` into an optimizer over the same parameters."""
    index_of = {name: idx for idx, name in _index_names(optimizer, names).items()}
    groups = []
    for group in meta["param_groups"]:
        missing = [n for n in group["params"] if n not in index_of]
        if missing:
            raise UserInputError(f"checkpoint optimizer names unknown parameters: {missing[:3]}")
        groups.append({**group, "params": [index_of[n] for n in group["params"]]})
        if "betas" in group:
            groups[-1]["betas"] = tuple(group["betas"])
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, rest = key.split(".", 1)
        name, field = rest.rsplit(".", 1)
        state.setdefault(index_of[name], {})[field] = value
    for name, fields in meta["scalars"].items():
        state.setdefault(index_of[name], {}).update(fields)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _index_names(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict[int, str]:
    """state_dict index -> parameter name (indices run over the groups' params in order)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return {i: names[id(p)] for i, p in enumerate(params)}


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if torch.is_tensor(value):
        return value.item()
    return value


def capture_rng() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Global RNG states of torch (CPU and CUDA), Python and NumPy."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = state
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    meta = {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }
    return tensors, meta


def restore_rng(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch"])
    cuda = sorted((k for k in tensors if k.startswith("cuda.")), key=lambda k: int(k[5:]))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda])
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def read_tokenizer_files(source: Path) -> dict[str, bytes]:
    """The tokenizer files of the folder `source`, by name, in memory: a trainer reads them
    once at start, because the folder it started from may be pruned before its next write."""
    return {
        name: (source / name).read_bytes() for name in TOKENIZER_FILES if (source / name).is_file()
    }


def write_tokenizer_files(files: dict[str, bytes], dest: Path) -> None:
    for name, content in files.items():
        (dest / name).write_bytes(content)


def write_atomically(folder: Path, write: Callable[[Path], None]) -> Path:
    """Run `write(tmp)` into a fresh sibling folder, then swap it in as `folder`.

    A crash before the swap leaves `folder` (or nothing) as it was, plus a `.tmp` no reader
    counts. Replacing an existing `folder` takes two renames; a crash between them leaves
    only `folder.old`, which readers take for `folder` (`version_folders`) and the next
    write puts back before it starts."""
    folder = Path(folder)
    tmp = prepare_temporary(folder)
    write(tmp)
    return swap_in(folder)


def temporary_of(folder: Path) -> Path:
    return folder.with_name(folder.name + ".tmp")


def prepare_temporary(folder: Path) -> Path:
    """The empty `.tmp` sibling a write goes into (a displaced copy put back first)."""
    tmp, old = temporary_of(folder), folder.with_name(folder.name + ".old")
    if old.exists() and not folder.exists():
        old.rename(folder)  # the last complete copy, displaced by a rewrite that died
    for stale in (tmp, old):
        if stale.exists():
            shutil.rmtree(stale)
    tmp.mkdir(parents=True)
    return tmp


def swap_in(folder: Path) -> Path:
    """Put the finished `.tmp` in place of `folder` (see `write_atomically`)."""
    tmp, old = temporary_of(folder), folder.with_name(folder.name + ".old")
    if folder.exists():
        folder.rename(old)
    tmp.rename(folder)
    if old.exists():
        shutil.rmtree(old)
    return folder


def save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise UserInputError(f"{path}: missing checkpoint file")
    return load_file(str(path))


def read_state(folder: Path) -> dict[str, Any]:
    path = Path(folder) / STATE_FILE
    if not path.is_file():
        raise UserInputError(f"{folder}: not a trainer checkpoint (no {STATE_FILE})")
    return json.loads(path.read_text())


def has_optimizer_state(folder: Path) -> bool:
    """Whether a checkpoint holds its optimizer state (False once a newer one took it)."""
    return read_state(folder).get("optimizer") is not None


def drop_optimizer_state(folder: Path) -> None:
    """Delete a checkpoint's optimizer state, the state file first (atomically, so a crash
    midway leaves a checkpoint that says it has none, never one that lies)."""
    from dorarl.trainer import shards

    state = read_state(folder)
    if state.get("optimizer") is not None:
        state["optimizer"] = None
        tmp = Path(folder) / f"{STATE_FILE}.tmp"
        tmp.write_text(json.dumps(state))
        os.replace(tmp, Path(folder) / STATE_FILE)
    (Path(folder) / OPTIMIZER_FILE).unlink(missing_ok=True)
    shutil.rmtree(Path(folder) / shards.SHARDS_DIR, ignore_errors=True)


def drop_older_optimizer_state(parent: Path) -> list[Path]:
    """Drop the optimizer state of every complete checkpoint under `parent` but the newest."""
    older = [path for path in version_folders(parent)[:-1] if has_optimizer_state(path)]
    for path in older:
        drop_optimizer_state(path)
    return older


@dataclass(frozen=True)
class SavedCheckpoint:
    """A checkpoint written: where, its size on disk, and the seconds its write took."""

    path: str
    bytes: int
    seconds: float

    def line(self) -> str:
        return f"checkpoint: {self.path} ({self.bytes / 1e9:.2f} GB, {self.seconds:.1f}s)"


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in Path(folder).rglob("*") if path.is_file())


def prune(parent: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints under `parent` (keep <= 0: none), and
    the `.tmp` folders of writes that died (the only writer calls this after its own)."""
    for leftover in unfinished_writes(parent):
        shutil.rmtree(leftover)
    if keep <= 0:
        return []
    doomed = version_folders(parent)[:-keep]
    for path in doomed:
        shutil.rmtree(path)
    return doomed
