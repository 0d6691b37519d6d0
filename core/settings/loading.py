"""Loading settings: typed defaults ← an optional YAML file ← `key=value` overrides.

OmegaConf merges the layers against the schema's dataclasses; readers of many runs rebuild a
Config from plain values without OmegaConf (`from_dict`).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import re
import types
import typing
from collections.abc import Callable, Sequence
from enum import Enum
from pathlib import Path
from typing import Any

import yaml

from core.settings.rules import check_ranges, check_written, validate
from core.settings.schema import Choice, Config, ConfigError

if typing.TYPE_CHECKING:  # imported where used: readers of many runs never pay for OmegaConf
    from omegaconf import DictConfig
    from omegaconf.errors import OmegaConfBaseException


def load_config(
    config_file: str | Path | None = None,
    overrides: Sequence[str] = (),
    mode: str | None = None,
    nodes: int | None = None,
) -> Config:
    """Merge defaults ← file ← overrides (← --mode/--nodes), check it, and return a typed Config."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    layers = [_defaults()]
    if config_file is not None:
        layers.append(_read_yaml(Path(config_file)))
    flags = [f"mode={mode}"] * (mode is not None) + [f"cluster.nodes={nodes}"] * (nodes is not None)
    layers.append(_parse_overrides([*overrides, *flags]))
    for layer in layers[1:]:
        _check_keys(OmegaConf.to_container(layer), Config, "")
    try:
        cfg = typing.cast(Config, OmegaConf.to_object(OmegaConf.merge(*layers)))
    except OmegaConfBaseException as err:
        raise ConfigError(_type_error_message(err)) from None
    except (TypeError, ValueError) as err:  # e.g. a list merged into a mapping
        raise ConfigError(f"a setting has the wrong shape: {err}") from None
    validate(cfg)
    return cfg


@functools.cache
def _defaults() -> DictConfig:
    """The schema's defaults as OmegaConf's typed node, made once: it is most of a load's time
    (a sweep loads one config per point), and merging copies it rather than changing it."""
    from omegaconf import OmegaConf

    return OmegaConf.structured(Config)


def to_yaml(cfg: Config) -> str:
    """The config as OmegaConf writes YAML (its dumper, which quotes text that would read back
    as another type), from plain values: OmegaConf writes a structured config's choices by their
    Python names, which the reader (by value) would refuse where the two differ (compile_mode);
    and without building OmegaConf's nodes first (a sweep writes one per run)."""
    from omegaconf._utils import get_omega_conf_dumper

    return yaml.dump(
        to_dict(cfg), Dumper=get_omega_conf_dumper(), default_flow_style=False,
        allow_unicode=True, sort_keys=False,
    )  # fmt: skip


def to_dict(cfg: Config) -> dict[str, Any]:
    """Plain JSON-ready values (choices as their strings)."""
    return typing.cast(dict[str, Any], _plain(dataclasses.asdict(cfg)))


def from_dict(values: dict[str, Any]) -> Config:
    """A Config from `to_dict`'s output, without OmegaConf: fast, for readers of many runs."""
    try:
        cfg = typing.cast(Config, _build(Config, values))
    except (TypeError, ValueError) as err:  # TypeError: an unknown key, or no mapping
        raise ConfigError(f"stored settings do not match this kit's: {err}") from None
    try:
        check_ranges(cfg)
    except ConfigError as err:
        raise ConfigError(f"stored settings break this kit's rules: {err}") from None
    return cfg


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value.value if isinstance(value, Enum) else value


def _build(schema: type, values: dict[str, Any]) -> Any:
    """Rebuild a dataclass, the ones nested in it and its enums from plain values.

    An unknown key raises TypeError, a missing one takes its default, a bad choice ValueError.
    """
    fields = dict(values)
    for name, make in _builders(schema).items():
        if name in fields:
            fields[name] = make(fields[name])
    for name, kinds in _plain_kinds(schema).items():
        if name in fields and not isinstance(fields[name], kinds):
            wanted = " or ".join(kind.__name__ for kind in kinds)
            raise ValueError(f"{name}={fields[name]!r}, where the kit writes {wanted}")
    return schema(**fields)


@functools.cache  # once per class: type hints cost far more than building a Config
def _builders(schema: type) -> dict[str, Callable[[Any], Any]]:
    """The fields of a dataclass that are no plain value, and what rebuilds each from one."""
    builders: dict[str, Callable[[Any], Any]] = {}
    for name, hint in typing.get_type_hints(schema).items():
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            builders[name] = functools.partial(_build, hint)
        elif isinstance(hint, type) and issubclass(hint, Enum):
            builders[name] = hint
    return builders


