"""Rows of a Hugging Face data set held on this machine: a `save_to_disk` folder, a folder of
data files, or a name in the `datasets` cache (HF_DATASETS_CACHE), read with no hub call.

Invariant: a name is looked up in the cache folder before `datasets` is called, and the call
runs offline, so a name this machine does not hold is one line naming the key and the folder
looked in, with no network wait. A data set of several splits needs the split key.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dorarl.config.sources import looks_like_name
from dorarl.errors import UserInputError

_SAVED_MARKERS = ("dataset_dict.json", "state.json")
_INSTALL = "install it with: pip install 'dorarl[data]'"


@dataclass(frozen=True)
class DataSource:
    """Where a data key's rows come from: `key` names it in messages (task.path)."""

    value: str
    key: str = "task.path"
    split: str | None = None
    split_key: str = "task.split"


def missing_problem(source: DataSource) -> str | None:
    """The one line saying `source` is held nowhere here, or None when it is found."""
    path = Path(source.value)
    if path.is_file() or path.is_dir():
        return None
    if not looks_like_name(source.value):
        return f"{source.key}: no such data file {source.value}"
    if _cached_entry(source.value) is not None:
        return None
    looked = _cache_root() / _cache_folder_name(source.value)
    return (
        f"{source.key}: no such data file {source.value}, nor a data set folder or a data set "
        f"in the datasets cache (looked in {looked}); data sets are read from this machine, "
        "not a hub: give a file or a save_to_disk folder"
    )


def read_data_set(source: DataSource) -> Iterator[tuple[str, Any]]:
    """(place, row) for each row of the split, the place `NAME[split] row N` from 1."""
    problem = missing_problem(source)
    if problem is not None:
        raise UserInputError(problem)
    loaded = _load(source)
    split, rows = _one_split(loaded, source)
    where = f"{source.value}[{split}]" if split else source.value
    return ((f"{where} row {n}", row) for n, row in enumerate(rows, start=1))


def _load(source: DataSource) -> Any:
    datasets = _datasets(source.key)
    path = Path(source.value)
    with _offline(datasets):
        try:
            if path.is_dir() and any((path / m).is_file() for m in _SAVED_MARKERS):
                return datasets.load_from_disk(str(path))
            return datasets.load_dataset(source.value, cache_dir=str(_cache_root()))
        except Exception as exc:  # datasets raises its own kinds (DatasetNotFoundError, ...)
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise UserInputError(f"{source.key}: cannot read {source.value} ({first})") from None


def _one_split(loaded: Any, source: DataSource) -> tuple[str | None, Any]:
    """The split the key names: a data set of one split needs none."""
    if not hasattr(loaded, "keys"):  # a Dataset: one split, saved as it is
        if source.split is not None:
            raise UserInputError(f"{source.split_key}: {source.value} holds a single split")
        return None, loaded
    names = list(loaded.keys())
    if source.split is None and len(names) == 1:
        return names[0], loaded[names[0]]
    if source.split in names:
        return source.split, loaded[source.split]
    given = f"has no split {source.split}" if source.split else "has several splits"
    raise UserInputError(
        f"{source.split_key}: {source.value} {given}; choose one of {', '.join(names)} "
        f"with {source.split_key}=NAME"
    )


@contextlib.contextmanager
def _offline(datasets: Any) -> Iterator[None]:
    """`datasets` with its hub calls off (it reads the flag at each call)."""
    before = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = before


def _datasets(key: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise UserInputError(f"{key}: reading a data set needs datasets; {_INSTALL}") from None
    return datasets


def _cached_entry(name: str) -> Path | None:
    """A prepared split folder of `name` in the cache (config/version/hash), or None."""
    root = _cache_root() / _cache_folder_name(name)
    found = [p for p in root.glob("*/*/*") if p.is_dir()] if root.is_dir() else []
    return found[0] if found else None


def _cache_root() -> Path:
    """The datasets cache as the datasets library finds it."""
    if os.environ.get("HF_DATASETS_CACHE"):
        return Path(os.environ["HF_DATASETS_CACHE"]).expanduser()
    hf_home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface"
    )
    return Path(hf_home).expanduser() / "datasets"


def _cache_folder_name(name: str) -> str:
    """`namespace___name` as datasets writes it (the name in snake case)."""
    parts = name.strip("/").split("/")
    parts[-1] = _snake_case(parts[-1])
    return "___".join(parts)


def _snake_case(name: str) -> str:
    """datasets.naming.camelcase_to_snakecase, without importing datasets for a check."""
    name = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)
    return re.sub(r"([a-z\d])([A-Z])", r"\1_\2", name).lower()
