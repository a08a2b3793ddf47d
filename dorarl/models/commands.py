"""Shared body of `dorarl model get` and `dorarl model convert`: convert, print, verify."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from dorarl.models.convert import convert_gguf
from dorarl.models.summary import summary_lines
from dorarl.models.verify import verify_folder


def add_output_args(parser: argparse.ArgumentParser) -> None:
    """--out and --no-verify, as both commands take them."""
    parser.add_argument("--out", required=True, help="new or empty folder to write")
    parser.add_argument(
        "--no-verify", action="store_true", help="skip the engine-vs-transformers check"
    )


def convert_and_check(
    gguf_path: Path, out: Path, verify: bool, started: float, source: str | None = None
) -> int:
    """0 when converted (and verified, if asked); 1 when the verification failed."""
    converted = convert_gguf(gguf_path, out)
    print("\n".join(summary_lines(converted, source)), flush=True)
    ok = True
    if verify:
        report = verify_folder(converted.folder, reference=converted.model)
        print("\n".join(report.lines()))
        ok = report.ok
        if not ok:
            print(f"the folder is kept at {converted.folder} for inspection")
    print(f"done in {time.perf_counter() - started:.0f} s")
    return 0 if ok else 1
