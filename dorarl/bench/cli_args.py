"""The command lines the benches share: `--out` (and `--quick`, `--config`, key=value for the
benches with a config), `--threads` for the engine benches, and the JSON each writes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from dorarl.config import describe


def parse_bench_args(
    argv: list[str], prog: str, doc: str, config_cls: type, quick: list[str]
) -> argparse.Namespace:
    """Parse argv; `--help` lists the config's dotted keys with defaults and help."""
    keys = "\n".join(f"  {k:<36} {d:>14}  {h}" for k, d, h in describe(config_cls))
    parser = argparse.ArgumentParser(
        prog=prog,
        description=doc.split("\n\n")[0],
        epilog=f"keys (key=value):\n{keys}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--quick", action="store_true", help=f"short run: {' '.join(quick)}")
    parser.add_argument("--config", help="YAML file with the keys below")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    return parser.parse_args(argv)


def engine_bench_parser(prog: str, doc: str, writes: str) -> argparse.ArgumentParser:
    """`--out` and `--threads`, which every engine bench takes; the description is `doc`'s
    first paragraph."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help=f"folder for {writes}")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads for every contender"
    )
    return parser


def write_json(folder: Path, name: str, report: dict[str, Any]) -> Path:
    """`report` as folder/name (the folder made if missing)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(json.dumps(report, indent=2))
    return path
