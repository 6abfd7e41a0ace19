"""Our benefit-host policy: expected-benefit targeting keeps only targets whose
absolute switch probability reaches the gate (at most max_k, most likely first),
the population-backoff predictor learns where switches from a model go across
sessions and tasks, and the policy loads with clear argument errors."""

from __future__ import annotations

import pytest
from shadow_policies.benefit import ExpectedBenefitTargets, PopulationBackoffPredictor

from shadowcore.config import PluginRef
from shadowcore.errors import ConfigError
from shadowcore.policy import load_policy
from shadowcore.slack import SloSlackController
from shadowcore.switch import EmpiricalSwitchPredictor, rank_targets
from shadowcore.types import JobKey

MODELS = ("A", "B", "C", "D", "E")


def _names(targets) -> list[str]:
    return [t.model for t in targets]


def test_targets_need_absolute_probability_at_least_the_gate() -> None:
    t = ExpectedBenefitTargets(gate=0.1, max_k=4)
    # P(switch) = 0.4: absolute 0.24, 0.12, 0.04 -> the third is below the gate
    ranked = rank_targets(0.4, {"a": 0.6, "b": 0.3, "c": 0.1})
    assert _names(t.choose(ranked)) == ["a", "b"]
    # the same distribution with a rarely switching session: nothing is worth shadowing
    assert t.choose(rank_targets(0.15, {"a": 0.6, "b": 0.3, "c": 0.1})) == []
    # exactly at the gate counts
    assert _names(t.choose(rank_targets(0.5, {"a": 0.2, "b": 0.8}))) == ["b", "a"]


def test_targets_never_exceed_max_k_and_keep_the_ranking() -> None:
    ranked = rank_targets(1.0, {"a": 0.3, "b": 0.3, "c": 0.2, "d": 0.2})
    assert _names(ExpectedBenefitTargets(gate=0.0, max_k=2).choose(ranked)) == ["a", "b"]
    assert _names(ExpectedBenefitTargets(gate=0.0, max_k=1).choose(ranked)) == ["a"]
    assert len(ExpectedBenefitTargets(gate=0.0, max_k=9).choose(ranked)) == 4


def test_population_prior_predicts_a_new_task_from_other_tasks() -> None:
    plain, ours = EmpiricalSwitchPredictor(), PopulationBackoffPredictor(prior_strength=4.0, session_weight=0.0)
    for k in range(30):  # every other task: from B, switches go to C (and sometimes stay)
        for p in (plain, ours):
            p.observe_transition(f"s{k}", f"task{k}", "B", "C")
            p.observe_transition(f"s{k}", f"task{k}", "C", "C")
    # a session on an unseen task: the per-task predictor knows nothing, ours knows the population
    assert plain.next_model_distribution("new", "task-new", "B", MODELS)["C"] == pytest.approx(0.25)
    dist = ours.next_model_distribution("new", "task-new", "B", MODELS)
    assert dist["C"] > 0.8 and sum(dist.values()) == pytest.approx(1.0) and "B" not in dist
    assert ours.switch_probability("new", "task-new", "B") > 0.8  # B always left
    assert ours.switch_probability("new", "task-new", "C") < 0.2  # C always stayed


def test_task_and_session_counts_override_the_population() -> None:
    p = PopulationBackoffPredictor(prior_strength=2.0, session_weight=3.0)
    for k in range(20):
        p.observe_transition(f"s{k}", f"task{k}", "A", "B")
    p.observe_transition("me", "mine", "A", "D")
    mine = p.next_model_distribution("me", "mine", "A", MODELS)
    assert mine["D"] > mine["B"]  # 1 + 3 (own) against the prior's 2 * 21/26
    # exactly: the prior over A..E is (1, 21, 1, 2, 1)/26 with strength 2; D adds 1 (task) + 3 * 1 (own)
    assert mine["D"] == pytest.approx((2 * 2 / 26 + 1 + 3) / (2 * 25 / 26 + 1 + 3))
    # another session of the same task: the task's count only, not the session weight
    other = p.next_model_distribution("other", "mine", "A", MODELS)
    assert mine["D"] > other["D"] > p.next_model_distribution("x", "unseen", "A", MODELS)["D"]
    assert other["B"] > other["D"]


def test_knows_nothing_at_first() -> None:
    p = PopulationBackoffPredictor()
    assert p.switch_probability("s", "t", "A") == 0.5
    assert p.next_model_distribution("s", "t", "A", MODELS) == {m: 0.25 for m in MODELS[1:]}


