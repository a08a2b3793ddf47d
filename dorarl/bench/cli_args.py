"""The command line every `dorarl bench ...` shares: --out, --quick, --config, key=value."""

from __future__ import annotations

import argparse

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
