"""A conformance check any policy can be run through (like Gymnasium's
``check_env``): run it on the deterministic fake engine and check, at every
iteration, the invariants every shadow policy must keep whatever its
strategies are.

``check_policy("my_pkg.policy:factory")`` returns a :class:`ConformanceReport`
and raises :class:`ConformanceError` listing every violation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from shadowcore.config import PluginRef, ShadowConfig
from shadowcore.types import StepOutcome, StepPlan, StepSnapshot

SMALL_SCENARIO: dict[str, Any] = {
    "duration_s": 40.0,
    "warmup_s": 0.0,
    "session_rate_per_s": 0.25,
    "calls_per_session": 6,
    "switch_probability": 0.4,
    "normal_rate_per_s": 2.0,
    "num_blocks": 2048,
}
EPS = 1e-9


class ConformanceError(AssertionError):
    """A policy broke at least one invariant; the message lists them all."""


@attrs.define(eq=False)
class InvariantObserver:
    """Checks each plan and outcome; needs the run's instances for KV checks."""

    instances: Mapping[str, Any] = attrs.Factory(dict)
    violations: list[str] = attrs.Factory(list)
    num_plans: int = 0
    num_shadow_plans: int = 0

    def _fail(self, snapshot: StepSnapshot, what: str) -> None:
        if len(self.violations) < 50:
            self.violations.append(f"{snapshot.instance_id} iteration {snapshot.iteration}: {what}")

    def on_plan(self, snapshot: StepSnapshot, plan: StepPlan) -> None:
        self.num_plans += 1
        if not plan.grants:
            return
        self.num_shadow_plans += 1
        if not plan.normal_priority and (snapshot.num_waiting or snapshot.admission_blocked):
            self._fail(snapshot, "shadow tokens while a request waits or an admission is blocked")
        used = plan.predicted_stretch_s if plan.budget.bounds_stretch else plan.predicted_s
        if used > plan.budget.budget_s + EPS:
            self._fail(snapshot, f"predicted {used:.6f}s exceeds budget {plan.budget.budget_s:.6f}s")
        if plan.num_shadow_tokens > min(snapshot.num_free_token_budget, snapshot.num_shadow_room_tokens):
            self._fail(snapshot, "more shadow tokens than the token budget or the shadow KV room")
        probs = [g.switch_probability for g in plan.grants]
        if any(a < b for a, b in zip(probs, probs[1:])):
            self._fail(snapshot, f"grants not in non-increasing switch probability: {probs}")
        inst = self.instances.get(snapshot.instance_id)
        if inst is not None and any(g.num_tokens % inst.block_size for g in plan.grants):
            self._fail(snapshot, "a grant is not whole blocks")

    def on_step_end(self, snapshot: StepSnapshot, plan: StepPlan, outcome: StepOutcome) -> None:
        inst = self.instances.get(snapshot.instance_id)
        if inst is not None and inst.kv.num_shadow_blocks > inst.kv.cap_blocks:
            self._fail(snapshot, f"shadow KV {inst.kv.num_shadow_blocks} blocks > cap {inst.kv.cap_blocks}")
        if inst is not None and inst.kv.num_host_blocks > inst.kv.host_capacity_blocks:
            self._fail(snapshot, "host tier over capacity")


@attrs.frozen
class ConformanceReport:
    policy: str
    num_plans: int
    num_shadow_plans: int
    metrics: Mapping[str, float]


def check_policy(
    policy: str | PluginRef, scenario: Mapping[str, Any] | None = None, seed: int = 0
) -> ConformanceReport:
    """Run ``policy`` on the fake engine and raise on any invariant violation."""
    from shadowcore.engine.scenario import FakeRun, FakeScenario

    ref = policy if isinstance(policy, PluginRef) else PluginRef(policy)
    run = FakeRun(FakeScenario.from_dict(dict(scenario or SMALL_SCENARIO)), ShadowConfig(ref, seed=seed))
    checker = InvariantObserver(run.cluster.by_id)
    run.runtime.observers.add(checker)
    result = run.run()
    if run.runtime.observers.errors:
        checker.violations.append(f"observer error: {run.runtime.observers.errors[0][1]!r}")
    if checker.violations:
        raise ConformanceError(f"policy {ref.name!r} broke invariants:\n  " + "\n  ".join(checker.violations))
    return ConformanceReport(result.policy, checker.num_plans, checker.num_shadow_plans, result.metrics)
