"""`dorarl model merge CHECKPOINT --out DIR`: a LoRA checkpoint (a peft adapter folder) merged
into its base model, as a Hugging Face folder any loader or engine reads."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from dorarl.errors import UserInputError
from dorarl.models.output_dir import check_out_dir, staged_out_dir
from dorarl.trainer.lora import is_adapter_folder, write_merged


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="dorarl model merge",
        description="Merge a LoRA checkpoint's adapters into its base model (a HF folder).",
    )
    parser.add_argument("checkpoint", type=Path, help="a LoRA run's checkpoint folder")
    parser.add_argument("--out", required=True, help="new or empty folder to write")
    parser.add_argument(
        "--base",
        type=Path,
        default=None,
        help="the base model folder (default: the one the checkpoint's adapter_config.json names)",
    )
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    if not is_adapter_folder(args.checkpoint):
        raise UserInputError(
            f"{args.checkpoint}: not a LoRA checkpoint (no adapter_config.json); a full-weight "
            "checkpoint is a model folder already"
        )
    out = check_out_dir(args.out)
    with staged_out_dir(out) as staging:
        write_merged(args.checkpoint, staging, args.base)
    print(f"merged {args.checkpoint} into {out} in {time.perf_counter() - started:.1f} s")
    return 0
