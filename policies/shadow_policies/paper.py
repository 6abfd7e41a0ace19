"""Table 2 of the paper: No Shadow, Host Tier, Harvest, Harvest-SLO,
Harvest-SLO+Host, Predictive, Dedicated, Eager, Oracle, Oracle+Host.

Defaults are the paper's: beta=0.5, delta=0.1 (Harvest) / 0.025 (Harvest-SLO),
n_min=256 tokens, shadow cap 25% of the KV pool, cold age 5 s, host tier
32 GB per GPU at 25 GB/s, Predictive gate 0.25. Every function accepts the
same KV and targeting keywords so that sweeps can vary them uniformly:
``top_k`` (shadow to the k most likely next models; default all others) and
``gate`` (minimum switch probability).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from shadowcore.errors import ConfigError
from shadowcore.kv import HostTierParams, KVClassPolicy
from shadowcore.policy import Component, PolicySpec
from shadowcore.slack import (
    EagerController,
    HarvestController,
    NoShadowController,
    SloSlackController,
)
from shadowcore.switch import AllOthers, EmpiricalSwitchPredictor, NoTargets, ProbabilityGate, Targeting, TopK

HOST_CAPACITY_BYTES = 32e9
PCIE_BYTES_PER_S = 25e9


#: Where a validator reports a bad value (component field) -> the keyword the
#: user wrote, so that ``load_policy`` says ``policy.args.shadow_cap = 0``
#: rather than ``policy.args.shadow_cap_fraction`` or ``policy.args.slack.beta``.
_USER_ARG = {
    "slack.beta": "beta",
    "slack.delta": "delta",
    "slack.n_min": "n_min",
    "slack.margin": "margin",
    "slack.chunk_tokens": "chunk_tokens",
    "predictor.pseudo_count": "pseudo_count",
    "shadow_cap_fraction": "shadow_cap",
    "cold_age_s": "cold_age_s",
    "capacity_bytes": "host_capacity_bytes",
    "pcie_bytes_per_s": "pcie_bytes_per_s",
    "k": "top_k",
    "threshold": "gate",
}


#: Keywords every policy passes through ``**kv`` to the KV class and predictor.
_KV_ARGS = frozenset({"shadow_cap", "cold_age_s", "host_capacity_bytes", "pcie_bytes_per_s", "pseudo_count"})


def _accepted(factory: Callable[..., PolicySpec]) -> frozenset[str]:
    params = inspect.signature(factory).parameters
    named = {n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    has_kv = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return frozenset(named | (_KV_ARGS if has_kv else set()))


def _user_args(factory: Callable[..., PolicySpec]) -> Callable[..., PolicySpec]:
    """Re-raise a component's ConfigError under the keyword argument it came from."""

    @functools.wraps(factory)
    def wrapper(*args, **kwargs) -> PolicySpec:
        unknown = sorted(set(kwargs) - _accepted(factory))
        if unknown:
            known = ", ".join(sorted(_accepted(factory)))
            raise ConfigError(unknown[0], kwargs[unknown[0]], f"unknown argument of this policy (known: {known})")
        try:
            return factory(*args, **kwargs)
        except ConfigError as e:
            if e.field not in _USER_ARG:
                raise
            raise ConfigError(_USER_ARG[e.field], e.value, e.problem) from None

    return wrapper


def _kv(shadow_cap: float, cold_age_s: float, host: bool, host_capacity_bytes: float,
        pcie_bytes_per_s: float) -> KVClassPolicy:
    tier = HostTierParams(host_capacity_bytes, pcie_bytes_per_s)  # validated even when unused
    return KVClassPolicy(shadow_cap, cold_age_s, tier if host else None)


def _targeting(top_k: int | None, gate: float | None) -> Targeting:
    if top_k is not None and gate is not None:
        raise TypeError("give either top_k or gate, not both")
    if top_k is not None:
        return TopK(top_k)
    if gate is not None:
        return ProbabilityGate(gate)
    return AllOthers()


def _predictor(pseudo_count: float) -> Component:
    return Component(EmpiricalSwitchPredictor, {"pseudo_count": pseudo_count})


