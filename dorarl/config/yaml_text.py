"""YAML as the config reads it, in a file or a `key=value` override: booleans are only
true/false (YAML 1.2), and a file's keys keep the line they are on.

YAML 1.1 reads `yes`, `no`, `on` and `off` as booleans, so `filter_groups: yes` would pass
as true and `system_prompt: no` as false; here they stay words, which a bool key refuses
("write true or false") and a word key (`checkpoint_every: off`) takes as written.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

BOOL_TAG = "tag:yaml.org,2002:bool"
YAML_BOOL_WORDS = ("yes", "no", "on", "off", "y", "n")
"""Words YAML 1.1 (or habit) reads as a boolean; a bool key refuses them."""


class ConfigYamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader with only true/false (any case) resolved as booleans."""


ConfigYamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
ConfigYamlLoader.add_implicit_resolver(
    BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def load_yaml(text: str) -> Any:
    """`text` as data, its booleans only true/false."""
    return yaml.load(text, Loader=ConfigYamlLoader)  # noqa: S506 - a safe loader's subclass


def key_lines(text: str) -> dict[str, int]:
    """{dotted key: its line (from 1)} of every key of the mappings in `text`, nested ones
    as `section.key`; {} for text that is not a mapping."""
    lines: dict[str, int] = {}
    root = yaml.compose(text, Loader=ConfigYamlLoader)
    if isinstance(root, yaml.MappingNode):
        _walk(root, "", lines)
    return lines


def _walk(node: yaml.MappingNode, prefix: str, lines: dict[str, int]) -> None:
    for key, value in node.value:
        if not isinstance(key, yaml.ScalarNode):
            continue
        dotted = f"{prefix}{key.value}"
        lines[dotted] = key.start_mark.line + 1
        if isinstance(value, yaml.MappingNode):
            _walk(value, f"{dotted}.", lines)