def test_policy_loads_with_its_defaults_and_names_bad_arguments() -> None:
    spec = load_policy(PluginRef("benefit-host"))
    assert spec.name == "benefit-host" and spec.kv.host is not None
    assert spec.targeting == ExpectedBenefitTargets(0.1, 2)
    assert spec.slack.cls is SloSlackController and spec.slack.kwargs["delta"] == 0.0
    assert spec.predictor.cls is PopulationBackoffPredictor
    for bad, field in (({"gate": 1.5}, "gate"), ({"max_k": 0}, "max_k"), ({"prior_strength": -1}, "prior_strength"),
                       ({"top_k": 1}, "top_k")):
        with pytest.raises(ConfigError) as info:
            load_policy(PluginRef("benefit-host", bad))
        assert info.value.field.endswith(field), info.value


def test_wasted_tokens_are_shadow_tokens_times_the_unused_share() -> None:
    import math

    from shadow_sim.experiments.nmodels import wasted_tokens
    from shadow_sim.experiments.reproduce import _wasted_ratio
    from shadow_sim.experiments.runner import Comparison

    per = {"no-shadow": {"shadow_tokens": 0.0, "shadow_unused_share": math.nan},
           "all": {"shadow_tokens": 1000.0, "shadow_unused_share": 0.5},
           "ours": {"shadow_tokens": 400.0, "shadow_unused_share": 0.25}}
    assert wasted_tokens(per["ours"]) == 100.0 and wasted_tokens(per["no-shadow"]) == 0.0
    c = Comparison("N=5", tuple(per), "no-shadow", None, ((0, "peak", per), (1, "peak", per)), {})
    assert _wasted_ratio(c, "ours", "all") == pytest.approx(0.2)


def _targets_per_retarget(policy: PluginRef, scenario: dict, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Open shadow jobs of the session after each of its calls, on the fake engine."""
    from shadowcore.config import ShadowConfig
    from shadowcore.engine.scenario import FakeRun, FakeScenario
    from shadowcore.manager import ShadowManager

    counts: list[int] = []
    retarget = ShadowManager._retarget

    def counting(manager: ShadowManager, s) -> None:
        retarget(manager, s)
        counts.append(sum(1 for m in manager.models if manager.job(JobKey(s.session_id, m)) is not None))

    with monkeypatch.context() as patch:
        patch.setattr(ShadowManager, "_retarget", counting)
        FakeRun(FakeScenario.from_dict(scenario), ShadowConfig(policy, seed=0)).run()
    return counts


def test_conforms_and_targets_at_most_max_k_of_five_models(monkeypatch: pytest.MonkeyPatch) -> None:
    from shadowcore.testing.conformance import SMALL_SCENARIO, check_policy

    five = {**SMALL_SCENARIO, "models": ["m0", "m1", "m2", "m3", "m4"], "latency_scale": [1.0, 1.5, 2.0, 2.5, 3.0],
            "instances_per_model": 1, "switch_probability": 0.6, "duration_s": 20.0}
    assert check_policy("benefit-host", five).num_shadow_plans > 0
    ours = _targets_per_retarget(PluginRef("benefit-host"), five, monkeypatch)
    every = _targets_per_retarget(PluginRef("harvest-slo-host"), five, monkeypatch)
    assert max(ours) == 2 and max(every) == 4  # the paper's default shadows to all four others
    assert sum(ours) < sum(every)


def test_reproduce_reports_benefit_host_beside_the_paper_variants(tmp_path) -> None:
    """The reproduce table and figures carry benefit-host (fed synthetic comparisons, no simulation)."""
    from shadow_sim.experiments.reproduce import figures, markdown, studies
    from shadow_sim.experiments.runner import COLUMNS, Comparison, policy_label

    results = {}
    for study, label, _fields, refs in studies(True):
        names = tuple(policy_label(r) for r in refs)
        value = {n: 0.01 * (i + 1) for i, n in enumerate(names)}
        per = {n: {"shadow_tokens": 1000.0 * (i + 1), "shadow_unused_share": 0.5} for i, n in enumerate(names)}
        summary = {n: {**{key: (0.0, 0.0) for key, _title, _kind in COLUMNS}, "call_latency_red": (value[n], 0.0),
                       "shadow_unused_share": (0.5, 0.0), "calls": (120.0, 0.0), "switch_calls": (30.0, 0.0)}
                   for n in names}
        results[f"{study}:{label}"] = (study, Comparison(label, names, names[0], None, ((0, "peak", per),), summary))
    assert "benefit-host" in results["nmodels:N=5"][1].policies and "benefit-host" in results["main:Q7/L70"][1].policies
    table = markdown(results, quick=True)
    n5 = results["nmodels:N=5"][1]
    rank = n5.policies.index("benefit-host") + 1
    assert f"| N=5, benefit-host (ours): LLM-call reduction | ours | – | {rank:.1f}% |" in table
    # wasted tokens relative to all targets: (rank * 1000 * 0.5) / (2 * 1000 * 0.5)
    assert f"relative to all targets' | ours | – | {100 * rank / 2:.1f}% |" in table
    assert len(figures(results, tmp_path)) == 7