def _spec(name: str, description: str, slack: Component, *, host: bool = False, targeting: Targeting | None = None,
          oracle: bool = False, dedicated: bool = False, shadow_cap: float = 0.25, cold_age_s: float = 5.0,
          host_capacity_bytes: float = HOST_CAPACITY_BYTES, pcie_bytes_per_s: float = PCIE_BYTES_PER_S,
          pseudo_count: float = 1.0) -> PolicySpec:
    return PolicySpec(
        name, description, slack, _predictor(pseudo_count), targeting or AllOthers(),
        _kv(shadow_cap, cold_age_s, host, host_capacity_bytes, pcie_bytes_per_s), oracle, dedicated,
    )


@_user_args
def no_shadow(**kv) -> PolicySpec:
    return _spec("no-shadow", "Cold switch; the baseline.", Component(NoShadowController), targeting=NoTargets(), **kv)


@_user_args
def host_tier(**kv) -> PolicySpec:
    return _spec("host-tier", "No Shadow with the host-DRAM KV tier.", Component(NoShadowController),
                 targeting=NoTargets(), host=True, **kv)


@_user_args
def harvest(beta: float = 0.5, delta: float = 0.1, n_min: int = 256, top_k: int | None = None,
            gate: float | None = None, **kv) -> PolicySpec:
    return _spec("harvest", "Shadow jobs under a fixed credit (delta=0.1).",
                 Component(HarvestController, {"beta": beta, "delta": delta, "n_min": n_min}),
                 targeting=_targeting(top_k, gate), **kv)


def _slo(beta: float, delta: float, n_min: int, margin: float, chunk_tokens: int) -> Component:
    return Component(SloSlackController, {"beta": beta, "delta": delta, "n_min": n_min, "margin": margin,
                                          "chunk_tokens": chunk_tokens})


@_user_args
def harvest_slo(beta: float = 0.5, delta: float = 0.025, n_min: int = 256, margin: float = 0.1,
                chunk_tokens: int = 2048, top_k: int | None = None, gate: float | None = None, **kv) -> PolicySpec:
    return _spec("harvest-slo", "Shadow jobs under the SLO-slack controller.",
                 _slo(beta, delta, n_min, margin, chunk_tokens), targeting=_targeting(top_k, gate), **kv)


@_user_args
def harvest_slo_host(beta: float = 0.5, delta: float = 0.025, n_min: int = 256, margin: float = 0.1,
                     chunk_tokens: int = 2048, top_k: int | None = None, gate: float | None = None,
                     **kv) -> PolicySpec:
    return _spec("harvest-slo-host", "Harvest-SLO with the host tier (the complete design).",
                 _slo(beta, delta, n_min, margin, chunk_tokens), targeting=_targeting(top_k, gate), host=True, **kv)


@_user_args
def predictive(beta: float = 0.5, delta: float = 0.1, n_min: int = 256, gate: float = 0.25, **kv) -> PolicySpec:
    return _spec("predictive", "Harvest, gated on switch probability >= 0.25.",
                 Component(HarvestController, {"beta": beta, "delta": delta, "n_min": n_min}),
                 targeting=ProbabilityGate(gate), **kv)


@_user_args
def dedicated(top_k: int | None = None, gate: float | None = None, **kv) -> PolicySpec:
    return _spec("dedicated", "One extra instance per model runs all shadow work (+25% GPUs).",
                 Component(EagerController), targeting=_targeting(top_k, gate), dedicated=True, **kv)


@_user_args
def eager(top_k: int | None = None, gate: float | None = None, **kv) -> PolicySpec:
    return _spec("eager", "Shadow work as normal-priority requests.", Component(EagerController),
                 targeting=_targeting(top_k, gate), **kv)


@_user_args
def oracle(**kv) -> PolicySpec:
    return _spec("oracle", "Switch call's prefix cached for free.", Component(NoShadowController),
                 targeting=NoTargets(), oracle=True, **kv)


@_user_args
def oracle_host(**kv) -> PolicySpec:
    return _spec("oracle-host", "Oracle with the host tier.", Component(NoShadowController),
                 targeting=NoTargets(), oracle=True, host=True, **kv)
