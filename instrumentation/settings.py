"""Settings declared once: a dataclass field carries its default, range, help, flag and variable.

``setting(8, "workers", lo=1, hi=64)`` is a ``dataclasses.field`` whose metadata the rest
reads: ``check_settings`` range-checks a config with ``check_range`` (one error sentence
everywhere), ``add_flags`` makes exactly one command-line flag per field (nested configs
get their field name as a prefix), ``from_flags`` builds the config back from the parsed
arguments, and ``env_values`` reads the fields' environment variables. Precedence: flag >
environment variable > declared default; the environment is read when the config is
built, never when the parser is, so a bad variable fails only the command that reads it.
Stdlib only, so that ``--help`` stays instant; O(fields) per call.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .config_checks import check_range

__all__ = ["setting", "check_settings", "add_flags", "from_flags", "given_flags", "flag_names",
           "env_values", "undeclared"]

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
    env: tuple[str, ...]
    parse: Callable[[str], Any] | None
    env_parse: Callable[[str], Any] | None
    metavar: str | None
    cli: bool
    flag_default: Any


def setting(default: Any = dataclasses.MISSING, help: str = "", *, lo: float | None = None,
            hi: float | None = None, lo_open: bool = False, hi_open: bool = False, hint: str = "",
            flag: str | None = None, env: str | tuple[str, ...] | None = None,
            parse: Callable[[str], Any] | None = None, env_parse: Callable[[str], Any] | None = None,
            metavar: str | None = None,
            factory: Any = dataclasses.MISSING, cli: bool = True,
            flag_default: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with its declaration. ``lo``/``hi``: the allowed range (checked by
    ``check_settings``); ``flag``: the flag's name when it is not ``--field-name``; ``env``:
    the variable (or variables, the first one set wins) that supplies the value when the flag
    is not given; ``parse``: text (of the flag and of the variable) to value, where the
    field's type alone does not say how; ``env_parse``: the variable's text to value where it
    differs from the flag's (OTel's milliseconds for seconds); ``cli=False``: set in code only (no flag);
    ``flag_default``: the flag's default when the command resolves an absent value itself
    (e.g. None: decided at start-up)."""
    envs = (env,) if isinstance(env, str) else tuple(env or ())
    meta = {_KEY: _Meta(help, lo, hi, lo_open, hi_open, hint, flag, envs, parse, env_parse or parse,
                        metavar, cli, flag_default)}
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
            raise ValueError(f"{f.name}={value!r} is not one of {'|'.join(map(str, choices))}")


def _choices(tp: Any) -> tuple | None:
    if typing.get_origin(tp) is typing.Literal:
        return typing.get_args(tp)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tuple(m.value for m in tp)
    return None


def _convert(tp: Any, raw: str, parse: Callable[[str], Any] | None = None) -> Any:
    """A variable's text as the field's type (``parse``, where the field declares one)."""
    if parse is not None:
        return parse(raw)
    if tp is bool:
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{raw!r} is not a boolean (true|false|1|0|yes|no|on|off)")
    if tp is int:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{raw!r} is not an integer") from None
    if tp is float:
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{raw!r} is not a number") from None
    if tp in (str, Path):
        return tp(raw)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp(raw)
    return raw


def env_values(cls: type, env: Mapping[str, str] | None = None,
               sources: dict[str, str] | None = None) -> dict[str, Any]:
    """The fields of ``cls`` whose variable is set (not blank) in ``env`` (default
    ``os.environ``), as their types; ValueError names the variable and its bad value.
    ``sources``, when given, receives field -> ``VAR='text'`` for each value read."""
    env = os.environ if env is None else env
    hints, values = _hints(cls), {}
    for f in dataclasses.fields(cls):
        meta = _meta(f)
        if meta is None:
            continue
        name = next((n for n in meta.env if (env.get(n) or "").strip()), None)
        if name is None:
            continue
        raw = env[name]
        try:
            values[f.name] = _convert(_unwrap_optional(hints[f.name])[0], raw.strip(), meta.env_parse)
        except ValueError as exc:
            raise ValueError(f"{name}={raw!r}: {exc}") from None
        if sources is not None:
            sources[f.name] = f"{name}={raw!r}"
    return values


