"""Typed configuration: dataclasses loaded from YAML plus dotted `key=value` overrides."""

from dorarl.config.loader import ConfigError, describe, load_config, to_dict

__all__ = ["ConfigError", "describe", "load_config", "to_dict"]
