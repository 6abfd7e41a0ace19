"""The testing kit's slack machine under the imminent-first grant order.

A plugin controller (written here against the public ABC, as a user would)
with ``imminent_first`` and jobs that turn imminent and back passes every
check of :class:`~shadowcore.testing.machines.SlackControllerMachine`; a
planner that ignores the imminent-first order, and a controller that turns
the option on while the hook plans, are caught by its ``order`` check.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

import shadowcore.hook
from shadowcore.slack import SlackController
from shadowcore.testing.machines import SlackControllerMachine
from shadowcore.testing.stubs import StubJobSource
from shadowcore.types import BudgetReason, SlackBudget

_SETTINGS = settings(max_examples=25, stateful_step_count=20, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                            HealthCheck.filter_too_much],
                     phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target])  # no shrink: failures fast


@attrs.define
class GapFirst(SlackController):
    """A plugin controller: ``beta * T`` for an idle iteration or while the
    first job in the grant order is imminent (its session is in its tool gap),
    nothing otherwise; imminent jobs are granted first."""

    beta: float = 0.8
    n_min: int = 0
    reads_imminence = True
    imminent_first = True

    def budget(self, snapshot, latency, imminent: bool = False) -> SlackBudget:
        if snapshot.num_waiting > 0:
            return SlackBudget.zero(BudgetReason.WAITING)
        if snapshot.admission_blocked:
            return SlackBudget.zero(BudgetReason.BLOCKED)
        if snapshot.is_idle or imminent:
            return SlackBudget(self.beta * snapshot.tpot_slo_s,
                               BudgetReason.IDLE if snapshot.is_idle else BudgetReason.SLO_SLACK)
        return SlackBudget.zero(BudgetReason.DISABLED)


@attrs.define
class LateGapFirst(GapFirst):
    """A broken plugin: it turns ``imminent_first`` on in :meth:`budget`,
    after the hook ordered the jobs, so its plans claim the imminent-first
    order that their grants do not follow."""

    imminent_first: bool = False

    def budget(self, snapshot, latency, imminent: bool = False) -> SlackBudget:
        self.imminent_first = True
        return super().budget(snapshot, latency, imminent)

    def commit(self, snapshot, plan) -> None:
        self.imminent_first = False


class GapFirstMachine(SlackControllerMachine):
    """Every check, with the plugin's own caps (the machine knows only the shipped controllers')."""

    controller_class = GapFirst

    def make_controller(self, draw):
        return self.controller_class(beta=draw(st.floats(0.1, 1.0)), n_min=draw(st.sampled_from([0, self.block_size])))

    def snapshot_kinds(self):
        return st.sampled_from(("idle", "idle", "idle", "decode", "routed", "any"))

    def idle_cap_s(self, snapshot):
        return self.controller.beta * snapshot.tpot_slo_s

    def budget_upper_bound_s(self, snapshot):
        gated = snapshot.num_waiting > 0 or snapshot.admission_blocked
        return 0.0 if gated else self.controller.beta * snapshot.tpot_slo_s


def _run(machine: type, max_examples: int = 25) -> None:
    run_state_machine_as_test(machine, settings=settings(_SETTINGS, max_examples=max_examples))


class _Witness(GapFirstMachine):
    """Counts plans whose grants the imminent-first order changed (an imminent job served before a job of
    higher switch probability), so the passing test is known to exercise the order."""

    reordered = 0

    def _check_plan(self, snapshot, plan):
        out = super()._check_plan(snapshot, plan)
        served = self.jobs.served or []
        if plan.grants and any(s.imminent for s in served) and plan.grants[0].job != served[0].key:
            type(self).reordered += 1
        return out


def test_plugin_imminent_first_controller_passes_the_kit() -> None:
    _Witness.reordered = 0
    _run(_Witness, 40)
    assert _Witness.reordered > 0, "no plan was reordered by imminence: the test exercised nothing"


def test_kit_catches_a_planner_ignoring_imminent_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook's grant order replaced by the source's (imminence ignored)."""
    monkeypatch.setattr(shadowcore.hook, "grant_order", list)
    with pytest.raises(AssertionError, match="grants do not follow the job order|non-increasing"):
        _run(GapFirstMachine, 60)


class _UnrecordedSource:
    """A job source that does not record what it served (a plugin's own): the machine then checks the grants'
    own keys, (imminent, switch probability), not the source's order."""

    def __init__(self) -> None:
        self._inner = StubJobSource()
        self.add, self.remove, self.all, self.job = (self._inner.add, self._inner.remove, self._inner.all,
                                                     self._inner.job)

    def pending_jobs(self, instance_id: str):
        return self._inner.pending_jobs(instance_id)


