"""A shadow policy: a named bundle of strategies.

A policy plugin is a callable taking JSON keyword arguments and returning a
:class:`PolicySpec`. The spec holds *recipes* (:class:`Component`), not
objects: the composition root builds one slack controller per engine
instance and one predictor per deployment, each from the same recipe, in
whatever process runs the engine.

Invariants: building a spec validates every recipe once (so bad arguments
fail before anything runs); components receive randomness only through the
seeded ``numpy.random.Generator`` the root passes to those that accept an
``rng`` argument; a setting the deployment owns (a P/D cluster's iteration
bound, push size, block size) reaches a component from the root, never from
the recipe (a recipe that sets one is refused).
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
from shadowcore.pd import PushPolicy, ShadowPushPolicy
from shadowcore.registry import Registry, build_plugin
from shadowcore.registry import policies as _policies
from shadowcore.slack import SlackController
from shadowcore.switch import SwitchPredictor, Targeting


@attrs.frozen(eq=False)
class Component:
    """A recipe: ``cls(**kwargs)``, plus ``rng=`` when ``cls`` accepts it."""

    cls: type
    kwargs: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)

    def build(self, rng: np.random.Generator, **deployment: Any) -> Any:
        """``cls(**kwargs)`` with ``rng=`` and each of ``deployment`` (settings
        the composition root owns) that ``cls`` accepts."""
        params = inspect.signature(self.cls).parameters
        kwargs = dict(self.kwargs)
        for name, value in (("rng", rng), *deployment.items()):
            if name in params:
                kwargs[name] = value
        return self.cls(**kwargs)


def _check(field: str, kind: type, deployment: tuple[str, ...] = ()):
    def validator(_instance: Any, _attribute: Any, component: Component) -> None:
        if not (isinstance(component.cls, type) and issubclass(component.cls, kind)):
            raise ConfigError(field, component.cls, f"must be a {kind.__name__} subclass")
        for name in deployment:
            if name in component.kwargs:
                raise ConfigError(f"{field}.{name}", component.kwargs[name],
                                  "set by the deployment (the composition root passes it); leave it out of the recipe")
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

    P/D disaggregation (§3.5) reads two more slots. ``prefill_slack``: the
    controller of a prefill instance, built with the deployment's
    ``max_iteration_s``; ``None``: prefill instances run ``slack`` itself.
    ``push``: which shadow KV a decode instance pulls, built with the
    deployment's ``push_tokens`` and ``block_size``.
    """

    name: str
    description: str
    slack: Component = attrs.field(validator=_check("slack", SlackController))
    predictor: Component = attrs.field(validator=_check("predictor", SwitchPredictor))
    targeting: Targeting
    kv: KVClassPolicy = attrs.Factory(KVClassPolicy)
    oracle: bool = False
    dedicated_instances: bool = False
    prefill_slack: Component | None = attrs.field(
        default=None, validator=attrs.validators.optional(_check("prefill_slack", SlackController, ("max_iteration_s",))))
    push: Component = attrs.field(default=Component(ShadowPushPolicy),
                                  validator=_check("push", PushPolicy, ("push_tokens", "block_size")))


def load_policy(ref: PluginRef, registry: Registry = _policies, field: str = "policy") -> PolicySpec:
    """Resolve ``ref`` and call it with its arguments; errors name ``field``."""
    return build_plugin(registry, ref.name, ref.args, field, PolicySpec)
