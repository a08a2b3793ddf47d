"""Typed configuration: dataclasses loaded from YAML plus dotted `key=value` overrides."""

from dorarl.config.errors import ConfigError
from dorarl.config.fields import check_fields
from dorarl.config.loader import describe, flatten, load_config, to_dict, to_yaml
from dorarl.config.problems import ManyProblems, Problems

__all__ = [
    "ConfigError",
    "ManyProblems",
    "Problems",
    "check_fields",
    "describe",
    "flatten",
    "load_config",
    "to_dict",
    "to_yaml",
]
