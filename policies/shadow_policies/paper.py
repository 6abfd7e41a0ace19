"""Table 2 of the paper: No Shadow, Host Tier, Harvest, Harvest-SLO,
Harvest-SLO+Host, Predictive, Dedicated, Eager, Oracle, Oracle+Host.

Defaults are the paper's: beta=0.5, delta=0.1 (Harvest) / 0.025 (Harvest-SLO;
its credit accrues on decode-only iterations that carry a routed call, the
paper's delta guarantee; ``credit_accrual="all-decode"`` is the other reading),
n_min=256 tokens, shadow cap 25% of the KV pool, cold age 5 s, host tier
32 GB per GPU at 25 GB/s, Predictive gate 0.25. Every function accepts the
same KV and targeting keywords so that sweeps can vary them uniformly:
``top_k`` (shadow to the k most likely next models; default all others) and
``gate`` (minimum switch probability). They are built from the public helpers
in :mod:`shadow_policies.building`, as a third-party policy can be.
"""

from __future__ import annotations

from shadow_policies.building import policy_spec, slo_slack, targeting_from, user_args
from shadowcore.policy import Component, PolicySpec
from shadowcore.slack import EagerController, HarvestController, NoShadowController
from shadowcore.switch import NoTargets, ProbabilityGate


@user_args
def no_shadow(**kv) -> PolicySpec:
    return policy_spec("no-shadow", "Cold switch; the baseline.", Component(NoShadowController),
                       targeting=NoTargets(), **kv)


@user_args
def host_tier(**kv) -> PolicySpec:
    return policy_spec("host-tier", "No Shadow with the host-DRAM KV tier.", Component(NoShadowController),
                       targeting=NoTargets(), host=True, **kv)


@user_args
def harvest(beta: float = 0.5, delta: float = 0.1, n_min: int = 256, top_k: int | None = None,
            gate: float | None = None, **kv) -> PolicySpec:
    return policy_spec("harvest", "Shadow jobs under a fixed credit (delta=0.1).",
                       Component(HarvestController, {"beta": beta, "delta": delta, "n_min": n_min}),
                       targeting=targeting_from(top_k, gate), **kv)


@user_args
def harvest_slo(beta: float = 0.5, delta: float = 0.025, n_min: int = 256, margin: float = 0.1,
                chunk_tokens: int = 2048, top_k: int | None = None, gate: float | None = None,
                credit_accrual: str = "routed", **kv) -> PolicySpec:
    return policy_spec("harvest-slo", "Shadow jobs under the SLO-slack controller.",
                       slo_slack(beta, delta, n_min, margin, chunk_tokens, credit_accrual),
                       targeting=targeting_from(top_k, gate),
                       **kv)


@user_args
def harvest_slo_host(beta: float = 0.5, delta: float = 0.025, n_min: int = 256, margin: float = 0.1,
                     chunk_tokens: int = 2048, top_k: int | None = None, gate: float | None = None,
                     credit_accrual: str = "routed", **kv) -> PolicySpec:
    return policy_spec("harvest-slo-host", "Harvest-SLO with the host tier (the complete design).",
                       slo_slack(beta, delta, n_min, margin, chunk_tokens, credit_accrual),
                       targeting=targeting_from(top_k, gate),
                       host=True, **kv)


@user_args
def predictive(beta: float = 0.5, delta: float = 0.1, n_min: int = 256, gate: float = 0.25, **kv) -> PolicySpec:
    return policy_spec("predictive", "Harvest, gated on switch probability >= 0.25.",
                       Component(HarvestController, {"beta": beta, "delta": delta, "n_min": n_min}),
                       targeting=ProbabilityGate(gate), **kv)


@user_args
def dedicated(top_k: int | None = None, gate: float | None = None, **kv) -> PolicySpec:
    return policy_spec("dedicated", "One extra instance per model runs all shadow work (+25% GPUs).",
                       Component(EagerController), targeting=targeting_from(top_k, gate), dedicated=True, **kv)


@user_args
def eager(top_k: int | None = None, gate: float | None = None, **kv) -> PolicySpec:
    return policy_spec("eager", "Shadow work as normal-priority requests.", Component(EagerController),
                       targeting=targeting_from(top_k, gate), **kv)


@user_args
def oracle(**kv) -> PolicySpec:
    return policy_spec("oracle", "Switch call's prefix cached for free.", Component(NoShadowController),
                       targeting=NoTargets(), oracle=True, **kv)


@user_args
def oracle_host(**kv) -> PolicySpec:
    return policy_spec("oracle-host", "Oracle with the host tier.", Component(NoShadowController),
                       targeting=NoTargets(), oracle=True, host=True, **kv)
