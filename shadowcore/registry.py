"""Plugins: entry-point groups resolved lazily, plus ``package.module:Object``.

Groups: ``shadowprefill.policies`` (factories returning a
:class:`~shadowcore.policy.PolicySpec`), ``shadowprefill.backends``
(backend factories), ``shadowprefill.routers`` (the gateway's per-step
routers) and ``shadowprefill.commands`` (subcommands of the ``shadowprefill``
command: ``main(argv) -> int`` callables that parse their own arguments; the
first line of the callable's docstring is the command's description). Built-in policies and backends register through the same
entry points as third-party ones (see ``pyproject.toml``).

Invariants:

* Listing names never imports a plugin; a plugin is imported when its name is
  looked up, once, and cached.
* A name registered twice with different targets raises :class:`PluginError`
  naming both targets, but only when that name is looked up.
* A plugin that fails to import raises :class:`PluginError` naming the plugin,
  the group and the cause; other lookups are unaffected.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from shadowcore.errors import ConfigError, PluginError

POLICY_GROUP = "shadowprefill.policies"
BACKEND_GROUP = "shadowprefill.backends"
COMMAND_GROUP = "shadowprefill.commands"
ROUTER_GROUP = "shadowprefill.routers"


@attrs.frozen
class PluginEntry:
    name: str
    target: str  # "package.module:Object"
    distribution: str


def load_reference(ref: str) -> Any:
    """Import ``package.module:Object`` (``Object`` may be dotted)."""
    module_name, sep, attr_path = ref.partition(":")
    if not sep or not module_name or not attr_path:
        raise PluginError(f"plugin reference {ref!r} is not of the form 'package.module:Object'")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr_path.split("."):
            obj = getattr(obj, part)
    except Exception as exc:
        raise PluginError(f"plugin reference {ref!r} failed to load: {exc!r}") from exc
    return obj


def _installed(group: str) -> Iterable[PluginEntry]:
    for ep in md.entry_points(group=group):
        dist = ep.dist.name if ep.dist is not None else "?"
        yield PluginEntry(ep.name, ep.value, dist)


@attrs.define(eq=False)
class Registry:
    """One entry-point group."""

    group: str
    source: Callable[[str], Iterable[PluginEntry]] = _installed
    _loaded: dict[str, Any] = attrs.field(init=False, factory=dict)

    def entries(self) -> dict[str, list[PluginEntry]]:
        """Name -> distinct targets registered under it (more than one: a conflict)."""
        out: dict[str, list[PluginEntry]] = {}
        for e in self.source(self.group):
            same = out.setdefault(e.name, [])
            if all(x.target != e.target for x in same):
                same.append(e)
        return dict(sorted(out.items()))

    def names(self) -> list[str]:
        return list(self.entries())

    def load(self, name: str) -> Any:
        """The object registered as ``name``, or named by a ``pkg.mod:Obj`` reference."""
        if name in self._loaded:
            return self._loaded[name]
        if ":" in name:
            obj = load_reference(name)
        else:
            found = self.entries().get(name)
            if not found:
                known = ", ".join(self.names()) or "none"
                raise PluginError(f"unknown plugin {name!r} in group {self.group} (known: {known})")
            if len(found) > 1:
                targets = "; ".join(f"{e.target} from {e.distribution}" for e in found)
                raise PluginError(f"plugin {name!r} in group {self.group} is registered twice: {targets}")
            try:
                obj = load_reference(found[0].target)
            except PluginError as exc:
                raise PluginError(
                    f"plugin {name!r} in group {self.group} ({found[0].target}, "
                    f"from {found[0].distribution}) is broken: {exc.__cause__!r}"
                ) from exc.__cause__
        self._loaded[name] = obj
        return obj

    def describe_target(self, name: str) -> str:
        """``'name' in group G (target, from dist)`` for messages; ``name`` alone for ``pkg.mod:Obj``."""
        if ":" in name:
            return repr(name)
        found = self.entries().get(name) or []
        where = f" ({found[0].target}, from {found[0].distribution})" if len(found) == 1 else ""
        return f"{name!r} in group {self.group}{where}"


policies = Registry(POLICY_GROUP)
backends = Registry(BACKEND_GROUP)
commands = Registry(COMMAND_GROUP)
routers = Registry(ROUTER_GROUP)  # the gateway's per-step routers (shadow_gateway.router)


def build_plugin(registry: Registry, name: str, args: Any, field: str, kind: type) -> Any:
    """Call the factory registered as ``name`` with ``args`` and check it built a
    ``kind``; every failure is one :class:`ConfigError` naming ``field``
    (``field.name`` for the plugin, ``field.args...`` for its arguments; a
    TypeError counts as the arguments'). Any other exception from inside the factory
    (a bug) is reported on ``field.name`` naming the plugin, its target and the
    exception, with the original chained as ``__cause__`` for a debugger."""
    try:
        factory = registry.load(name)
    except PluginError as e:
        raise ConfigError(f"{field}.name", name, str(e)) from None
    try:
        built = factory(**args)
    except ConfigError as e:
        raise ConfigError(f"{field}.args.{e.field}", e.value, e.problem) from None
    except TypeError as e:  # arguments that do not fit (also a factory's own "give a or b, not both")
        raise ConfigError(f"{field}.args", dict(args), str(e)) from None
    except Exception as e:
        # A bug inside the factory: one line naming the plugin; the traceback stays chained.
        raise ConfigError(f"{field}.name", name, f"plugin {registry.describe_target(name)} failed while "
                                                 f"building: {type(e).__name__}: {e}") from e
    if not isinstance(built, kind):
        raise ConfigError(f"{field}.name", name, f"returned {type(built).__name__}, not a {kind.__name__}")
    return built
