"""Build a config dataclass tree from YAML and `key=value` overrides, validating every key.

Errors are `ConfigError`s whose message names the dotted key and where its value came from
(the file, or the command line: `dorarl.config.sources`) so the CLI can print one line and
exit 2; every problem found is reported, one line each (`ManyProblems`): the unknown keys,
the values of the wrong type or out of bounds, and the checks between keys of each section
whose values are all good. An unknown key comes with the keys it was likely meant to be and,
from a file, its line. Booleans are true/false only (`dorarl.config.yaml_text`). Field help comes from
`field(metadata={"help": ...})`, and each value read is checked against its field's bounds
(`metadata` ge, gt, le, lt: `dorarl.config.fields`) before its section is built.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

import yaml

from dorarl.config.errors import ConfigError
from dorarl.config.fields import bound_problem, choice_problem
from dorarl.config.problems import ManyProblems, Problems
from dorarl.config.sources import (
    COMMAND_LINE,
    Sources,
    dotted_keys,
    looks_like_name,
    nearest_keys,
    record_tree,
)
from dorarl.config.yaml_text import YAML_BOOL_WORDS, key_lines, load_yaml

T = TypeVar("T")


def load_config(
    cls: type[T],
    path: str | Path | None = None,
    overrides: list[str] = (),
    *,
    paths_from: str | Path | None = None,
) -> T:
    """Load `cls` from an optional YAML file, then apply dotted overrides, then validate.

    A section given only in part keeps the defaults of the keys it does not name: each
    section is built over its default instance (its `default_factory`), never from the class
    defaults, so a default lives in one place whatever else is overridden. A path field's
    relative value resolves against the file's folder (`paths_from` when given) if the file
    gives it, against the working directory if an override does (`dorarl.config.sources`);
    the config holds it absolute.
    """
    raw: dict[str, Any] = {}
    sources = Sources()
    if path is not None:
        raw, sources.lines = _read_yaml(Path(path))
        sources.file = str(path)
        sources.paths_from = Path(paths_from) if paths_from else Path(path).resolve().parent
        record_tree(sources, raw, str(path))
    problems = Problems()
    for item in overrides:
        problems.check(_apply_override, raw, sources, item)
    given = _pop_derived(cls, raw)
    context = _Context(sources, dotted_keys(cls), problems)
    config = _build(cls, raw, prefix="", sources=context)
    if config is not None:
        problems.check(_refuse_differing, config, given, sources)
    problems.raise_any()
    return config


def _apply_override(raw: dict[str, Any], sources: Sources, item: str) -> None:
    key, value = _parse_override(item)
    _set_dotted(raw, key, value)
    for given in [k for k in sources.given if k == key or k.startswith(f"{key}.")]:
        del sources.given[given]  # a section set whole replaces what the file gave in it
    sources.given[key] = COMMAND_LINE


@dataclass(frozen=True)
class _Context:
    """What `_build` consults beside the values: their sources, every key (a typo's
    nearest keys are suggested from them), and the problems found so far."""

    sources: Sources
    keys: list[str]
    problems: Problems

    def of(self, key: str) -> str:
        return self.sources.of(key)


def derived_keys(cls: type) -> dict[str, str]:
    """Keys whose value a config derives from another key (`DERIVED_KEYS` on the root class:
    dotted key -> the key it comes from); they are not settings and are never shown as such."""
    return dict(getattr(cls, "DERIVED_KEYS", {}))


def _pop_derived(cls: type, raw: dict[str, Any]) -> dict[str, Any]:
    """Take the derived keys out of `raw` (a run folder's config.json may hold them)."""
    given: dict[str, Any] = {}
    for key in derived_keys(cls):
        *sections, name = key.split(".")
        node: Any = raw
        for part in sections:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and name in node:
            given[key] = node.pop(name)
    return given


def _refuse_differing(config: Any, given: dict[str, Any], sources: Sources) -> None:
    """A derived key may be written out as it is derived (old run folders do), never set."""
    for key, value in given.items():
        derived: Any = config
        for part in key.split("."):
            derived = getattr(derived, part)
        if value != derived:
            origin = derived_keys(type(config))[key]
            raise ConfigError(f"{key}: follows {origin}; set {origin} instead ({sources.of(key)})")


def to_dict(config: Any) -> dict[str, Any]:
    """The settings of `config` as nested plain data, derived keys left out (so the result
    loads back as a config file)."""
    tree = dataclasses.asdict(config)
    for key in derived_keys(type(config)):
        *sections, name = key.split(".")
        node = tree
        for part in sections:
            node = node[part]
        node.pop(name, None)
    return tree


def to_yaml(config: Any, notes: dict[str, str] | None = None) -> str:
    """The settings of `config` as YAML that `load_config` reads back to the same config;
    `notes` (dotted key -> text) become comments at the end of their keys' lines."""
    text = yaml.safe_dump(to_dict(config), sort_keys=False)
    return _annotate(text, notes) if notes else text


def _annotate(text: str, notes: dict[str, str]) -> str:
    """Append `  # note` to the line of each noted key of a block-style YAML dump."""
    lines, path = [], []  # path: (indent, name) of the keys above the current line
    for line in text.splitlines():
        name, sep, _ = line.strip().partition(":")
        indent = len(line) - len(line.lstrip())
        if sep and not line.lstrip().startswith(("-", "#")):
            path = [(i, n) for i, n in path if i < indent] + [(indent, name)]
            note = notes.get(".".join(n for _, n in path))
            line = f"{line}  # {note}" if note else line
        lines.append(line)
    return "\n".join(lines) + "\n"


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested settings as {dotted key: value}."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def describe(cls: type) -> list[tuple[str, str, str]]:
    """(dotted key, default, help) for every setting, for `--help`: the defaults a run gets,
    sections' included, derived keys left out."""
    derived = derived_keys(cls)
    rows = _describe(cls, _default_instance(cls), "")
    return [row for row in rows if row[0] not in derived]


def _describe(cls: type, defaults: Any, prefix: str) -> list[tuple[str, str, str]]:
    rows: list[tuple[str, str, str]] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        ftype = hints[f.name]
        default = getattr(defaults, f.name, "<required>") if defaults is not None else "<required>"
        if dataclasses.is_dataclass(ftype):
            rows.extend(_describe(ftype, default, prefix=f"{key}."))
            continue
        rows.append((key, repr(default), f.metadata.get("help", "")))
    return rows


def _default_instance(cls: type) -> Any:
    try:
        return cls()
    except (TypeError, ConfigError):  # a class with required fields has no default instance
        return None


def _default_of(f: dataclasses.Field) -> Any:
    """The field's default value (a fresh one for a factory); MISSING when it has none."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _read_yaml(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """The file's settings, and the line of each of its keys."""
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    text = path.read_text()
    try:
        data = load_yaml(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: invalid YAML ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of keys")
    return data, key_lines(text)


class _OverrideMapping(dict):
    """An override whose value YAML reads as a mapping, kept with the text typed: for a
    string key (a format template such as `{question}`) the text is what was meant."""

    def __init__(self, parsed: dict, text: str) -> None:
        super().__init__(parsed)
        self.text = text


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key=value")
    key, text = item.split("=", 1)
    try:
        value = load_yaml(text) if text else ""
    except yaml.YAMLError:
        value = text
    if isinstance(value, dict):
        value = _OverrideMapping(value, text)
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


def _build(
    cls: type[T], raw: dict[str, Any], prefix: str, sources: _Context, base: Any = None
) -> T | None:
    """`cls` from `raw`; keys that `raw` leaves out keep their value in `base` (the section's
    default instance) or, at the root, the field defaults. None when a problem was found in
    it (each in `sources.problems`): its checks between keys then do not run, as the values
    they would compare are not the ones meant."""
    problems = sources.problems
    if not isinstance(raw, dict):
        section = prefix.rstrip(".")
        where = sources.of(section)
        problems.add(ConfigError(f"{section}: expected a section, got {raw!r} ({where})"))
        return None
    before = len(problems)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    for key in raw:
        if key not in names:
            problems.add(_unknown_key(f"{prefix}{key}", sources))
    kwargs = _values(cls, raw, prefix, sources, base)
    if len(problems) > before:
        return None
    config = problems.check(_construct, cls, kwargs, prefix, sources)
    if config is not None:
        problems.check(_run_checks, config, prefix, sources)
    return config if len(problems) == before else None


def _values(
    cls: type, raw: dict[str, Any], prefix: str, sources: _Context, base: Any
) -> dict[str, Any]:
    """The constructor's keyword arguments: each value of `raw` typed, its sections built;
    one with a problem is left out (the problem collected)."""
    problems = sources.problems
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.name not in raw:
            if base is not None:
                kwargs[f.name] = getattr(base, f.name)
            continue
        key = f"{prefix}{f.name}"
        ftype = hints[f.name]
        found = len(problems)
        if dataclasses.is_dataclass(ftype):
            section = getattr(base, f.name) if base is not None else _default_of(f)
            section = None if section is dataclasses.MISSING else section
            value = _build(ftype, raw[f.name], f"{key}.", sources, base=section)
        else:
            value = problems.check(_leaf, f, ftype, raw[f.name], key, sources.sources)
        if len(problems) == found:
            kwargs[f.name] = value
    return kwargs


def _construct(cls: type[T], kwargs: dict[str, Any], prefix: str, sources: _Context) -> T:
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        message = _prefixed(prefix, str(exc))
        raise ConfigError(f"{message} ({_source_of_message(message, prefix, sources)})") from None
    except (TypeError, ValueError) as exc:
        where = prefix.rstrip(".")
        raise ConfigError(f"{where or cls.__name__}: {exc} ({sources.of(where)})") from None


def _leaf(f: dataclasses.Field, ftype: Any, value: Any, key: str, sources: Sources) -> Any:
    """One setting typed, held to its bounds, and (a path) made absolute."""
    source = sources.of(key)
    typed = _coerce(ftype, value, key, source)
    problem = bound_problem(f.metadata, typed)
    if problem:
        raise ConfigError(f"{key}: {problem} ({source})")
    if f.metadata.get("path") and isinstance(typed, str) and typed:
        resolved = sources.resolve_path(key, typed)
        if f.metadata.get("or_name") and looks_like_name(typed) and not os.path.exists(resolved):
            return typed  # a name (a cached data set), not a path here
        return resolved
    return typed


def _unknown_key(key: str, sources: _Context) -> ConfigError:
    nearest = nearest_keys(key, sources.keys)
    hint = f"; did you mean {' or '.join(nearest)}?" if nearest else ""
    where = sources.of(key)
    line = sources.sources.lines.get(key) if where == sources.sources.file else None
    at = f" on line {line}" if line else ""
    return ConfigError(f"unknown config key {key} ({where}){at}{hint}")


def _source_of_message(message: str, prefix: str, sources: _Context) -> str:
    """The source of the key a check's message starts with (`rbs: must be >= tbs`), else
    of the section checked."""
    key = message.split(":", 1)[0].strip()
    if " " in key or not key:
        key = prefix.rstrip(".")
    return sources.of(key) if key else sources.sources.overall()


def _prefixed(prefix: str, message: str) -> str:
    """Qualify a component's `key: reason` with its section. A component that names its own
    section (`engine.block_size: ...`) gets only the sections above it added: under
    `train.engine.` that is `train.engine.block_size`, not `train.engine.engine.block_size`."""
    sections = prefix.split(".")[:-1]
    for i in range(len(sections)):
        if message.startswith(".".join(sections[i:]) + "."):
            return "".join(f"{s}." for s in sections[:i]) + message
    return f"{prefix}{message}"


def _run_checks(config: Any, prefix: str, sources: _Context) -> None:
    """Call the dataclass's optional `validate()`; it raises ConfigError(key, reason), one
    line per problem, each of which gets the source of its key."""
    validate = getattr(config, "validate", None)
    if validate is None:
        return
    try:
        validate()
    except ConfigError as exc:
        lines = []
        for problem in str(exc).splitlines():
            message = _prefixed(prefix, problem)
            lines.append(f"{message} ({_source_of_message(message, prefix, sources)})")
        raise (ManyProblems(lines) if len(lines) > 1 else ConfigError(lines[0])) from None


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
        value = _choice_read_as_bool(ftype, value)
        problem = choice_problem(ftype, value)
        if problem:
            raise ConfigError(f"{key}: {problem} ({source})")
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
        key_type, value_type = get_args(ftype) or (Any, Any)
        return {
            _coerce(key_type, k, key, source): _coerce(value_type, v, f"{key}.{k}", source)
            for k, v in value.items()
        }
    return _coerce_scalar(ftype, value, key, source)


BOOL_AS_WORDS = {
    False: ("off", "no", "false", "n"),
    True: ("on", "yes", "true", "y"),
}
"""The words a bool stands for where a key takes words (`checkpoint_every: false` is off)."""


def _choice_read_as_bool(ftype: Any, value: Any) -> Any:
    """The choice of a `Literal` that YAML read as a bool (`off` -> False), if exactly one of
    its choices is such a word and the bool itself is none; else the value as read."""
    if not isinstance(value, bool) or any(c is value for c in get_args(ftype)):
        return value
    words = [c for c in get_args(ftype) if isinstance(c, str) and c.lower() in BOOL_AS_WORDS[value]]
    return words[0] if len(words) == 1 else value


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
        if isinstance(value, _OverrideMapping):
            return value.text
        if isinstance(value, str | int | float) and not isinstance(value, bool):
            return str(value)
        raise _type_error(key, ftype, value, source)
    return value


def _type_error(key: str, ftype: Any, value: Any, source: str) -> ConfigError:
    if isinstance(value, str) and value.lower() in YAML_BOOL_WORDS and _takes_bool(ftype):
        return ConfigError(f"{key}: write true or false, not {value!r} ({source})")
    return ConfigError(f"{key}: expected {_type_name(ftype)}, got {value!r} ({source})")


def _takes_bool(ftype: Any) -> bool:
    """Whether `ftype` (or one of its union's options) is bool."""
    if get_origin(ftype) in (typing.Union, types.UnionType):
        return any(_takes_bool(option) for option in get_args(ftype))
    return ftype is bool


def _type_name(ftype: Any) -> str:
    """`int`, `a mapping`, `int or 'off'` (a union names its options, None left out)."""
    origin = get_origin(ftype)
    if origin is dict:
        return "a mapping"
    if origin is Literal:
        return " or ".join(repr(choice) for choice in get_args(ftype))
    if origin in (typing.Union, types.UnionType):
        options = [a for a in get_args(ftype) if a is not type(None)]
        return " or ".join(_type_name(a) for a in options)
    return getattr(ftype, "__name__", str(ftype))
