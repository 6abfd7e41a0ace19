"""check_policy catches each violation a policy can plant, and the machines
for predictors and targetings catch theirs.

Each planted policy below breaks exactly one rule of
:mod:`shadowcore.testing.contracts` and is otherwise harvest-slo;
``check_policy`` must raise naming that rule. The planted policies are
referenced as ``<this module>:<factory>``, as a user's unregistered policy is.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from shadowcore.kv import KVClassPolicy
from shadowcore.policy import Component, PolicySpec
from shadowcore.slack import SloSlackController
from shadowcore.switch import AllOthers, EmpiricalSwitchPredictor, Target, Targeting
from shadowcore.testing.conformance import ConformanceError, check_policy
from shadowcore.testing.machines import SwitchPredictorMachine, TargetingMachine
from shadowcore.types import BudgetReason, SlackBudget


# -- planted strategies -----------------------------------------------------------------
@attrs.define
class GrantWhileWaiting(SloSlackController):
    def budget(self, snapshot, latency):
        if snapshot.num_waiting and not snapshot.admission_blocked:
            return SlackBudget(self.beta * snapshot.tpot_slo_s, BudgetReason.IDLE)
        return super().budget(snapshot, latency)


@attrs.define
class GrantWhileBlocked(SloSlackController):
    def budget(self, snapshot, latency):
        if snapshot.admission_blocked and not snapshot.num_waiting:
            return SlackBudget(self.beta * snapshot.tpot_slo_s, BudgetReason.IDLE)
        return super().budget(snapshot, latency)


@attrs.define
class OneSecondBudget(SloSlackController):
    """Keeps the gate, then grants 1 s whatever the batch."""

    def budget(self, snapshot, latency):
        gated = super().budget(snapshot, latency)
        if gated.reason in (BudgetReason.WAITING, BudgetReason.BLOCKED):
            return gated
        return SlackBudget(1.0, BudgetReason.IDLE)


@attrs.define
class IgnoresSlack(SloSlackController):
    """beta*T on every iteration that carries no routed call, whatever the batch's slack."""

    def budget(self, snapshot, latency):
        budget = super().budget(snapshot, latency)
        if budget.reason is BudgetReason.SLO_SLACK:
            return SlackBudget(self.beta * snapshot.tpot_slo_s, BudgetReason.SLO_SLACK)
        return budget


@attrs.frozen
class SwappedProbabilities(Targeting):
    """Every ranked model, with the probabilities in reverse: jobs get served least likely first."""

    def choose(self, ranked):
        return [Target(t.model, q.switch_probability) for t, q in zip(ranked, reversed(ranked), strict=True)]


@attrs.frozen
class GhostTarget(Targeting):
    def choose(self, ranked):
        return [*ranked, Target("ghost-model", 0.5)]


@attrs.frozen
class UnlimitedCap(KVClassPolicy):
    """Declares a 25% cap but lets the shadow class take the whole pool."""

    def cap_blocks(self, num_blocks: int) -> int:
        return num_blocks


@attrs.define
class HalvedDistribution(EmpiricalSwitchPredictor):
    def next_model_distribution(self, session_id, task, current_model, models):
        return {m: 0.5 * p for m, p in super().next_model_distribution(session_id, task, current_model, models).items()}


def _spec(slack=SloSlackController, predictor=EmpiricalSwitchPredictor, targeting=None, kv=None) -> PolicySpec:
    return PolicySpec("planted", "a planted violation", Component(slack, {}), Component(predictor, {}),
                      targeting or AllOthers(), kv or KVClassPolicy())


def grant_while_waiting() -> PolicySpec:
    return _spec(slack=GrantWhileWaiting)


def grant_while_blocked() -> PolicySpec:
    return _spec(slack=GrantWhileBlocked)


def over_budget() -> PolicySpec:
    return _spec(slack=OneSecondBudget)


def ignores_slack() -> PolicySpec:
    return _spec(slack=IgnoresSlack)


def out_of_order_jobs() -> PolicySpec:
    return _spec(targeting=SwappedProbabilities())


def over_cap_kv() -> PolicySpec:
    return _spec(kv=UnlimitedCap())


def distribution_sums_to_half() -> PolicySpec:
    return _spec(predictor=HalvedDistribution)


def target_outside_ranked() -> PolicySpec:
    return _spec(targeting=GhostTarget())


def honest() -> PolicySpec:
    return _spec()


PLANTED = {
    "grant_while_waiting": "gate: budget",
    "grant_while_blocked": "gate: budget",
    "over_budget": "bounded: budget 1.000000s",
    "ignores_slack": "slo: iteration predicted",
    "out_of_order_jobs": "but the ranked list has",
    "over_cap_kv": "scenario: .*cap: shadow KV",  # only a real pool shows it
    "distribution_sums_to_half": "sums to",
    "target_outside_ranked": "a model outside the ranked list",
}


@pytest.mark.parametrize("factory", sorted(PLANTED))
def test_check_policy_catches_planted_violation(factory: str) -> None:
    with pytest.raises(ConformanceError, match=PLANTED[factory]) as caught:
        check_policy(f"{__name__}:{factory}")
    assert "'" + f"{__name__}:{factory}" + "'" in str(caught.value)


def test_check_policy_passes_the_unplanted_twin_and_shows_every_kind_of_snapshot() -> None:
    """The planted policies' base passes, and the check showed it every kind of
    snapshot the rules are about (so a pass means something)."""
    report = check_policy(f"{__name__}:honest")
    assert report.num_shadow_plans > 0
    for kind in ("waiting", "blocked", "idle", "busy", "routed", "kv_pressure", "shadow_plan"):
        assert report.coverage.get(kind, 0) > 0, (kind, report.coverage)


# -- machines for predictors and targetings ------------------------------------------------
_SETTINGS = settings(max_examples=30, stateful_step_count=20, deadline=None, phases=[
    Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink], suppress_health_check=[HealthCheck.too_slow])


class _HalvedMachine(SwitchPredictorMachine):
    def make_predictor(self, draw):
        return HalvedDistribution()


class _GhostMachine(TargetingMachine):
    def make_targeting(self, draw):
        return GhostTarget()


def test_predictor_and_targeting_machines_pass_the_shipped_strategies() -> None:
    run_state_machine_as_test(SwitchPredictorMachine, settings=_SETTINGS)
    run_state_machine_as_test(TargetingMachine, settings=_SETTINGS)


def test_predictor_machine_catches_a_distribution_not_summing_to_one() -> None:
    with pytest.raises(AssertionError, match="sums to"):
        run_state_machine_as_test(_HalvedMachine, settings=_SETTINGS)


def test_targeting_machine_catches_a_model_outside_the_ranked_list() -> None:
    with pytest.raises(AssertionError, match="outside the ranked list"):
        run_state_machine_as_test(_GhostMachine, settings=_SETTINGS)
