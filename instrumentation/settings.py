"""Settings declared once: a dataclass field carries its default, range, help, flag and variable.

``setting(8, "workers", lo=1, hi=64)`` is a ``dataclasses.field`` whose metadata the rest
reads: ``check_settings`` range-checks a config with ``check_range`` (one error sentence
everywhere), ``add_flags`` makes exactly one command-line flag per field (nested configs
get their field name as a prefix), ``from_flags`` builds the config back from the parsed
arguments, and a field's environment variable, when it has one, supplies the default that
the flag shows. Precedence: flag > environment variable > declared default.
Stdlib only, so that ``--help`` stays instant; O(fields) per call.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .config_checks import check_range

__all__ = ["setting", "check_settings", "add_flags", "from_flags", "flag_names", "env_values", "undeclared"]

_KEY = "sightline.setting"


@dataclasses.dataclass(frozen=True)
class _Meta:
    help: str
    lo: float | None
    hi: float | None
    lo_open: bool
    hi_open: bool
    hint: str
    flag: str | None
    env: str | None
    metavar: str | None
    cli: bool


def setting(default: Any = dataclasses.MISSING, help: str = "", *, lo: float | None = None,
            hi: float | None = None, lo_open: bool = False, hi_open: bool = False, hint: str = "",
            flag: str | None = None, env: str | None = None, metavar: str | None = None,
            factory: Any = dataclasses.MISSING, cli: bool = True) -> Any:
    """A dataclass field with its declaration. ``lo``/``hi``: the allowed range (checked by
    ``check_settings``); ``flag``: the flag's name when it is not ``--field-name``; ``env``:
    a variable that supplies the default; ``cli=False``: set in code only (no flag)."""
    meta = {_KEY: _Meta(help, lo, hi, lo_open, hi_open, hint, flag, env, metavar, cli)}
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _meta(f: dataclasses.Field) -> _Meta | None:
    return f.metadata.get(_KEY)


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else tp), True
    return tp, False


def _is_config(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def check_settings(config: Any) -> None:
    """Raises ValueError (``check_range``'s sentence) for the first field outside its range,
    or a choice outside its ``Literal``/``Enum``."""
    hints = _hints(type(config))
    for f in dataclasses.fields(config):
        meta, value = _meta(f), getattr(config, f.name)
        if meta is None or value is None:
            continue
        tp, _ = _unwrap_optional(hints[f.name])
        if meta.lo is not None or meta.hi is not None:
            check_range(f.name, value, -float("inf") if meta.lo is None else meta.lo,
                        float("inf") if meta.hi is None else meta.hi,
                        integer=tp is int, lo_open=meta.lo_open, hi_open=meta.hi_open, hint=meta.hint)
        choices = _choices(tp)
        if choices is not None and value not in choices and not (
                isinstance(tp, type) and issubclass(tp, enum.Enum) and isinstance(value, tp)):
            raise ValueError(f"{f.name}={value!r} is not one of {', '.join(map(str, choices))}")


def _choices(tp: Any) -> tuple | None:
    if typing.get_origin(tp) is typing.Literal:
        return typing.get_args(tp)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tuple(m.value for m in tp)
    return None


def _convert(tp: Any, raw: str) -> Any:
    """A variable's text as the field's type."""
    if tp is bool:
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{raw!r} is not a boolean (true/false)")
    if tp in (int, float, str, Path):
        return tp(raw)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp(raw)
    return raw


def env_values(cls: type, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The fields of ``cls`` whose variable is set in ``env`` (default ``os.environ``), as
    their types; ValueError names the variable and its bad value."""
    env = os.environ if env is None else env
    hints, values = _hints(cls), {}
    for f in dataclasses.fields(cls):
        meta = _meta(f)
        raw = env.get(meta.env) if meta is not None and meta.env else None
        if raw is None or not raw.strip():
            continue
        try:
            values[f.name] = _convert(_unwrap_optional(hints[f.name])[0], raw.strip())
        except ValueError as exc:
            raise ValueError(f"{meta.env}={raw!r}: {exc}") from None
    return values


def _flag(f: dataclasses.Field, meta: _Meta, prefix: str) -> str:
    return meta.flag or "--" + (prefix + f.name).replace("_", "-")


def add_flags(parser: argparse.ArgumentParser | Any, cls: type, *, prefix: str = "",
              env: Mapping[str, str] | None = None, defaults: Any = None) -> None:
    """One flag per declared field of ``cls`` (and of its nested configs, prefixed with the
    field's name), each showing its default; dest is the prefixed field name.
    ``defaults``: an instance whose values are the flags' defaults (else the declared ones)."""
    hints = _hints(cls)
    from_env = env_values(cls, env)
    for f in dataclasses.fields(cls):
        meta = _meta(f)
        tp, optional = _unwrap_optional(hints[f.name])
        if _is_config(tp):
            nested = getattr(defaults, f.name) if defaults is not None else None
            add_flags(parser, tp, prefix=f"{prefix}{f.name}_", env=env, defaults=nested)
            continue
        if meta is None or not meta.cli:
            continue
        if defaults is not None:
            default = getattr(defaults, f.name)
        elif f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = f.default_factory()  # type: ignore[misc]
        default = from_env.get(f.name, default)
        help_text = meta.help + (f" (env {meta.env})" if meta.env else "")
        kwargs: dict[str, Any] = {"dest": prefix + f.name, "default": default, "help": help_text}
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            choices = _choices(tp)
            if choices is not None:
                kwargs["choices"] = choices
                if isinstance(tp, type) and issubclass(tp, enum.Enum):
                    kwargs["type"] = tp
            elif tp in (int, float, Path):
                kwargs["type"] = tp
            if meta.metavar:
                kwargs["metavar"] = meta.metavar
            kwargs["help"] += " (default %(default)s)" if default is not None and not optional else ""
        parser.add_argument(_flag(f, meta, prefix), **kwargs)


def from_flags(cls: type, args: argparse.Namespace, *, prefix: str = "", **overrides: Any) -> Any:
    """The ``cls`` that the parsed flags describe (``overrides`` win); nested configs too.
    ValueError (from the config's own checks) names a bad value."""
    hints, values = _hints(cls), {}
    for f in dataclasses.fields(cls):
        tp, _ = _unwrap_optional(hints[f.name])
        if _is_config(tp):
            values[f.name] = from_flags(tp, args, prefix=f"{prefix}{f.name}_")
        elif (meta := _meta(f)) is not None and meta.cli and hasattr(args, prefix + f.name):
            values[f.name] = getattr(args, prefix + f.name)
    values.update(overrides)
    return cls(**values)


def flag_names(cls: type, *, prefix: str = "") -> dict[str, str]:
    """Field path (``window.slot_s``) -> its flag, for every declared field with a flag."""
    hints, names = _hints(cls), {}
    for f in dataclasses.fields(cls):
        tp, _ = _unwrap_optional(hints[f.name])
        if _is_config(tp):
            nested = flag_names(tp, prefix=f"{prefix}{f.name}_")
            names.update({f"{f.name}.{k}": v for k, v in nested.items()})
        elif (meta := _meta(f)) is not None and meta.cli:
            names[f.name] = _flag(f, meta, prefix)
    return names


def undeclared(cls: type) -> list[str]:
    """Fields of ``cls`` (and nested configs) declared without ``setting``."""
    hints, missing = _hints(cls), []
    for f in dataclasses.fields(cls):
        tp, _ = _unwrap_optional(hints[f.name])
        if _is_config(tp):
            missing += [f"{f.name}.{n}" for n in undeclared(tp)]
        elif _meta(f) is None:
            missing.append(f.name)
    return missing
