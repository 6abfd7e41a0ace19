"""attrs validators for bounded numbers; every failure is a ConfigError that
names the attribute and the value (callers prefix the path of nested fields)."""

from __future__ import annotations

import math
from typing import Any

from shadowcore.errors import ConfigError


def _number(attribute: Any, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(attribute.name, value, "must be a number")
    if math.isnan(value):
        raise ConfigError(attribute.name, value, "must not be NaN")
    return float(value)


def non_negative(_instance: Any, attribute: Any, value: Any) -> None:
    if _number(attribute, value) < 0:
        raise ConfigError(attribute.name, value, "must be >= 0")


def positive(_instance: Any, attribute: Any, value: Any) -> None:
    if not _number(attribute, value) > 0:
        raise ConfigError(attribute.name, value, "must be > 0")


def fraction_open_closed(_instance: Any, attribute: Any, value: Any) -> None:
    """In (0, 1]."""
    v = _number(attribute, value)
    if not 0.0 < v <= 1.0:
        raise ConfigError(attribute.name, value, "must be in (0, 1]")


def probability(_instance: Any, attribute: Any, value: Any) -> None:
    """In [0, 1]."""
    v = _number(attribute, value)
    if not 0.0 <= v <= 1.0:
        raise ConfigError(attribute.name, value, "must be in [0, 1]")


def fraction_closed_open(_instance: Any, attribute: Any, value: Any) -> None:
    """In [0, 1)."""
    v = _number(attribute, value)
    if not 0.0 <= v < 1.0:
        raise ConfigError(attribute.name, value, "must be in [0, 1)")


def _int(attribute: Any, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(attribute.name, value, "must be an integer")
    return value


def non_negative_int(_instance: Any, attribute: Any, value: Any) -> None:
    if _int(attribute, value) < 0:
        raise ConfigError(attribute.name, value, "must be an integer >= 0")


def positive_int(_instance: Any, attribute: Any, value: Any) -> None:
    if _int(attribute, value) < 1:
        raise ConfigError(attribute.name, value, "must be an integer >= 1")


def non_empty_str(_instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(attribute.name, value, "must be a non-empty string")


def one_of(*choices: str) -> Any:
    """A validator: the value is one of ``choices`` (strings)."""

    def check(_instance: Any, attribute: Any, value: Any) -> None:
        if value not in choices:
            raise ConfigError(attribute.name, value, f"must be one of {', '.join(map(repr, choices))}")

    return check
