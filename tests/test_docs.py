"""The README and docs/ pages: their command lines name only real config keys, and their
relative links point at files (and headings) that exist.

Every `dorarl train`, `dorarl simulate`, `dorarl bench modes` and `dorarl bench
convergence` line is parsed; each key=value key must be a setting of that command's config
(`describe`, what `--help` prints), and the line as a whole must load through the
command's own loader (types, choices, cross-key checks), nothing started. A value that is a
placeholder (`DIR`, `N`, `HOST:6379`) or a run folder to resume is checked by its key only.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dorarl.config import ConfigError, describe, load_config
from dorarl.report.results import anchor

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

COMMAND = re.compile(r"dorarl (train|simulate|bench modes|bench convergence)\b([^`|#\n]*)")
OPTIONS_WITH_VALUE = {"--config", "--out", "--preset", "--modes", "--bench", "--print-placement"}
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*(:\d+)?")
"""A value that stands for the reader's own (DIR, N, RUN_DIR, HOST:6379)."""
UNSHIPPED_KEYS = {"resume"}
"""Keys whose value names a folder of the reader's (a run to resume), never shipped."""
STAND_INS = {"trainer.teacher": "assets"}
"""Keys whose placeholder is given a shipped folder, so the loader's checks that pair the key
with others (trainer.teacher with loss.distill_coef) run as for a literal value."""
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


@dataclass
class CommandLine:
    page: str
    number: int
    command: str
    overrides: list[str] = field(default_factory=list)
    keys_only: list[str] = field(default_factory=list)
    config: str | None = None
    preset: str | None = None

    def __str__(self) -> str:
        return f"{self.page}:{self.number}: dorarl {self.command}"


def _joined_lines(text: str) -> list[tuple[int, str]]:
    """Lines with shell continuations (`\\` at the end) joined, each with its first number."""
    out: list[tuple[int, str]] = []
    pending, start = "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = ""
    return out


def command_lines(page: Path) -> list[CommandLine]:
    """Every command line of `page` that passes keys, a config file or a preset."""
    found = []
    for number, line in _joined_lines(page.read_text()):
        for match in COMMAND.finditer(line):
            parsed = _parse(page.relative_to(ROOT).as_posix(), number, *match.groups())
            if parsed.overrides or parsed.keys_only or parsed.config or parsed.preset:
                found.append(parsed)
    return found


def _parse(page: str, number: int, command: str, rest: str) -> CommandLine:
    parsed = CommandLine(page, number, command)
    tokens = iter(shlex.split(rest))
    for token in tokens:
        if "[" in token or "]" in token or "..." in token:
            continue  # usage syntax: [--out DIR], [key=value ...]
        if token in OPTIONS_WITH_VALUE:
            value = next(tokens, "")
            if token == "--config" and not PLACEHOLDER.fullmatch(Path(value).stem):
                parsed.config = value
            if token == "--preset" and not PLACEHOLDER.fullmatch(value):
                parsed.preset = value
        elif "=" in token and not token.startswith("-"):
            key, value = token.split("=", 1)
            placeholder = PLACEHOLDER.fullmatch(value) or key in UNSHIPPED_KEYS
            if placeholder and key in STAND_INS:
                token, placeholder = f"{key}={ROOT / STAND_INS[key]}", False
            (parsed.keys_only if placeholder else parsed.overrides).append(token)
    return parsed


def _config_class(command: str) -> type:
    if command == "train":
        from dorarl.jobs.config import TrainConfig

        return TrainConfig
    if command == "simulate":
        from dorarl.simulate.config import SimulateConfig

        return SimulateConfig
    if command == "bench modes":
        from dorarl.bench.modes import ModesConfig

        return ModesConfig
    from dorarl.bench.convergence import ConvergenceConfig

    return ConvergenceConfig


def _loader(line: CommandLine) -> Callable[[], object]:
    """The command's own config loading, on the line's file, preset and literal keys."""
    config = str(ROOT / line.config) if line.config else None
    if line.command == "simulate":
        from dorarl.simulate.cli import build_config

        return lambda: build_config(line.preset, config, line.overrides)
    return lambda: load_config(_config_class(line.command), config, line.overrides)


def problems_of(line: CommandLine) -> list[str]:
    """What is wrong with one command line: unknown keys, then what the loader refuses."""
    rows = describe(_config_class(line.command))
    settings = {key for key, _, _ in rows}
    mappings = {key for key, default, _ in rows if default.startswith("{")}  # key.entry=...

    def known(key: str) -> bool:
        return key in settings or key.rpartition(".")[0] in mappings

    problems = [
        f"{line}: unknown key {item.split('=', 1)[0]!r}"
        for item in line.overrides + line.keys_only
        if not known(item.split("=", 1)[0])
    ]
    if problems:
        return problems
    try:
        _loader(line)()
    except (ConfigError, KeyError) as exc:
        problems.append(f"{line}: {exc}")
    return problems


ALL_LINES = [line for page in PAGES for line in command_lines(page)]


def test_the_pages_have_command_lines_to_check():
    commands = {line.command for line in ALL_LINES}
    assert {"train", "simulate", "bench modes"} <= commands
    assert len(ALL_LINES) > 20


@pytest.mark.parametrize("line", ALL_LINES, ids=str)
def test_command_line_names_real_keys_and_loads(line):
    assert problems_of(line) == []


def test_a_wrong_key_or_value_is_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "    dorarl train trainer.world_sise=2\n"
        "Run `dorarl simulate --preset local controller.rollout.filter_group=true`.\n"
        "    dorarl train mode=dora K=1 resume=RUN_DIR trainer.packing=packed\n"
        "    dorarl bench modes --out DIR workload.multiturn=true\n"
    )
    lines = [_parse("page.md", n, *m.groups()) for n, text in _joined_lines(page.read_text())
             for m in COMMAND.finditer(text)]  # fmt: skip
    found = [problems_of(line) for line in lines]
    assert "unknown key 'trainer.world_sise'" in found[0][0]
    assert "unknown key 'controller.rollout.filter_group'" in found[1][0]
    assert "trainer.packing: must be one of" in found[2][0]
    assert "unknown key 'workload.multiturn'" in found[3][0]


def _headings(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    return {anchor(m.group(1).strip()) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


def broken_links(page: Path) -> list[str]:
    """Relative links of `page` whose file, or heading in a page, does not exist."""
    broken = []
    for match in LINK.finditer(page.read_text()):
        target = match.group(1)
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{page.name}: {target} (no such file)")
        elif fragment and file.suffix == ".md" and fragment not in _headings(file):
            broken.append(f"{page.name}: {target} (no such heading)")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_point_at_files_and_headings(page):
    assert broken_links(page) == []


def test_a_broken_link_is_caught(tmp_path):
    (tmp_path / "there.md").write_text("# There\n\n## A section: `key.name`\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md) [ok](there.md#a-section-keyname) [web](https://example.org)\n"
        "[gone](missing.md) ![img](figures/none.png) [bad](there.md#no-section)\n"
    )
    assert broken_links(page) == [
        "page.md: missing.md (no such file)",
        "page.md: figures/none.png (no such file)",
        "page.md: there.md#no-section (no such heading)",
    ]


def test_every_page_under_docs_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    linked = {m.group(1).partition("#")[0] for m in LINK.finditer(readme)}
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert pages - linked == set()
