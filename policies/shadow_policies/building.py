"""Helpers for writing a shadow policy plugin the way the built-in ones are written.

A policy plugin is a function of JSON keyword arguments returning a
:class:`~shadowcore.policy.PolicySpec` (see ``docs/writing-policies.md``).
The built-in policies (:mod:`shadow_policies.paper`, ``adaptive-host``,
``benefit-host``) are all built from these pieces, and a third-party policy
may use them too:

* :func:`policy_spec`: a spec with the paper's KV, host-tier and predictor
  defaults, accepting the shared KV keywords (:data:`KV_ARGS`);
* :func:`slo_slack`: the SLO-slack controller recipe (Harvest-SLO's);
* :func:`prefill_slack_for`: the P/D prefill-instance controller recipe that
  goes with a colocated one (§3.5);
* :func:`targeting_from`: ``top_k`` / ``gate`` keywords to a
  :class:`~shadowcore.switch.Targeting`;
* :func:`user_args`: a decorator that rejects unknown keywords and reports a
  component's bad value under the keyword the user wrote.

Invariants: every helper is a pure function of its arguments (no clock, no
RNG, no module state); building a spec validates every recipe once, so a bad
argument fails when the policy is loaded, with a
:class:`~shadowcore.errors.ConfigError` naming that argument.

This module lives with the policies, not in ``shadowcore``: the defaults it
applies (host tier size, PCIe rate, shadow cap, cold age) are the paper's
choices, and the core stays free of any particular policy.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import attrs

from shadowcore.errors import ConfigError
from shadowcore.kv import HostTierParams, KVClassPolicy
from shadowcore.policy import Component, PolicySpec
from shadowcore.slack import HarvestController, PrefillInstanceController, SloSlackController
from shadowcore.switch import AllOthers, EmpiricalSwitchPredictor, ProbabilityGate, Targeting, TopK

#: Host-tier capacity per GPU in bytes (the paper's 32 GB).
HOST_CAPACITY_BYTES = 32e9
#: Host-to-device bandwidth for host-tier reloads in bytes/s (the paper's 25 GB/s).
PCIE_BYTES_PER_S = 25e9

#: Keywords every policy built with :func:`policy_spec` accepts through ``**kv``
#: (passed on to the KV class rules and the predictor); :func:`user_args`
#: accepts them for any factory that has a ``**kv`` parameter.
KV_ARGS = frozenset({"shadow_cap", "cold_age_s", "host_capacity_bytes", "pcie_bytes_per_s", "pseudo_count",
                     "eviction_order"})

#: Where a validator reports a bad value (component field) -> the keyword the
#: user wrote, so that ``load_policy`` says ``policy.args.shadow_cap = 0``
#: rather than ``policy.args.shadow_cap_fraction`` or ``policy.args.slack.beta``.
USER_ARG_NAMES = {
    "slack.beta": "beta",
    "slack.delta": "delta",
    "slack.n_min": "n_min",
    "slack.margin": "margin",
    "slack.chunk_tokens": "chunk_tokens",
    "slack.routed_decode_margin": "routed_decode_margin",
    "predictor.pseudo_count": "pseudo_count",
    "shadow_cap_fraction": "shadow_cap",
    "cold_age_s": "cold_age_s",
    "capacity_bytes": "host_capacity_bytes",
    "pcie_bytes_per_s": "pcie_bytes_per_s",
    "k": "top_k",
    "threshold": "gate",
}


def _accepted(factory: Callable[..., PolicySpec]) -> frozenset[str]:
    params = inspect.signature(factory).parameters
    named = {n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    has_kv = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return frozenset(named | (KV_ARGS if has_kv else set()))


def user_args(factory: Callable[..., PolicySpec]) -> Callable[..., PolicySpec]:
    """Decorate a policy factory so that its errors name the user's keywords.

    The wrapped factory rejects a keyword that is neither one of its named
    parameters nor (when it has ``**kv``) one of :data:`KV_ARGS`, with a
    ``ConfigError`` that lists the known ones; and a ``ConfigError`` raised by
    a component under a field in :data:`USER_ARG_NAMES` (``slack.beta``,
    ``shadow_cap_fraction``, ...) is re-raised under the keyword
    (``beta``, ``shadow_cap``, ...). Other errors pass through unchanged.
    """

    @functools.wraps(factory)
    def wrapper(*args, **kwargs) -> PolicySpec:
        unknown = sorted(set(kwargs) - _accepted(factory))
        if unknown:
            known = ", ".join(sorted(_accepted(factory)))
            raise ConfigError(unknown[0], kwargs[unknown[0]], f"unknown argument of this policy (known: {known})")
        try:
            return factory(*args, **kwargs)
        except ConfigError as e:
            if e.field not in USER_ARG_NAMES:
                raise
            raise ConfigError(USER_ARG_NAMES[e.field], e.value, e.problem) from None

    return wrapper


def _kv(shadow_cap: float, cold_age_s: float, host: bool, host_capacity_bytes: float,
        pcie_bytes_per_s: float, eviction_order: str) -> KVClassPolicy:
    tier = HostTierParams(host_capacity_bytes, pcie_bytes_per_s)  # validated even when unused
    return KVClassPolicy(shadow_cap, cold_age_s, tier if host else None, eviction_order)


def targeting_from(top_k: int | None, gate: float | None) -> Targeting:
    """``TopK(top_k)``, ``ProbabilityGate(gate)``, or ``AllOthers()`` when neither
    is given (the paper's default); giving both raises ``TypeError``."""
    if top_k is not None and gate is not None:
        raise TypeError("give either top_k or gate, not both")
    if top_k is not None:
        return TopK(top_k)
    if gate is not None:
        return ProbabilityGate(gate)
    return AllOthers()


def slo_slack(beta: float, delta: float, n_min: int, margin: float, chunk_tokens: int,
              credit_accrual: str = "routed") -> Component:
    """The recipe of Harvest-SLO's :class:`~shadowcore.slack.SloSlackController`
    (Algorithm 1 with the Eq. 1 SLO margin). ``credit_accrual``: which
    decode-only iterations earn the routed-step credit
    (:class:`~shadowcore.slack.CreditAccrual`; ``"routed"``, the paper's delta
    guarantee, is the controller's default and is then left out of the args)."""
    args = {"beta": beta, "delta": delta, "n_min": n_min, "margin": margin, "chunk_tokens": chunk_tokens}
    if credit_accrual != "routed":
        args["credit_accrual"] = credit_accrual
    return Component(SloSlackController, args)


def prefill_slack_for(slack: Component) -> Component | None:
    """§3.5: what a P/D prefill instance runs for a policy whose colocated
    controller is ``slack``. A harvesting one (Harvest, Harvest-SLO)
    becomes :class:`~shadowcore.slack.PrefillInstanceController` with the
    policy's ``n_min`` (and ``margin``/``chunk_tokens`` where it has them; the
    deployment gives ``max_iteration_s``); any other (No Shadow, Eager) gives
    ``None``: prefill instances run ``slack`` itself."""
    if not issubclass(slack.cls, (SloSlackController, HarvestController)):
        return None
    given = {**{f.name: f.default for f in attrs.fields(slack.cls) if f.init}, **slack.kwargs}
    args = {"margin": given.get("margin", 0.1), "n_min": given["n_min"], "chunk_tokens": given.get("chunk_tokens", 2048)}
    return Component(PrefillInstanceController, args)


def policy_spec(name: str, description: str, slack: Component, *, host: bool = False,
                targeting: Targeting | None = None, oracle: bool = False, dedicated: bool = False,
                shadow_cap: float = 0.25, cold_age_s: float = 5.0, host_capacity_bytes: float = HOST_CAPACITY_BYTES,
                pcie_bytes_per_s: float = PCIE_BYTES_PER_S, pseudo_count: float = 1.0,
                eviction_order: str = "shadow-first") -> PolicySpec:
    """A :class:`~shadowcore.policy.PolicySpec` with the paper's defaults.

    ``slack`` is the controller recipe; ``targeting`` defaults to
    :class:`~shadowcore.switch.AllOthers`; the predictor is
    ``EmpiricalSwitchPredictor(pseudo_count)`` (replace it with
    ``attrs.evolve(spec, predictor=...)``); P/D prefill instances run
    :func:`prefill_slack_for` ``(slack)``; ``host`` adds the host tier
    (``host_capacity_bytes`` per GPU at ``pcie_bytes_per_s``, validated even
    when ``host`` is off); ``shadow_cap`` is the shadow class's share of the KV
    pool and ``cold_age_s`` the idle age after which a block may be taken by a
    shadow chunk; ``eviction_order`` is ``"shadow-first"`` (the paper's
    evict-first shadow class) or ``"lru"`` (one LRU over both classes,
    :class:`~shadowcore.kv.KVClassPolicy`). The keyword-only KV arguments are exactly :data:`KV_ARGS`,
    so a factory can pass its ``**kv`` straight through.
    """
    return PolicySpec(
        name, description, slack, Component(EmpiricalSwitchPredictor, {"pseudo_count": pseudo_count}),
        targeting or AllOthers(),
        _kv(shadow_cap, cold_age_s, host, host_capacity_bytes, pcie_bytes_per_s, eviction_order),
        oracle, dedicated, prefill_slack_for(slack),
    )


__all__ = [
    "HOST_CAPACITY_BYTES",
    "KV_ARGS",
    "PCIE_BYTES_PER_S",
    "USER_ARG_NAMES",
    "policy_spec",
    "prefill_slack_for",
    "slo_slack",
    "targeting_from",
    "user_args",
]
