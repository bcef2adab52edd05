"""Each setting is declared once: every config field has exactly one flag, and the flags,
the defaults, the environment variables and the range checks all come from that declaration."""

from __future__ import annotations

import argparse
import collections
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from sightline.collector.aggregation_config import AggregationConfig
from sightline.collector.config import CollectorConfig
from sightline.deploy.cli import build_parser
from sightline.instrumentation import (add_flags, check_settings, env_values, flag_names, from_flags,
                                       setting, undeclared)

# (config, the command whose parser carries its flags)
CONFIGS = [(CollectorConfig, ["collector", "run"]), (AggregationConfig, ["collector", "run"])]


def _subparser(path: list[str]) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in path:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


@pytest.mark.parametrize("config, command", CONFIGS, ids=[c.__name__ for c, _ in CONFIGS])
def test_every_config_field_has_exactly_one_flag(config, command):
    assert undeclared(config) == []
    flags = flag_names(config)
    options = collections.Counter(o for a in _subparser(command)._actions for o in a.option_strings)
    assert {path: options[flag] for path, flag in flags.items()} == {path: 1 for path in flags}
    assert len(set(flags.values())) == len(flags)


@pytest.mark.parametrize("config, command", CONFIGS, ids=[c.__name__ for c, _ in CONFIGS])
def test_no_flags_give_the_declared_defaults(config, command):
    assert from_flags(config, _subparser(command).parse_args([])) == config()


@dataclass(frozen=True)
class _Inner:
    depth: int = setting(3, "how deep", lo=1, hi=8)

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class _Example:
    rate: float = setting(0.5, "a fraction", lo=0.0, hi=1.0, env="EXAMPLE_RATE")
    mode: Literal["a", "b"] = setting("a", "which")
    on: bool = setting(False, "a switch")
    path: Path | None = setting(None, "a file")
    inner: _Inner = setting(factory=_Inner)

    def __post_init__(self) -> None:
        check_settings(self)


def _parse(*argv: str, env=None) -> _Example:
    parser = argparse.ArgumentParser()
    add_flags(parser, _Example, env=env or {})
    return from_flags(_Example, parser.parse_args(list(argv)))


def test_flag_beats_environment_beats_default():
    assert _parse() == _Example()
    assert _parse(env={"EXAMPLE_RATE": "0.25"}).rate == 0.25
    assert _parse("--rate", "0.75", env={"EXAMPLE_RATE": "0.25"}).rate == 0.75
    assert _parse("--mode", "b", "--on", "--path", "/x", "--inner-depth", "5") == _Example(
        0.5, "b", True, Path("/x"), _Inner(5))


def test_one_error_sentence_names_field_value_and_range():
    with pytest.raises(ValueError, match=r"^rate=1\.5 is not a number in \[0\.0, 1\.0\]$"):
        _Example(rate=1.5)
    with pytest.raises(ValueError, match=r"^depth=9 is not an integer in \[1, 8\]$"):
        _Inner(9)
    with pytest.raises(ValueError, match=r"^mode='c' is not one of a, b$"):
        _Example(mode="c")
    with pytest.raises(ValueError, match=r"^EXAMPLE_RATE='fast': "):
        env_values(_Example, {"EXAMPLE_RATE": "fast"})
