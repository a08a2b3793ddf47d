"""`dorarl model convert FILE.gguf --out DIR`: a user's own GGUF (llama or qwen2 family)
into a Hugging Face folder, checked against transformers."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from dorarl.models.commands import add_output_args, convert_and_check


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="dorarl model convert",
        description="Convert a GGUF file (llama or qwen2 family) into a Hugging Face folder.",
    )
    parser.add_argument("gguf", type=Path, help="the .gguf file")
    add_output_args(parser)
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    return convert_and_check(args.gguf, Path(args.out), not args.no_verify, started)
