"""Build a config dataclass tree from YAML and `key=value` overrides, validating every key.

Errors are `ConfigError`s whose message names the dotted key (and the file) so the CLI
can print one line and exit 2. Field help comes from `field(metadata={"help": ...})`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A user error in a config file or override; the message names the key."""


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] = ()) -> T:
    """Load `cls` from an optional YAML file, then apply dotted overrides, then validate."""
    raw: dict[str, Any] = {}
    source = "command line" if overrides else "defaults"
    if path is not None:
        source = str(path)
        raw = _read_yaml(Path(path))
    for item in overrides:
        key, value = _parse_override(item)
        _set_dotted(raw, key, value)
    return _build(cls, raw, prefix="", source=source)


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, help) for every leaf field, for `--help`."""
    rows: list[tuple[str, str, str]] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        ftype = hints[f.name]
        if dataclasses.is_dataclass(ftype):
            rows.extend(describe(ftype, prefix=f"{key}."))
            continue
        default = _default_of(f)
        rows.append((key, repr(default), f.metadata.get("help", "")))
    return rows


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return "<required>"


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: invalid YAML ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of keys")
    return data


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key=value")
    key, text = item.split("=", 1)
    try:
        value = yaml.safe_load(text) if text else ""
    except yaml.YAMLError:
        value = text
    return key.strip(), value


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{key}: {part} is not a section")
        node = child
    node[parts[-1]] = value


def _build(cls: type[T], raw: dict[str, Any], prefix: str, source: str) -> T:
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.')}: expected a section, got {raw!r} ({source})")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            raise ConfigError(f"unknown config key {prefix}{key} ({source})")
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        key = f"{prefix}{f.name}"
        ftype = hints[f.name]
        if dataclasses.is_dataclass(ftype):
            kwargs[f.name] = _build(ftype, raw[f.name], f"{key}.", source)
        else:
            kwargs[f.name] = _coerce(ftype, raw[f.name], key, source)
    try:
        config = cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{_prefixed(prefix, str(exc))} ({source})") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{prefix.rstrip('.') or cls.__name__}: {exc} ({source})") from None
    _run_checks(config, prefix, source)
    return config


def _prefixed(prefix: str, message: str) -> str:
    """Qualify a component's `key: reason` with its section, unless it already names it."""
    return message if not prefix or message.startswith(prefix) else f"{prefix}{message}"


def _run_checks(config: Any, prefix: str, source: str) -> None:
    """Call the dataclass's optional `validate()`; it raises ConfigError(key, reason)."""
    validate = getattr(config, "validate", None)
    if validate is None:
        return
    try:
        validate()
    except ConfigError as exc:
        raise ConfigError(f"{_prefixed(prefix, str(exc))} ({source})") from None


def _coerce(ftype: Any, value: Any, key: str, source: str) -> Any:
    origin = get_origin(ftype)
    if origin in (typing.Union, types.UnionType):
        options = get_args(ftype)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(option, value, key, source)
            except ConfigError:
                continue
        raise _type_error(key, ftype, value, source)
    if origin is Literal:
        if value not in get_args(ftype):
            choices = ", ".join(repr(a) for a in get_args(ftype))
            raise ConfigError(f"{key}: must be one of {choices}, got {value!r} ({source})")
        return value
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise _type_error(key, ftype, value, source)
        (item_type, *_) = get_args(ftype) or (Any,)
        items = [_coerce(item_type, v, f"{key}[{i}]", source) for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise _type_error(key, ftype, value, source)
        return dict(value)
    return _coerce_scalar(ftype, value, key, source)


def _coerce_scalar(ftype: Any, value: Any, key: str, source: str) -> Any:
    if ftype is Any:
        return value
    if ftype is bool:
        if isinstance(value, bool):
            return value
        raise _type_error(key, ftype, value, source)
    if ftype is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _type_error(key, ftype, value, source)
    if ftype is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise _type_error(key, ftype, value, source)
    if ftype is str:
        if isinstance(value, str | int | float) and not isinstance(value, bool):
            return str(value)
        raise _type_error(key, ftype, value, source)
    return value


def _type_error(key: str, ftype: Any, value: Any, source: str) -> ConfigError:
    name = getattr(ftype, "__name__", str(ftype))
    return ConfigError(f"{key}: expected {name}, got {value!r} ({source})")