def _flag_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` for argparse: its ValueError becomes the flag's error message."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return convert


def _default_text(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, enum.Enum):
        return value.name.lower()
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value)) or "none"
    if isinstance(value, Mapping):
        return ",".join(f"{k}={v}" for k, v in value.items()) or "none"
    return str(value)


def _flag(f: dataclasses.Field, meta: _Meta, prefix: str) -> str:
    return meta.flag or "--" + (prefix + f.name).replace("_", "-")


def add_flags(parser: argparse.ArgumentParser | Any, cls: type, *, prefix: str = "",
              defaults: Any = None) -> None:
    """One flag per declared field of ``cls`` (and of its nested configs, prefixed with the
    field's name), each showing its default; dest is the prefixed field name. A field with
    a variable gets the default None ("not given": ``from_flags`` reads the variable then).
    ``defaults``: an instance whose values are the flags' defaults (else the declared ones)."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        meta = _meta(f)
        tp, optional = _unwrap_optional(hints[f.name])
        if _is_config(tp):
            nested = getattr(defaults, f.name) if defaults is not None else None
            add_flags(parser, tp, prefix=f"{prefix}{f.name}_", defaults=nested)
            continue
        if meta is None or not meta.cli:
            continue
        if defaults is not None:
            default = getattr(defaults, f.name)
        elif f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = f.default_factory()  # type: ignore[misc]
        help_text, shown = meta.help, ""
        if meta.flag_default is not dataclasses.MISSING:
            default = meta.flag_default  # the help says what happens then
        elif meta.env:
            otherwise = "" if default is None else f", else {_default_text(default)}"
            shown = f" (default: {' or '.join(meta.env)}{otherwise})"
            default = None
        elif default is not None and not optional:
            shown = f" (default {_default_text(default)})" if tp is bool else " (default %(default)s)"
        kwargs: dict[str, Any] = {"dest": prefix + f.name, "default": default}
        choices = _choices(tp)
        if meta.parse is not None:
            kwargs["type"] = _flag_type(meta.parse)
            if choices is not None:
                kwargs["choices"] = choices  # checked on the parsed value
        elif tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif choices is not None:
            kwargs["choices"] = choices
            if isinstance(tp, type) and issubclass(tp, enum.Enum):
                kwargs["type"] = tp
        elif tp in (int, float, Path):
            kwargs["type"] = tp
        flag = _flag(f, meta, prefix)
        if meta.metavar:
            kwargs["metavar"] = meta.metavar
        elif tp is not bool and "choices" not in kwargs:  # named after the flag, not the dest
            kwargs["metavar"] = flag.lstrip("-").replace("-", "_").upper()
        kwargs["help"] = (help_text + shown).replace("%", "%%").replace("%%(default)s", "%(default)s")
        parser.add_argument(flag, **kwargs)


def from_flags(cls: type, args: argparse.Namespace, *, prefix: str = "",
               env: Mapping[str, str] | None = None, **overrides: Any) -> Any:
    """The ``cls`` that the parsed flags describe (``overrides`` win; a flag not given falls
    back on its variable in ``env``, default ``os.environ``); nested configs too.
    ValueError (from the config's own checks, or naming a bad variable) names a bad value."""
    hints, values = _hints(cls), {}
    from_env: dict[str, Any] | None = None
    for f in dataclasses.fields(cls):
        if f.name in overrides:
            continue
        tp, _ = _unwrap_optional(hints[f.name])
        if _is_config(tp):
            values[f.name] = from_flags(tp, args, prefix=f"{prefix}{f.name}_", env=env)
        elif (meta := _meta(f)) is not None and meta.cli and hasattr(args, prefix + f.name):
            value = getattr(args, prefix + f.name)
            if value is None and meta.env:
                from_env = env_values(cls, env) if from_env is None else from_env
                if f.name in from_env:
                    values[f.name] = from_env[f.name]
            else:
                values[f.name] = value
    values.update(overrides)
    return cls(**values)


def given_flags(cls: type, args: argparse.Namespace, *, prefix: str = "") -> dict[str, Any]:
    """The flags of ``cls``'s own fields as field -> value, those with a variable only where
    given (for a config that reads its environment itself, e.g. ``from_env(**given)``)."""
    values = {}
    for f in dataclasses.fields(cls):
        meta = _meta(f)
        if meta is None or not meta.cli or not hasattr(args, prefix + f.name):
            continue
        value = getattr(args, prefix + f.name)
        if value is not None or not meta.env:
            values[f.name] = value
    return values


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
