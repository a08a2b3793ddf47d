"""The header of a GGUF file (metadata scalars and the tensor table), read without its data.

Used to refuse an unsupported architecture or quantization in a fraction of a second,
before transformers parses the whole file (the vocabulary and merges arrays take it tens
of seconds). String arrays are skipped and recorded only by their length.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from dorarl.errors import UserInputError

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_STRING, _ARRAY = 8, 9
# GGUF value type -> struct format of one element.
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]  # torch order (the file stores the fastest-moving dimension first)
    ggml_type: int


@dataclass
class GGUFHeader:
    path: Path
    version: int
    metadata: dict[str, Any] = field(default_factory=dict)
    tensors: list[TensorEntry] = field(default_factory=list)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


class _Cursor:
    """Sequential little-endian reads from a file, with a clear error on truncation."""

    def __init__(self, handle: BinaryIO, path: Path) -> None:
        self.handle, self.path = handle, path

    def read(self, fmt: str) -> tuple[Any, ...]:
        size = struct.calcsize("<" + fmt)
        raw = self.handle.read(size)
        if len(raw) != size:
            raise UserInputError(f"{self.path}: truncated GGUF header")
        return struct.unpack("<" + fmt, raw)

    def string(self) -> str:
        (length,) = self.read("Q")
        raw = self.handle.read(length)
        if len(raw) != length:
            raise UserInputError(f"{self.path}: truncated GGUF header")
        return raw.decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        (length,) = self.read("Q")
        self.handle.seek(length, 1)


def read_header(path: str | Path) -> GGUFHeader:
    """Metadata (string arrays as their length) and the tensor table of a GGUF file."""
    path = Path(path)
    if not path.is_file():
        raise UserInputError(f"{path}: no such file")
    with path.open("rb") as handle:
        cursor = _Cursor(handle, path)
        if handle.read(4) != _MAGIC:
            raise UserInputError(f"{path}: not a GGUF file (no GGUF magic bytes)")
        (version,) = cursor.read("I")
        if version not in _VERSIONS:
            raise UserInputError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        tensor_count, kv_count = cursor.read("QQ")
        header = GGUFHeader(path, version)
        for _ in range(kv_count):
            key = cursor.string()
            (value_type,) = cursor.read("I")
            header.metadata[key] = _read_value(cursor, value_type)
        for _ in range(tensor_count):
            header.tensors.append(_read_tensor_entry(cursor))
    return header


def _read_value(cursor: _Cursor, value_type: int) -> Any:
    if value_type in _SCALARS:
        return cursor.read(_SCALARS[value_type])[0]
    if value_type == _STRING:
        return cursor.string()
    if value_type == _ARRAY:
        element_type, count = cursor.read("IQ")
        if element_type in _SCALARS:
            return list(cursor.read(f"{count}{_SCALARS[element_type]}"))
        if element_type == _STRING:
            for _ in range(count):
                cursor.skip_string()
            return count
    raise UserInputError(f"{cursor.path}: GGUF metadata value of unknown type {value_type}")


def _read_tensor_entry(cursor: _Cursor) -> TensorEntry:
    name = cursor.string()
    (dims,) = cursor.read("I")
    shape = cursor.read(f"{dims}Q")
    ggml_type, _offset = cursor.read("IQ")
    return TensorEntry(name, tuple(reversed(shape)), ggml_type)