@functools.cache
def _plain_kinds(schema: type) -> dict[str, tuple[type, ...]]:
    """The plain-valued fields of a dataclass and the types a stored value of each may have (a
    float may be stored as an integer)."""
    kinds: dict[str, tuple[type, ...]] = {}
    for name, hint in typing.get_type_hints(schema).items():
        union = typing.get_origin(hint) in (types.UnionType, typing.Union)
        options = typing.get_args(hint) if union else (hint,)
        plain = [typing.get_origin(o) or o for o in options]
        if all(o in (int, float, str, bool, list, dict, type(None)) for o in plain):
            kinds[name] = (*plain, int) if float in plain else tuple(plain)
    return kinds


def _read_yaml(path: Path) -> DictConfig:
    from omegaconf import DictConfig, OmegaConf

    text = _config_text(path)
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except Exception as err:  # yaml's own errors carry the line and column
        raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(err)}") from None
    if node is None:  # nothing but comments: no settings
        return OmegaConf.create()
    if not isinstance(node, yaml.MappingNode):
        raise ConfigError(
            f"config file {path} must hold a mapping of settings (lines of `key: value`, e.g. "
            "`train:` then `  epochs: 3`), not a single value or a list"
        )
    try:
        loaded = OmegaConf.create(text)
    except Exception as err:
        raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(err)}") from None
    if not isinstance(loaded, DictConfig):  # never, after the check above
        raise ConfigError(f"config file {path} must hold a mapping of settings, not a list")
    written = _as_written(OmegaConf.to_container(loaded), node, Config, "")
    return typing.cast(DictConfig, OmegaConf.create(written))


def _config_text(path: Path) -> str:
    if path.is_dir():
        raise ConfigError(
            f"config file {path} is a folder: name a YAML file, e.g. docs/examples/two-nodes.yaml"
        )
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    if not path.is_file():  # a named pipe or a device would be read until someone writes to it
        raise ConfigError(f"config file {path} is not a regular file: name a YAML file")
    try:
        return path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text: name a YAML file") from None


def _parse_overrides(overrides: Sequence[str]) -> DictConfig:
    from omegaconf import OmegaConf

    items = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not all(key.split(".")):  # no key, or an empty part: `train..epochs`
            raise ConfigError(
                f"override {item!r} is not of the form key=value, e.g. train.epochs=3"
            )
        check_written(key, value)  # before YAML folds a line break into a space
        items.append(item if value else f"{key}=''")  # `key=` means the empty string
    layer = OmegaConf.create()
    for item in items:
        key, value = read_override(item)
        OmegaConf.update(layer, key, copy.deepcopy(value))  # the cached value stays as read
    return layer


@functools.lru_cache(maxsize=4096)
def read_override(item: str) -> tuple[str, Any]:
    """One `key=value` as its key and value read as written; cached, since a sweep gives every
    point the same overrides besides its own (a refused one raises, and is not cached)."""
    from omegaconf import OmegaConf

    key, _, value = item.partition("=")
    try:
        single = OmegaConf.to_container(OmegaConf.from_dotlist([item]))
        node = yaml.compose(value, Loader=yaml.SafeLoader)
    except Exception as err:  # YAML scanner errors (a value starting with @, `, %, *, !, [ …)
        raise ConfigError(
            f"cannot read the value of {item!r} ({_first_line(err)}): a value starting with a "
            f"special character needs quotes inside the argument, e.g. '{key}=\"{value}\"'"
        ) from None
    parts = key.split(".")
    loaded = functools.reduce(lambda values, part: values[part], parts, single)
    return key, _as_written(loaded, node, _hint_at(parts), key)


_NULL = "tag:yaml.org,2002:null"
_NUMBERS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")


