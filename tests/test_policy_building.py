"""The public policy-building helpers (``shadow_policies.building``) and the
next-model normalisation the count-based predictors share
(``shadowcore.switch.next_model_distribution_from_counts``): a policy written
with the helpers gets the paper's defaults and errors under the keywords its
user wrote; both predictors normalise their counts the same way."""

from __future__ import annotations

import inspect

import pytest
from shadow_policies.benefit import PopulationBackoffPredictor
from shadow_policies.building import (
    HOST_CAPACITY_BYTES,
    KV_ARGS,
    PCIE_BYTES_PER_S,
    policy_spec,
    slo_slack,
    targeting_from,
    user_args,
)

from shadowcore.errors import ConfigError
from shadowcore.policy import Component, PolicySpec
from shadowcore.slack import NoShadowController, SloSlackController
from shadowcore.switch import (
    AllOthers,
    EmpiricalSwitchPredictor,
    ProbabilityGate,
    TopK,
    next_model_distribution_from_counts,
)

# ---------------------------------------------------------------- normalisation


def test_normalisation_adds_the_prior_and_ignores_staying_and_unknown_models() -> None:
    counts = {"A": 5.0, "B": 2.0, "C": 1.0, "Z": 9.0}  # A: staying; Z: not among the models asked about
    dist = next_model_distribution_from_counts(counts, "A", "ABCD", pseudo_count=1.0)
    assert list(dist) == ["B", "C", "D"]  # the order of ``models``, current model left out
    assert dist == pytest.approx({"B": 3 / 6, "C": 2 / 6, "D": 1 / 6})
    assert next_model_distribution_from_counts(counts, "A", "ABCD") == pytest.approx({"B": 2 / 3, "C": 1 / 3, "D": 0.0})


def test_normalisation_without_counts_or_prior_is_uniform_and_empty_without_others() -> None:
    assert next_model_distribution_from_counts({}, "A", "ABC") == {"B": 0.5, "C": 0.5}
    assert next_model_distribution_from_counts({"A": 3.0}, "A", "ABC") == {"B": 0.5, "C": 0.5}
    assert next_model_distribution_from_counts({"A": 3.0}, "A", "A") == {}


def test_empirical_and_population_predictors_pin_their_distributions() -> None:
    emp = EmpiricalSwitchPredictor(pseudo_count=1.0)
    pop = PopulationBackoffPredictor(prior_strength=4.0, session_weight=0.0, pseudo_count=1.0)
    for p in (emp, pop):
        for to in ("B", "B", "C"):
            p.observe_transition("s0", "t", "A", to)
    # per-task counts + pseudo-count 1 each: B 3, C 2, D 1
    assert emp.next_model_distribution("s1", "t", "A", "ABCD") == pytest.approx({"B": 3 / 6, "C": 2 / 6, "D": 1 / 6})
    # population prior over A..D from A: (1, 3, 2, 1)/7 with strength 4, plus the task's B 2, C 1:
    # B 12/7 + 2 = 26/7, C 8/7 + 1 = 15/7, D 4/7 (staying, 4/7, is left out)
    assert pop.next_model_distribution("s1", "t", "A", "ABCD") == pytest.approx(
        {"B": 26 / 45, "C": 15 / 45, "D": 4 / 45})


# ---------------------------------------------------------------- building helpers


def test_kv_args_are_exactly_the_kv_keywords_of_policy_spec() -> None:
    params = inspect.signature(policy_spec).parameters
    keyword_only = {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert KV_ARGS == keyword_only - {"host", "targeting", "oracle", "dedicated"}


def test_policy_spec_applies_the_paper_defaults() -> None:
    spec = policy_spec("x", "d", slo_slack(0.5, 0.025, 256, 0.1, 2048))
    assert isinstance(spec, PolicySpec) and spec.targeting == AllOthers()
    assert (spec.kv.shadow_cap_fraction, spec.kv.cold_age_s, spec.kv.host) == (0.25, 5.0, None)
    assert (spec.predictor.cls, dict(spec.predictor.kwargs)) == (EmpiricalSwitchPredictor, {"pseudo_count": 1.0})
    assert spec.slack.cls is SloSlackController
    assert dict(spec.slack.kwargs) == {"beta": 0.5, "delta": 0.025, "n_min": 256, "margin": 0.1, "chunk_tokens": 2048}
    host = policy_spec("x", "d", Component(NoShadowController), host=True, oracle=True).kv.host
    assert (host.capacity_bytes, host.pcie_bytes_per_s) == (HOST_CAPACITY_BYTES, PCIE_BYTES_PER_S)


def test_targeting_from_keywords() -> None:
    assert targeting_from(None, None) == AllOthers()
    assert targeting_from(2, None) == TopK(2)
    assert targeting_from(None, 0.3) == ProbabilityGate(0.3)
    with pytest.raises(TypeError, match="either top_k or gate"):
        targeting_from(1, 0.3)


@user_args
def _my_policy(beta: float = 0.5, top_k: int | None = None, **kv) -> PolicySpec:
    """What a third-party policy written with the helpers looks like."""
    return policy_spec("mine", "SLO slack, top-k.", slo_slack(beta, 0.0, 256, 0.1, 2048),
                       targeting=targeting_from(top_k, None), host=True, **kv)


def test_user_args_names_the_keyword_the_user_wrote() -> None:
    spec = _my_policy(top_k=1, shadow_cap=0.5, pseudo_count=0.0)
    assert spec.targeting == TopK(1) and spec.kv.shadow_cap_fraction == 0.5
    for kwargs, field in (({"beta": -1}, "beta"), ({"shadow_cap": 0}, "shadow_cap"), ({"top_k": 0}, "top_k"),
                          ({"pseudo_count": -1}, "pseudo_count"), ({"host_capacity_bytes": -1}, "host_capacity_bytes")):
        with pytest.raises(ConfigError) as info:
            _my_policy(**kwargs)
        assert info.value.field == field, (kwargs, str(info.value))
    with pytest.raises(ConfigError) as info:
        _my_policy(mass=0.5)  # a keyword the factory does not take
    assert info.value.field == "mass" and "known: beta, cold_age_s" in str(info.value)
