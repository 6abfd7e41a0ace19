"""Per-step routers: which model serves a session's next call.

A router is a small strategy (:class:`Router`) registered in the entry-point
group ``shadowprefill.routers`` (or named ``package.module:Factory``); the
factory takes the JSON ``args`` of ``router:`` in the gateway configuration.
Routers are loaded lazily and guarded like policies (``shadowcore.registry``):
a broken plugin fails gateway start with one error naming it.

A router sees the call (:class:`RouteRequest`) and a read-only view of the
deployment (:class:`RouterView`): the configured models and prices, the
session's current model, and the warmth query (how many tokens of the next
prompt are expected to be cached on a model), so it can price a switch
(the paper's Appendix E).

Invariants: ``choose`` returns a configured model name or raises
:class:`RouteError` (the client gets a 4xx naming the problem); routers do not
read wall time or a global RNG (``markov`` hashes the session and call index
with its seed, so a replay routes the same way).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import attrs

from shadowcore._validators import non_negative_int, probability
from shadowcore.config import PluginRef
from shadowcore.registry import Registry, build_plugin, routers


class RouteError(ValueError):
    """The call cannot be routed (e.g. it names an unknown model)."""


@attrs.frozen
class RouteRequest:
    """One call as a router sees it."""

    session_id: str | None
    requested_model: str | None
    endpoint: str  # "chat" or "completions"
    body: Mapping[str, Any] = attrs.field(hash=False)
    num_calls: int = 0  # calls of this session routed before this one


@attrs.frozen
class Warmth:
    """Answer of the warmth query for one (session, model)."""

    session_id: str
    model: str
    instance_id: str | None
    num_history_tokens: int
    num_expected_cached_tokens: int
    num_shadow_inflight_tokens: int = 0


class RouterView(Protocol):
    """What the gateway shows a router."""

    @property
    def models(self) -> Sequence[str]: ...

    def price(self, model: str) -> tuple[float, float, float]:
        """(input, cached input, output) US dollars per million tokens."""
        ...

    def current_model(self, session_id: str) -> str | None: ...

    def warmth(self, session_id: str, model: str) -> Warmth: ...


class Router(ABC):
    """Strategy: the model for one call."""

    @abstractmethod
    def choose(self, call: RouteRequest, view: RouterView) -> str:
        """A name from ``view.models``."""


def _honour(call: RouteRequest, view: RouterView, default: str | None) -> str:
    name = call.requested_model or default
    if name is None:
        raise RouteError("the request names no model and the router has no default")
    if name not in view.models:
        raise RouteError(f"model {name!r} is not served here (models: {', '.join(view.models)})")
    return name


@attrs.frozen
class ClientModel(Router):
    """Honour the model the client named (``default`` when it names none)."""

    default: str | None = None

    def choose(self, call: RouteRequest, view: RouterView) -> str:
        return _honour(call, view, self.default)


@attrs.frozen
class Markov(Router):
    """A two-state-style Markov router (Appendix C): the session's next call
    switches to another model with probability ``switch_probability``, uniformly
    among the others; the first call goes to ``first`` (default: the client's
    model). Decisions are a hash of (seed, session, call index): reproducible."""

    switch_probability: float = attrs.field(default=0.3, validator=probability)
    seed: int = attrs.field(default=0, validator=non_negative_int)
    first: str | None = None

    def _uniform(self, session_id: str, index: int, salt: str) -> float:
        h = hashlib.blake2b(f"{self.seed}\x00{session_id}\x00{index}\x00{salt}".encode(), digest_size=8)
        return int.from_bytes(h.digest(), "little") / 2**64

    def choose(self, call: RouteRequest, view: RouterView) -> str:
        current = view.current_model(call.session_id) if call.session_id else None
        if current is None:
            return _honour(call, view, self.first or (view.models[0] if view.models else None))
        if self._uniform(call.session_id or "", call.num_calls, "switch") >= self.switch_probability:
            return current
        others = [m for m in view.models if m != current]
        if not others:
            return current
        return others[int(self._uniform(call.session_id or "", call.num_calls, "to") * len(others))]


@attrs.frozen
class WarmCost(Router):
    """Cheapest expected input bill for the next prompt among ``candidates``
    (default: every model), pricing cached tokens at the cached price: the
    warmth query lets a switch to a warm model cost what it really costs.
    Ties go to the session's current model, then to the order of ``candidates``."""

    candidates: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    def choose(self, call: RouteRequest, view: RouterView) -> str:
        names = self.candidates or tuple(view.models)
        unknown = [n for n in names if n not in view.models]
        if unknown:
            raise RouteError(f"router candidates name unknown models: {unknown}")
        if not call.session_id:
            return _honour(call, view, names[0])
        current = view.current_model(call.session_id)

        def cost(model: str) -> tuple[float, int, int]:
            w = view.warmth(call.session_id or "", model)
            price_in, price_cached, _ = view.price(model)
            uncached = w.num_history_tokens - w.num_expected_cached_tokens
            bill = uncached * price_in + w.num_expected_cached_tokens * price_cached
            return bill, 0 if model == current else 1, names.index(model)

        return min(names, key=cost)


def load_router(ref: PluginRef, registry: Registry = routers, field: str = "router") -> Router:
    """Resolve and build the configured router; errors name ``field``."""
    return build_plugin(registry, ref.name, ref.args, field, Router)