def _as_written(value: Any, node: yaml.Node | None, hint: Any, key: str) -> Any:
    """`value` as OmegaConf read it from YAML `node`, with every text setting exactly as written.

    OmegaConf reads YAML 1.1, where `0123` is the number 83, `yes` is true and `1:30` is 90, and
    then turns those into the strings '83', 'True' and '90' for a setting typed `str`. Booleans
    written as numbers other than 0 and 1 (-1, 0x10) are refused rather than taken as true.
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if isinstance(node, yaml.MappingNode) and isinstance(value, dict):
        hints = (
            _field_hints(hint)
            if isinstance(hint, type) and dataclasses.is_dataclass(hint)
            else None
        )
        for key_node, value_node in node.value:
            name = key_node.value
            inner = hints.get(name) if hints is not None else (args[1] if origin is dict else None)
            if name in value and inner is not None:
                value[name] = _as_written(
                    value[name], value_node, inner, f"{key}.{name}".strip(".")
                )
        return value
    if isinstance(node, yaml.SequenceNode) and isinstance(value, list) and origin is list:
        return [_as_written(v, n, args[0], key) for v, n in zip(value, node.value, strict=False)]
    if not isinstance(node, yaml.ScalarNode) or (node.tag == _NULL and node.style is None):
        return value
    if hint is str or (origin in (typing.Union, types.UnionType) and str in args):
        return node.value
    if hint is bool and node.tag in _NUMBERS and node.value not in ("0", "1"):
        raise ConfigError(f"{key}={node.value} must be true or false")
    if node.tag in _NUMBERS and not _PLAIN_NUMBER.fullmatch(node.value):
        raise ConfigError(
            f"{key}={node.value} is a number in a YAML 1.1 form, which reads as {value}: write "
            "it in plain decimal digits, without a leading 0, '0x', '_' or ':'"
        )
    return value


# Decimal as Python and YAML 1.2 read it: no leading zero, no '_', no base-60 '1:30'.
_PLAIN_NUMBER = re.compile(
    r"[-+]?(0|[1-9][0-9]*)(\.[0-9]*)?([eE][-+]?[0-9]+)?|[-+]?\.[0-9]+([eE][-+]?[0-9]+)?"
    r"|[-+]?\.(inf|Inf|INF)|\.(nan|NaN|NAN)"
)


def _hint_at(parts: list[str]) -> Any:
    """The schema's type of a dotted setting; None where the schema has no such key."""
    hint: Any = Config
    for part in parts:
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            hint = _field_hints(hint).get(part)
        elif typing.get_origin(hint) is dict:
            hint = typing.get_args(hint)[1]
        else:
            return None
    return hint


@functools.cache
def _field_hints(schema: type) -> dict[str, Any]:
    return typing.get_type_hints(schema)


def _yaml_problem(err: Exception) -> str:
    """YAML's problem and where it is, on one line (its message spreads them over four)."""
    problem, mark = getattr(err, "problem", None), getattr(err, "problem_mark", None)
    if not problem or mark is None:
        return _first_line(err)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _check_keys(node: Any, schema: type, prefix: str) -> None:
    """Every key must be a field of its dataclass; the error lists the valid ones."""
    if not isinstance(node, dict):
        return
    fields = {f.name: f for f in dataclasses.fields(schema)}
    hints = typing.get_type_hints(schema)
    for key, value in node.items():
        if key not in fields:
            raise ConfigError(_unknown_key_message(f"{prefix}{key}", str(key), sorted(fields)))
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise ConfigError(
                    f"{prefix}{key}={value!r} is a group of settings, not a value: set one of its "
                    f"keys, e.g. {prefix}{key}.{dataclasses.fields(typing.cast(type, hint))[0].name}=…"
                )
            _check_keys(value, typing.cast(type, hint), f"{prefix}{key}.")
        elif typing.get_origin(hint) in (dict, list) and not isinstance(
            value, typing.get_origin(hint)
        ):
            shape = (
                "a mapping, e.g. {mail-type: END}"
                if typing.get_origin(hint) is dict
                else "a list, e.g. [a, b]"
            )
            raise ConfigError(f"{prefix}{key}={value!r} must be {shape}")
        elif isinstance(hint, type) and issubclass(hint, Choice) and value not in hint.values():
            raise ConfigError(
                f"{prefix}{key}={value!r} is not valid; choose one of: {', '.join(hint.values())}"
            )


def _unknown_key_message(full_key: str, key: str, valid: list[str]) -> str:
    close = [v for v in valid if v.startswith(key)] or difflib.get_close_matches(key, valid, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"unknown setting {full_key!r}.{hint} Valid keys here: {', '.join(valid)}"


_KINDS = {  # a scalar setting's type: what its value must be, in words
    bool: "true or false (yes/no, on/off, y/n and 1/0 read the same)",
    int: "a whole number",
    float: "a number",
}


def _type_error_message(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", None) or "?"
    kind = _KINDS.get(_hint_at(key.split(".")))
    value = getattr(err, "value", None)
    if kind is None or value is None:
        return f"setting {key!r} has the wrong type: {_first_line(err)}"
    return f"{key}={value!r} must be {kind}"
