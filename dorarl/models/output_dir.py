"""The --out folder of `dorarl model`: new or empty, and filled all at once.

Files are written into a hidden sibling folder that is renamed onto --out at the end, so
an interrupted run leaves --out as it was rather than half a model.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from dorarl.errors import UserInputError


def check_out_dir(out: str | Path) -> Path:
    """--out as a Path; refused (one line) if it is a file or a non-empty folder."""
    path = Path(out).expanduser().resolve()
    if path.exists() and not path.is_dir():
        raise UserInputError(f"--out {out}: exists and is not a folder")
    if path.is_dir() and any(path.iterdir()):
        raise UserInputError(f"--out {out}: folder is not empty (give a new or empty folder)")
    return path


@contextlib.contextmanager
def staged_out_dir(out: Path) -> Iterator[Path]:
    """A staging folder next to `out`, renamed onto `out` if the block succeeds."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        yield staging
        check_out_dir(out)  # still new or empty after the (long) conversion
        if out.is_dir():
            out.rmdir()
        # mkdtemp (and safetensors) made them private; the folder is an ordinary output.
        os.chmod(staging, 0o777 & ~_umask())
        for path in staging.iterdir():
            os.chmod(path, 0o666 & ~_umask())
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
