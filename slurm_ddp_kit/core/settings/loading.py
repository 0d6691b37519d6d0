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

from slurm_ddp_kit.core.settings.rules import check_ranges, check_written, validate
from slurm_ddp_kit.core.settings.schema import Choice, Config, ConfigError

if typing.TYPE_CHECKING:  # imported where used: readers of many runs never pay for OmegaConf
    from omegaconf import DictConfig
    from omegaconf.errors import OmegaConfBaseException


def load_config(
    config_files: Sequence[str | Path] = (),
    overrides: Sequence[str] = (),
    mode: str | None = None,
    nodes: int | None = None,
    program: Sequence[str] = (),
) -> Config:
    """Merge defaults ← files, in order ← overrides (← --mode/--nodes, and the words after `--`
    as `program`), check it, and return a typed Config. Files merge key by key, the later
    winning (a cluster's file, then an experiment's); a list (cluster.setup) is one value: the
    later file's replaces it whole."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    layers = [_defaults()]
    layers += [_read_yaml(Path(path)) for path in config_files]
    flags: dict[str, tuple[str, object]] = {
        "mode": (f"--mode {mode}", mode),
        "cluster.nodes": (f"--nodes {nodes}", nodes),
    }
    given = {key: flag for key, flag in flags.items() if flag[1] is not None}
    _check_given_once(overrides, given)
    layers.append(_parse_overrides([*overrides, *(f"{k}={v}" for k, (_, v) in given.items())]))
    if program:
        _check_program_once(overrides, program)
        layers.append(OmegaConf.create({"program": list(program)}))
    for layer in layers[1:]:
        values = OmegaConf.to_container(layer)  # as written: nothing resolved
        _check_keys(values, Config, "")
        _refuse_interpolations(values, "")
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
        _escape_dollars(to_dict(cfg)), Dumper=get_omega_conf_dumper(), default_flow_style=False,
        allow_unicode=True, sort_keys=False,
    )  # fmt: skip


def _escape_dollars(value: Any) -> Any:
    """Text holding `${` (a shell variable in a setup line, written `\\${HOME}`) as OmegaConf
    reads it back as text: escaped, with the backslashes before it doubled."""
    if isinstance(value, dict):
        return {k: _escape_dollars(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_escape_dollars(v) for v in value]
    if isinstance(value, str) and "${" in value:
        return _DOLLARS.sub(lambda found: found[1] * 2 + "\\${", value)
    return value


_DOLLARS = re.compile(r"(\\*)\$\{")


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


def _check_given_once(overrides: Sequence[str], flags: dict[str, tuple[str, object]]) -> None:
    """Each setting given once: a key twice on the line (or a group and a key in it), or a flag
    (--mode, --nodes) and a key=value that disagree, is refused naming both, rather than one
    of them taken without a word."""
    seen: dict[str, str] = {}
    for item in overrides:
        key, _, value = item.partition("=")
        for earlier_key, earlier in seen.items():
            same = key == earlier_key and value == earlier.partition("=")[2]
            if not same and _overlap(key, earlier_key):
                raise ConfigError(
                    f"{earlier} and {item} both set {min(key, earlier_key, key=len)}: "
                    "give each setting once"
                )
        seen[key] = item
    for setting, (flag, given) in flags.items():
        written = next((seen[k] for k in seen if _overlap(k, setting)), None)
        if written is not None and written != f"{setting}={given}":
            raise ConfigError(f"{flag} and {written} both set {setting}: give one of them")


def _check_program_once(overrides: Sequence[str], program: Sequence[str]) -> None:
    """The program is given after `--` or as program=[…], not both."""
    written = next((item for item in overrides if item.partition("=")[0] == "program"), None)
    if written is not None:
        raise ConfigError(
            f"-- {' '.join(program)} and {written} both set program: give one of them"
        )


def _overlap(key: str, other: str) -> bool:
    """The same setting, or a group and a setting in it (cluster.sbatch_extra and
    cluster.sbatch_extra.time)."""
    return key == other or key.startswith(f"{other}.") or other.startswith(f"{key}.")


# `${…}`: OmegaConf's interpolation, resolved when the settings are built (`${oc.env:TOKEN}`
# would be a token written in clear into config.yaml and run.json); `\${…}` is its escape.
_INTERPOLATION = re.compile(r"(?<!\\)(\\\\)*\$\{")


def _refuse_interpolations(values: Any, key: str) -> None:
    """No setting is an interpolation: the kit keeps what was written, and resolves nothing
    into the run folder (an environment variable, another setting, a decoded value)."""
    if isinstance(values, dict):
        for name, value in values.items():
            _refuse_interpolations(value, f"{key}.{name}".strip("."))
    elif isinstance(values, list):
        for value in values:
            _refuse_interpolations(value, key)
    elif isinstance(values, str) and _INTERPOLATION.search(values):
        raise ConfigError(
            f"{key}={values!r} holds an interpolation (${{…}}), which the kit does not resolve: "
            "its value would be written into the run folder. For a shell variable in "
            "cluster.setup write $NAME or \\${NAME} (e.g. cluster.setup=['export T=$TOKEN']), "
            "which the job's shell expands; for any other setting write the value itself"
        )


def _parse_overrides(overrides: Sequence[str]) -> DictConfig:
    from omegaconf import OmegaConf

    items = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not all(key.split(".")):  # no key, or an empty part: `train..epochs`
            # A bare word may be a program's, given without the `--` that sets it apart.
            program = "" if sep else " (a program to run goes after `--`: `-- python my_train.py`)"
            raise ConfigError(
                f"override {item!r} is not of the form key=value, e.g. train.epochs=3{program}"
            )
        if "[" in key or "]" in key:  # OmegaConf's indexed keys: one item of a list
            whole = key.split("[")[0]
            raise ConfigError(
                f"{key}: the kit sets no single item of a list; give the whole list, e.g. "
                f"'{whole}=[{value}]'"
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
    then turns those into the strings '83', 'True' and '90' for a setting typed `str` (and a
    choice's `on` and `off` into booleans, no choice at all). Booleans
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
        if key in _LINES:
            _refuse_split_lines(node, key)
        return [_as_written(v, n, args[0], key) for v, n in zip(value, node.value, strict=False)]
    if not isinstance(node, yaml.ScalarNode) or (node.tag == _NULL and node.style is None):
        return value
    if hint is str or (origin in (typing.Union, types.UnionType) and str in args):
        return node.value
    if isinstance(hint, type) and issubclass(hint, Choice):  # code.snapshot=off is text, not false
        return node.value
    if hint is bool and node.tag in _NUMBERS and node.value not in ("0", "1"):
        raise ConfigError(f"{key}={node.value} must be true or false")
    if node.tag in _NUMBERS and not _PLAIN_NUMBER.fullmatch(node.value):
        raise ConfigError(
            f"{key}={node.value} is a number in a YAML 1.1 form, which reads as {value}: write "
            "it in plain decimal digits, without a leading 0, '0x', '_' or ':'"
        )
    return value


_LINES = ("cluster.setup",)  # lists of shell lines, where a comma belongs to a command


def _refuse_split_lines(node: yaml.SequenceNode, key: str) -> None:
    """`[export A=1,2]` is YAML's list of two lines, 'export A=1' and '2': two plain items with
    only a comma between them are refused, as one line meant to hold it."""
    for before, after in zip(node.value, node.value[1:], strict=False):
        plain = all(isinstance(n, yaml.ScalarNode) and n.style is None for n in (before, after))
        buffer = before.end_mark.buffer
        if plain and buffer and buffer[before.end_mark.index : after.start_mark.index] == ",":
            joined = f"{before.value},{after.value}"
            raise ConfigError(
                f"{key}=[…{joined}…] reads as two lines, {before.value!r} and {after.value!r}: "
                f"YAML splits a list at each comma. Quote a line that holds a comma "
                f"({key}=['{joined}']), or write a space after a comma between two lines"
            )


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


_SETTING = re.compile(r"\{([a-z_]+(?:\.[a-z_]+)+)\}")  # `{train.lr}` in a program's argument


def program_arguments(cfg: Config) -> list[str]:
    """The program's words, each `{group.key}` replaced by the run's setting (a sweep's grid values
    reach the program so); any other braces stay as written."""
    values = to_dict(cfg)

    def setting(found: re.Match[str]) -> str:
        value: Any = values
        for part in found.group(1).split("."):
            if not isinstance(value, dict) or part not in value:
                return found.group(0)
            value = value[part]
        return str(value)

    return [_SETTING.sub(setting, word) for word in cfg.program]
