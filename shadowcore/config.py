"""Configuration: plugin references with JSON-only arguments, validated
before anything runs.

A configuration is plain JSON so that another process (vLLM's engine core, a
Ray worker) rebuilds identical objects from it. Every validation failure is
one :class:`~shadowcore.errors.ConfigError` whose message starts with the
field's full path and its value, e.g. ``policy.args.beta = -1: must be > 0``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import attrs

from shadowcore._validators import non_empty_str, non_negative_int, positive
from shadowcore.errors import ConfigError


def check_json(field: str, value: Any) -> None:
    """Raise unless ``value`` is made of JSON types only (no NaN or infinity)."""
    if value is None or isinstance(value, (bool, str)):
        return
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(field, value, "is not a finite JSON number")
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_json(f"{field}[{i}]", v)
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(field, k, "has a key that is not a string")
            check_json(f"{field}.{k}", v)
        return
    raise ConfigError(field, value, f"is a {type(value).__name__}, not a JSON value")


@attrs.frozen
class PluginRef:
    """A registered plugin name (or ``package.module:Object``) and its JSON arguments."""

    name: str = attrs.field(validator=non_empty_str)
    args: Mapping[str, Any] = attrs.field(factory=dict, converter=dict, hash=False)

    def __attrs_post_init__(self) -> None:
        check_json("args", self.args)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "args": json.loads(json.dumps(self.args))}

    @classmethod
    def parse(cls, field: str, value: Any) -> PluginRef:
        """From configuration: a string in the command-line syntax (``NAME`` or
        ``NAME:{json}``, see :func:`parse_ref`) or ``{"name": ..., "args": {...}}``."""
        if isinstance(value, str):
            return parse_ref(value, field)
        if not isinstance(value, Mapping):
            raise ConfigError(field, value, "must be a plugin name or {'name': ..., 'args': {...}}")
        unknown = set(value) - {"name", "args"}
        if unknown:
            raise ConfigError(f"{field}.{min(unknown)}", value[min(unknown)], "unknown field")
        try:
            return cls(value.get("name", ""), value.get("args", {}))
        except ConfigError as e:
            raise ConfigError(f"{field}.{e.field}", e.value, e.problem) from None


def policy_label(ref: PluginRef) -> str:
    """A policy's name in tables and result folders: its name, plus its
    arguments if any, ``name(k=v,...)`` (sorted by key), so that two variants
    of one policy never print the same row name."""
    if not ref.args:
        return ref.name
    return ref.name + "(" + ",".join(f"{k}={v}" for k, v in sorted(ref.args.items())) + ")"


# -- the one text syntax of plugin references ------------------------------------------------
#
# ``NAME`` or ``NAME:{JSON object of arguments}``, several separated by commas:
#     no-shadow,harvest-slo:{"beta": 0.3, "delta": 0.1},my_pkg.policies:factory
# A comma splits only outside the JSON (strings, nested objects and lists are read by
# the JSON decoder itself); a colon starts arguments only when a ``{`` follows it, so
# ``package.module:Object`` names keep their colon. Every command and configuration
# file reads references through these two functions (one owner of the syntax).


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicate_keys)


def _args_start(text: str, colon: int) -> int | None:
    """Index of the ``{`` that opens arguments after the colon at ``colon``, else None."""
    k = colon + 1
    while k < len(text) and text[k].isspace():
        k += 1
    return k if k < len(text) and text[k] == "{" else None


def _decode_args(text: str, start: int, name: str, field: str) -> tuple[dict[str, Any], int]:
    try:
        return _DECODER.raw_decode(text, start)
    except json.JSONDecodeError as e:
        raise ConfigError(field, text, f"{name}: arguments are not JSON: {e.msg} at column {e.pos + 1}") from None
    except ValueError as e:  # a duplicate key
        raise ConfigError(field, text, f"{name}: arguments are not JSON: {e} (at column {start + 1})") from None


def split_refs(text: str, field: str = "--policies") -> list[tuple[str, dict[str, Any]]]:
    """``(name, args)`` of each reference in the comma list ``text``, in order.

    Errors are one :class:`ConfigError` on ``field`` whose problem names the
    reference and the 1-based column in ``text``: bad JSON, an empty name (``a,,b``,
    a trailing comma), a bracket or quote in a name, text after the arguments."""
    out: list[tuple[str, dict[str, Any]]] = []
    i = 0
    while True:
        j, args_at = i, None
        while j < len(text) and text[j] != ",":
            if text[j] == ":" and (args_at := _args_start(text, j)) is not None:
                break
            if text[j] in '{}[]"':
                raise ConfigError(field, text, f"{text[j]!r} at column {j + 1} inside a name "
                                               "(arguments go after a colon: NAME:{...})")
            j += 1
        name = text[i:j].strip()
        if not name:
            raise ConfigError(field, text, f"empty name at column {i + 1}")
        args: dict[str, Any] = {}
        if args_at is not None:
            args, j = _decode_args(text, args_at, name, field)
            while j < len(text) and text[j].isspace():
                j += 1
            if j < len(text) and text[j] != ",":
                raise ConfigError(field, text, f"{name}: {text[j]!r} at column {j + 1} after the arguments "
                                               "(separate references with commas)")
        out.append((name, args))
        if j >= len(text):
            return out
        i = j + 1


def parse_refs(text: str, field: str = "--policies") -> list[PluginRef]:
    """The plugin references in the comma list ``text`` (see :func:`split_refs`);
    a bad argument value is reported on ``"{field} {name}.args..."``."""
    return [PluginRef.parse(f"{field} {name}", {"name": name, "args": args}) for name, args in split_refs(text, field)]


def parse_ref(text: str, field: str = "--policy") -> PluginRef:
    """Exactly one plugin reference, ``NAME`` or ``NAME:{json}``; errors name ``field``."""
    items = split_refs(text, field)
    if len(items) != 1:
        raise ConfigError(field, text, f"one reference expected, got {len(items)} "
                                       f"({', '.join(n for n, _ in items)})")
    name, args = items[0]
    return PluginRef.parse(field, {"name": name, "args": args})


@attrs.frozen
class SloConfig:
    """Service-level objectives of routed and normal requests on one model."""

    ttft_s: float = attrs.field(default=1.0, validator=positive)
    tpot_s: float = attrs.field(default=0.025, validator=positive)


@attrs.frozen
class ShadowConfig:
    """What the composition root needs: the policy, the seed, observers."""

    policy: PluginRef = attrs.field(factory=lambda: PluginRef("harvest-slo"))
    seed: int = attrs.field(default=0, validator=non_negative_int)
    observers: tuple[PluginRef, ...] = attrs.field(default=(), converter=tuple)

    def to_json(self) -> str:
        return json.dumps(
            {"policy": self.policy.to_dict(), "seed": self.seed,
             "observers": [o.to_dict() for o in self.observers]},
            sort_keys=True,
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], field: str = "shadow") -> ShadowConfig:
        if not isinstance(data, Mapping):
            raise ConfigError(field, data, "must be a mapping")
        unknown = set(data) - {"policy", "seed", "observers"}
        if unknown:
            k = min(unknown)
            raise ConfigError(f"{field}.{k}", data[k], "unknown field")
        policy = PluginRef.parse(f"{field}.policy", data.get("policy", "harvest-slo"))
        observers = tuple(
            PluginRef.parse(f"{field}.observers[{i}]", o) for i, o in enumerate(data.get("observers", []))
        )
        try:
            return cls(policy, data.get("seed", 0), observers)
        except ConfigError as e:
            raise ConfigError(f"{field}.{e.field}", e.value, e.problem) from None

    @classmethod
    def from_json(cls, text: str, source: str = "shadow") -> ShadowConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            line = text.splitlines()[e.lineno - 1] if text.splitlines() else text
            raise ConfigError(f"{source}:{e.lineno}:{e.colno}", line, e.msg) from None
        return cls.from_dict(data)


def build_attrs(cls: type, field: str, data: Mapping[str, Any]) -> Any:
    """``cls(**data)`` with errors re-raised as ConfigError under ``field``."""
    if not isinstance(data, Mapping):
        raise ConfigError(field, data, "must be a mapping")
    names = {a.name for a in attrs.fields(cls) if a.init}
    for k in data:
        if k not in names:
            raise ConfigError(f"{field}.{k}", data[k], f"unknown field (known: {', '.join(sorted(names))})")
    try:
        return cls(**data)
    except ConfigError as e:
        raise ConfigError(f"{field}.{e.field}", e.value, e.problem) from None
