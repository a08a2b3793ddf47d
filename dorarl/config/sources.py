"""Where each setting came from: the config file or the command line.

An error names the source of the value it is about, so a typo on the command line is not
blamed on the file. Relative paths resolve by the same rule: a path a file gives resolves
against the file's folder (or the folder the caller names, `paths_from`), a path given on
the command line against the working directory. A field is a path when its metadata says
`"path": True`; one that also says `"or_name": True` stays as given where no such path
exists and the value reads as a data set's name (`looks_like_name`).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

COMMAND_LINE = "command line"
DEFAULTS = "defaults"


@dataclass
class Sources:
    """The source of every key given, by dotted key (a section given whole counts for its
    keys), and where the file's relative paths resolve."""

    file: str | None = None
    paths_from: Path | None = None  # where the file's relative paths resolve
    given: dict[str, str] = field(default_factory=dict)
    lines: dict[str, int] = field(default_factory=dict)  # the file's keys: their lines

    def of(self, key: str) -> str:
        """The source of `key`: the nearest given key at or above it, else of the keys given
        under it, else where the config came from as a whole."""
        parts = key.split(".")
        for end in range(len(parts), 0, -1):
            found = self.given.get(".".join(parts[:end]))
            if found is not None:
                return found
        under = {s for k, s in self.given.items() if k.startswith(f"{key}.")}
        return _joined(under) if under else self.overall()

    def overall(self) -> str:
        return _joined(set(self.given.values())) or (self.file or DEFAULTS)

    def resolve_path(self, key: str, value: str) -> str:
        """`value` as an absolute path: a relative one against the folder of its source."""
        path = Path(value).expanduser()
        if path.is_absolute():
            return str(path)
        root = self.paths_from if self.of(key) != COMMAND_LINE and self.paths_from else Path.cwd()
        return os.path.abspath(root / path)


DATA_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".pq", ".csv", ".txt")


def looks_like_name(value: str) -> bool:
    """Whether `value` reads as a hub name (`name`, `namespace/name`) rather than a path:
    no leading `/`, `.` or `~`, at most one `/`, no data file suffix."""
    parts = value.split("/")
    return (
        1 <= len(parts) <= 2
        and all(parts)
        and value[0] not in "./~"
        and not value.lower().endswith(DATA_FILE_SUFFIXES)
    )


def _joined(sources: set[str]) -> str:
    """The file before the command line: `run.yaml, command line`."""
    return ", ".join(sorted(sources, key=lambda s: (s == COMMAND_LINE, s)))


def record_tree(sources: Sources, tree: dict[str, Any], origin: str, prefix: str = "") -> None:
    """Record `origin` as the source of every key in the nested `tree`."""
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
            record_tree(sources, value, origin, f"{dotted}.")
        else:
            sources.given[dotted] = origin


def dotted_keys(cls: type, prefix: str = "") -> list[str]:
    """Every settable key under `cls`, sections' included, as dotted keys."""
    keys: list[str] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key = f"{prefix}{f.name}"
        keys.append(key)
        if dataclasses.is_dataclass(hints[f.name]):
            keys += dotted_keys(hints[f.name], f"{key}.")
    return keys


def nearest_keys(key: str, known: list[str]) -> list[str]:
    """The keys `key` was likely meant to be, nearest first: a close spelling in its own
    section (`stpes` -> `steps`), of the whole dotted key, then keys in other sections whose
    last part is (nearly) the one typed (`lr` -> `trainer.lr`). A sibling named by the
    initials of the words typed comes first (`trainer.learning_rate` -> `trainer.lr`)."""
    section, _, last = key.rpartition(".")
    prefix = f"{section}." if section else ""
    siblings = [k[len(prefix) :] for k in known if k.startswith(prefix)]
    siblings = [name for name in siblings if "." not in name]
    found = [prefix + name for name in siblings if name == _initials(last)]
    found += [prefix + name for name in difflib.get_close_matches(last, siblings, 3, 0.7)]
    found += difflib.get_close_matches(key, known, 3, 0.75)
    names = {k.rpartition(".")[2] for k in known}
    near = set(difflib.get_close_matches(last, sorted(names), 2, 0.75))
    found += [k for k in known if k.rpartition(".")[2] in near]
    found += [k for k in known if k.rpartition(".")[2] == _initials(last)]
    return [k for k in dict.fromkeys(found) if k != key][:3]


def _initials(name: str) -> str:
    """`learning_rate` -> `lr`; a name of one word has none ("")."""
    words = [w for w in name.split("_") if w]
    return "".join(w[0] for w in words) if len(words) > 1 else ""
