"""Our adaptive-host policy: nucleus targeting picks the shortest prefix of the
ranked targets reaching the mass, the session-aware predictor learns the
session's own transitions, and the policy loads with clear argument errors."""

from __future__ import annotations

import pytest
from shadow_policies.adaptive import NucleusTargets, SessionAwarePredictor

from shadowcore.config import PluginRef
from shadowcore.errors import ConfigError
from shadowcore.policy import load_policy
from shadowcore.switch import EmpiricalSwitchPredictor, Target, rank_targets


def _ranked(*ps: float) -> list[Target]:
    return rank_targets(1.0, {f"m{i}": p for i, p in enumerate(ps)})


def test_nucleus_takes_the_shortest_prefix_reaching_the_mass() -> None:
    t = NucleusTargets(mass=0.8, floor=0.0)
    assert [x.model for x in t.choose(_ranked(0.85, 0.1, 0.05))] == ["m0"]
    assert [x.model for x in t.choose(_ranked(0.5, 0.3, 0.2))] == ["m0", "m1"]
    assert [x.model for x in t.choose(_ranked(0.25, 0.25, 0.25, 0.25))] == ["m0", "m1", "m2", "m3"][:4]
    assert len(NucleusTargets(mass=1.0, floor=0.0).choose(_ranked(0.7, 0.2, 0.1))) == 3


def test_nucleus_floor_and_scale_invariance() -> None:
    t = NucleusTargets(mass=0.9, floor=0.05)
    # switch probability 0.2 overall: targets 0.12, 0.06, 0.02 -> the last is under the floor
    ranked = rank_targets(0.2, {"a": 0.6, "b": 0.3, "c": 0.1})
    assert [x.model for x in t.choose(ranked)] == ["a", "b"]
    # the mass is relative to the total switch probability, not absolute
    assert [x.model for x in NucleusTargets(0.8, 0.0).choose(rank_targets(0.1, {"a": 0.9, "b": 0.1}))] == ["a"]


def test_session_aware_predictor_learns_the_session_transitions() -> None:
    models = ("A", "B", "C")
    plain, aware = EmpiricalSwitchPredictor(), SessionAwarePredictor(session_weight=3.0)
    for p in (plain, aware):
        for s in range(5):  # other sessions go A -> B
            p.observe_transition(f"o{s}", "", "A", "B")
        p.observe_transition("me", "", "A", "C")
        p.observe_transition("me", "", "A", "C")
    assert plain.next_model_distribution("me", "", "A", models)["B"] > 0.5
    assert aware.next_model_distribution("me", "", "A", models)["C"] > 0.5
    assert aware.next_model_distribution("other", "", "A", models)["B"] > 0.5


def test_policy_loads_and_names_bad_arguments() -> None:
    spec = load_policy(PluginRef("adaptive-host", {"mass": 0.7}))
    assert spec.name == "adaptive-host" and spec.kv.host is not None
    with pytest.raises(ConfigError) as info:
        load_policy(PluginRef("adaptive-host", {"mass": 1.5}))
    assert info.value.field == "policy.args.mass"
    with pytest.raises(ConfigError) as info:
        load_policy(PluginRef("adaptive-host", {"top_k": 1}))
    assert info.value.field == "policy.args.top_k" and "mass" in str(info.value)
