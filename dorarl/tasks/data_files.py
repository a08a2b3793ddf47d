"""Rows of a data file, JSON lines or Parquet (by suffix), each with where it came from.

Invariant: every row comes with a place that names the file and the row (`file:line` for
JSON lines, `file row N` for Parquet, N counted from 1), and a file that cannot be read
raises `UserInputError` naming it. Blank JSON lines are skipped. Parquet needs pyarrow
(`pip install 'dorarl[data]'`); a missing pyarrow is one line that says so.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dorarl.errors import UserInputError

PARQUET_SUFFIXES = (".parquet", ".pq")
_PARQUET_BATCH_ROWS = 1024


def read_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(place, row) for each row; a JSON line that does not parse raises at its place."""
    if not path.is_file():
        raise UserInputError(f"{path}: no such data file")
    if path.suffix.lower() in PARQUET_SUFFIXES:
        return _parquet_rows(path)
    return _jsonl_rows(path)


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open(encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            if line.strip():
                where = f"{path}:{lineno}"
                yield where, _json_row(line, where)


def _json_row(line: str, where: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise UserInputError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    parquet = _pyarrow_parquet(path)
    try:
        table = parquet.ParquetFile(str(path))
    except Exception as exc:  # pyarrow raises its own ArrowInvalid, OSError, ...
        raise UserInputError(f"{path}: not a readable Parquet file ({exc})") from None
    number = 0
    for batch in table.iter_batches(batch_size=_PARQUET_BATCH_ROWS):
        for row in batch.to_pylist():
            number += 1
            yield f"{path} row {number}", row


def _pyarrow_parquet(path: Path) -> Any:
    try:
        import pyarrow.parquet
    except ImportError:
        raise UserInputError(
            f"{path}: reading Parquet needs pyarrow; install it with: pip install 'dorarl[data]'"
        ) from None
    return pyarrow.parquet
