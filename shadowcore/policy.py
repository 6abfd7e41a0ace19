"""A shadow policy: a named bundle of strategies.

A policy plugin is a callable taking JSON keyword arguments and returning a
:class:`PolicySpec`. The spec holds *recipes* (:class:`Component`), not
objects: the composition root builds one slack controller per engine
instance and one predictor per deployment, each from the same recipe, in
whatever process runs the engine.

Invariants: building a spec validates every recipe once (so bad arguments
fail before anything runs); components receive randomness only through the
seeded ``numpy.random.Generator`` the root passes to those that accept an
``rng`` argument.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from shadowcore.config import PluginRef
from shadowcore.errors import ConfigError
from shadowcore.kv import KVClassPolicy
from shadowcore.registry import Registry, build_plugin
from shadowcore.registry import policies as _policies
from shadowcore.slack import SlackController
from shadowcore.switch import SwitchPredictor, Targeting


@attrs.frozen(eq=False)
class Component:
    """A recipe: ``cls(**kwargs)``, plus ``rng=`` when ``cls`` accepts it."""

    cls: type
    kwargs: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)

    def build(self, rng: np.random.Generator) -> Any:
        kwargs = dict(self.kwargs)
        if "rng" in inspect.signature(self.cls).parameters:
            kwargs["rng"] = rng
        return self.cls(**kwargs)


def _check(field: str, kind: type):
    def validator(_instance: Any, _attribute: Any, component: Component) -> None:
        if not (isinstance(component.cls, type) and issubclass(component.cls, kind)):
            raise ConfigError(field, component.cls, f"must be a {kind.__name__} subclass")
        try:
            component.build(np.random.default_rng(0))
        except ConfigError as e:
            raise ConfigError(f"{field}.{e.field}", e.value, e.problem) from None
        except TypeError as e:
            raise ConfigError(field, dict(component.kwargs), str(e)) from None

    return validator


@attrs.frozen(eq=False)
class PolicySpec:
    """Everything that makes one shadow policy.

    ``oracle``: switch calls find their prefix cached for free (no shadow work).
    ``dedicated_instances``: one extra instance per model runs all shadow work.
    """

    name: str
    description: str
    slack: Component = attrs.field(validator=_check("slack", SlackController))
    predictor: Component = attrs.field(validator=_check("predictor", SwitchPredictor))
    targeting: Targeting
    kv: KVClassPolicy = attrs.Factory(KVClassPolicy)
    oracle: bool = False
    dedicated_instances: bool = False


def load_policy(ref: PluginRef, registry: Registry = _policies, field: str = "policy") -> PolicySpec:
    """Resolve ``ref`` and call it with its arguments; errors name ``field``."""
    return build_plugin(registry, ref.name, ref.args, field, PolicySpec)
