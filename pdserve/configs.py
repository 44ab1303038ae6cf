"""Helpers for the frozen config dataclasses every component declares.

A config field documents itself once, in its metadata (``doc(...)``); that text is what
``--help`` and the README show. ``from_dict`` builds a config from YAML/JSON data and refuses
unknown keys and wrong types with a message naming the key and what is allowed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the key."""


def doc(default: Any = dataclasses.MISSING, help: str = "", **kwargs: Any) -> Any:
    """A dataclass field with its one line of documentation."""
    metadata = {"help": help, **kwargs.pop("metadata", {})}
    if "default_factory" in kwargs:
        return dataclasses.field(metadata=metadata, **kwargs)
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


def field_help(cls: type, name: str) -> str:
    return next(f.metadata.get("help", "") for f in dataclasses.fields(cls) if f.name == name)


def _allowed(tp: Any) -> tuple[type, ...]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return tuple(t for arg in typing.get_args(tp) for t in _allowed(arg))
    if origin is typing.Literal:
        return tuple({type(a) for a in typing.get_args(tp)})
    if origin is not None:
        return (origin,)
    if tp is float:
        return (float, int)
    return (tp,)


def check_type(owner: str, key: str, value: Any, tp: Any) -> None:
    """Raise ConfigError when ``value`` does not fit the annotation ``tp``."""
    if typing.get_origin(tp) is typing.Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{owner}.{key}: {value!r} is not one of {list(choices)}")
        return
    allowed = _allowed(tp)
    if type(None) in allowed and value is None:
        return
    if isinstance(value, bool) and bool not in allowed:
        raise ConfigError(f"{owner}.{key}: expected {_type_name(tp)}, got a boolean {value!r}")
    if not isinstance(value, allowed):
        raise ConfigError(f"{owner}.{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def from_dict(cls: type[T], data: dict[str, Any] | None, owner: str | None = None) -> T:
    """Build ``cls`` from a mapping; unknown keys and wrong types raise ConfigError."""
    owner = owner or cls.__name__
    data = dict(data or {})
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{owner}: unknown key(s) {unknown}; allowed keys: {sorted(names)}")
    kwargs = {}
    for key, value in data.items():
        tp = hints[key]
        nested = _nested_dataclass(tp)
        by_name = _dataclass_by_name(tp)
        if by_name is not None and isinstance(value, dict):
            value = {name: _section(by_name, item, f"{owner}.{key}.{name}") for name, item in value.items()}
        elif nested is not None and isinstance(value, dict):
            value = from_dict(nested, value, f"{owner}.{key}")
        else:
            check_type(owner, key, value, tp)
            if _allowed(tp) == (float, int) and isinstance(value, int):
                value = float(value)
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except ConfigError as e:  # a section's own check names the key from the section: give the full path
        leaf = owner.rsplit(".", 1)[-1]
        message = str(e)
        if owner != leaf and message.startswith((leaf + ":", leaf + ".")):
            raise ConfigError(owner + message[len(leaf):]) from e
        raise


def _section(cls: type[T], value: Any, owner: str) -> T:
    if dataclasses.is_dataclass(value):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"{owner}: expected a mapping of {cls.__name__}'s keys, got {type(value).__name__} {value!r}")
    try:
        return from_dict(cls, value, owner)
    except ConfigError as e:  # the section's own check names its key only: give the full path
        if str(e).startswith(owner):
            raise
        raise ConfigError(f"{owner}.{e}") from e


def _dataclass_by_name(tp: Any) -> type | None:
    """``X`` for a ``dict[str, X]`` annotation whose values are config dataclasses (sections keyed by
    a name the user picks, such as tenants), else None."""
    if typing.get_origin(tp) is dict:
        value_type = typing.get_args(tp)[1]
        if dataclasses.is_dataclass(value_type):
            return value_type
    return None


def _nested_dataclass(tp: Any) -> type | None:
    for candidate in typing.get_args(tp) or (tp,):
        if dataclasses.is_dataclass(candidate):
            return candidate
    return None


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def add_arguments(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """Add one ``--flag`` per scalar field of ``cls``, with the field's documentation as help.

    Defaults are left as None so that ``collect_arguments`` passes on only what the user set.
    """
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        tp = hints[f.name]
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = f"{f.metadata.get('help', '')} (default: {default})"
        allowed = [t for t in _allowed(tp) if t is not type(None)]
        if typing.get_origin(tp) is typing.Literal:
            parser.add_argument(flag, choices=typing.get_args(tp), default=None, help=help_text)
        elif allowed == [bool]:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif allowed and allowed[0] in (int, float, str):
            parser.add_argument(flag, type=allowed[0], default=None, help=help_text)


def collect_arguments(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of ``cls`` that were given on the command line."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def to_flags(options: dict[str, Any]) -> list[str]:
    """The command-line flags that ``add_arguments``/``collect_arguments`` read back as ``options``."""
    flags = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        elif value is not None:
            flags += [flag, str(value)]
    return flags
