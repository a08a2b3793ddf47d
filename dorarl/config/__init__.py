"""Typed configuration: dataclasses loaded from YAML plus dotted `key=value` overrides."""

from dorarl.config.loader import ConfigError, describe, flatten, load_config, to_dict, to_yaml

__all__ = ["ConfigError", "describe", "flatten", "load_config", "to_dict", "to_yaml"]