class _UnrecordedMachine(GapFirstMachine):
    def make_job_source(self, draw):
        return _UnrecordedSource()


def test_kit_catches_a_planner_ignoring_imminent_first_by_the_grants_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same with a job source that records nothing: the grants' (imminent, probability) order catches it."""
    _run(_UnrecordedMachine, 10)  # passes as it is
    monkeypatch.setattr(shadowcore.hook, "grant_order", list)
    with pytest.raises(AssertionError, match="non-increasing switch probability"):
        _run(_UnrecordedMachine, 60)  # stops at the first failure (no shrinking)


class _LateMachine(GapFirstMachine):
    controller_class = LateGapFirst


def test_kit_catches_a_controller_turning_imminent_first_on_mid_step() -> None:
    with pytest.raises(AssertionError, match="grants do not follow the job order|non-increasing"):
        _run(_LateMachine, 60)


class _ShippedMachine(SlackControllerMachine):
    """The shipped Harvest-SLO controller with the option on and routed margins (idle-first-host's slack),
    every check: with a routed margin the credit pays only for iterations in which a routed call prefills
    (routed decodes are paid from their slack at that margin), and the declared accrual is the bound's."""

    def make_controller(self, draw):
        from shadowcore.slack import SloSlackController

        return SloSlackController(beta=draw(st.floats(0.1, 1.0)), delta=draw(st.floats(0.0, 0.2)),
                                  n_min=draw(st.sampled_from([0, self.block_size])), imminent_first=True,
                                  imminent_margin=draw(st.none() | st.floats(0.0, 0.5)),
                                  routed_decode_margin=draw(st.floats(0.0, 0.5)),  # None: tests/test_invariants_unit
                                  credit_accrual=draw(st.sampled_from(["routed", "all-decode", "routed-prefill"])))


def test_shipped_imminent_first_controller_passes_the_kit() -> None:
    _run(_ShippedMachine)


class _StretchMachine(SlackControllerMachine):
    """The shipped Harvest-SLO controller with ``imminent_stretch`` (with or without a routed margin):
    an imminent job's routed-decode iteration is paid from the decodes' slack, not the credit, so the
    kit's credit check must not charge it (it did before session 11's fix)."""

    def make_controller(self, draw):
        from shadowcore.slack import SloSlackController

        return SloSlackController(beta=draw(st.floats(0.1, 1.0)), delta=draw(st.floats(0.0, 0.2)),
                                  n_min=draw(st.sampled_from([0, self.block_size])),
                                  imminent_stretch=draw(st.floats(0.1, 1.0)),
                                  routed_decode_margin=draw(st.none() | st.floats(0.0, 0.5)))


def test_shipped_imminent_stretch_controller_passes_the_kit() -> None:
    _run(_StretchMachine, 60)


@attrs.define
class _Unread(GapFirst):
    reads_imminence = False


def test_imminent_first_without_reading_imminence_is_an_error() -> None:
    """Such a controller's order would silently be the source's (no job source marks jobs for it)."""
    from shadowcore.hook import EngineHook
    from shadowcore.testing.machines import StubEnginePort
    from shadowcore.testing.strategies import LinearLatencyModel

    with pytest.raises(ValueError, match="_Unread: imminent_first without reads_imminence"):
        EngineHook("i0", StubJobSource(), _Unread(), LinearLatencyModel(), StubEnginePort(16))
    EngineHook("i0", StubJobSource(), GapFirst(), LinearLatencyModel(), StubEnginePort(16))  # both: fine


@pytest.mark.parametrize("broken", [False, True])
def test_conformance_probe_shows_a_reading_controller_imminent_jobs(broken: bool,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The conformance check's controller probe marks some of its jobs imminent for a controller that reads
    imminence (idle-first-host with ``imminent_first``): its plans put them first and pass the contract; a
    planner ignoring the order breaks the contract's ``order`` rule there."""
    from shadowcore.config import PluginRef
    from shadowcore.policy import load_policy
    from shadowcore.testing.conformance import InvariantObserver, _probe_controller

    if broken:
        monkeypatch.setattr(shadowcore.hook, "grant_order", list)
    seen: list = []

    class Recording(InvariantObserver):
        def on_plan(self, snapshot, plan) -> None:
            seen.append(plan)
            super().on_plan(snapshot, plan)

    checker = Recording(strict=True)
    _probe_controller(load_policy(PluginRef("idle-first-host", {"imminent_first": True})), 0, checker)
    if broken:
        assert any("order:" in v for v in checker.violations), checker.violations
    else:
        assert checker.violations == []
        assert any(p.grants and p.grants[0].imminent and p.grants[0].switch_probability < 0.8 for p in seen)
