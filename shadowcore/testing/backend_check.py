"""``check_backend``: hold a backend to the contract of :mod:`shadowcore.backend`
(as :func:`~shadowcore.testing.conformance.check_policy` holds a policy to the
core's invariants, and Gymnasium's ``check_env`` an environment).

``check_backend(backend, workload)`` runs the workload twice under one policy
and seed, watching only what the contract says a backend reports (the hooks'
``on_plan`` / ``on_step_end``, the backend's ``on_batch``, the returned
result), and raises :class:`BackendContractError` listing every violation:

* plans honoured: shadow entries only for granted jobs, never more tokens than
  granted; every chunk result is a grant of the step's plan, reported once,
  with no more computed tokens than granted; each planned step reports its
  batch (``on_batch``) before it ends;
* shadow last: no routed or normal entry after a shadow entry in a batch;
* KV classes: shadow-class blocks never above the shadow cap;
* first tokens: every call record has a finite time to first token in
  ``[0, latency]``, and every routed request that ran has a record;
* determinism: the second run gives the same calls, metrics and plans.

It also refuses to pass vacuously: a workload under which no shadow chunk ran
or no routed call was recorded is a violation (the check would prove nothing).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from shadowcore.backend import Backend, BatchReport
from shadowcore.config import PluginRef, ShadowConfig
from shadowcore.types import StepOutcome, StepPlan, StepSnapshot

EPS = 1e-9
MAX_VIOLATIONS = 50


class BackendContractError(AssertionError):
    """A backend broke the contract; the message lists every violation."""


@attrs.define(eq=False)
class ContractObserver:
    """Checks each planned step of every instance against the contract, and
    keeps the run's plans (for the determinism check)."""

    violations: list[str] = attrs.Factory(list)
    plans: list[str] = attrs.Factory(list)  # one line per plan, in order
    num_plans: int = 0
    num_batches: int = 0
    num_shadow_entries: int = 0
    routed_ids: set[str] = attrs.Factory(set)
    _open: dict[tuple[str, int], tuple[StepPlan, bool]] = attrs.Factory(dict)  # -> (plan, batch reported)

    def _fail(self, where: str, what: str) -> None:
        if len(self.violations) < MAX_VIOLATIONS:
            self.violations.append(f"{where}: {what}")

    def on_plan(self, snapshot: StepSnapshot, plan: StepPlan) -> None:
        self.num_plans += 1
        self.plans.append(f"{plan.instance_id} {plan.iteration} {plan.grants!r}")
        self._open[(plan.instance_id, plan.iteration)] = (plan, False)

    def on_batch(self, report: BatchReport) -> None:
        where = f"{report.instance_id} iteration {report.iteration}"
        key = (report.instance_id, report.iteration)
        if key not in self._open:
            self._fail(where, "on_batch without an open plan")
            return
        plan, _ = self._open[key]
        self._open[key] = (plan, True)
        self.num_batches += 1
        granted: dict[Any, int] = {}
        for g in plan.grants:
            granted[g.job] = granted.get(g.job, 0) + g.num_tokens
        ran: dict[Any, int] = {}
        seen_shadow = False
        for entry in report.entries:
            if entry.kind == "shadow":
                seen_shadow = True
                self.num_shadow_entries += 1
                ran[entry.job] = ran.get(entry.job, 0) + entry.num_tokens
            elif seen_shadow:
                self._fail(where, f"{entry.kind} request {entry.request_id} after a shadow chunk in the batch")
            if entry.kind == "routed":
                self.routed_ids.add(entry.request_id)
        for job, n in ran.items():
            if job not in granted:
                self._fail(where, f"shadow chunk for {job} which the plan did not grant")
            elif n > granted[job]:
                self._fail(where, f"{n} shadow tokens for {job}, {granted[job]} granted")
        if report.num_shadow_blocks > report.shadow_cap_blocks:
            self._fail(where, f"shadow KV {report.num_shadow_blocks} blocks > cap {report.shadow_cap_blocks}")

    def on_step_end(self, snapshot: StepSnapshot, plan: StepPlan, outcome: StepOutcome) -> None:
        where = f"{plan.instance_id} iteration {plan.iteration}"
        opened = self._open.pop((plan.instance_id, plan.iteration), None)
        if opened is None or opened[0] is not plan:
            self._fail(where, "step ended without its plan")
        elif not opened[1]:
            self._fail(where, "planned step ended without an on_batch report")
        grants = set(plan.grants)
        reported = set()
        for r in outcome.results:
            if r.grant not in grants:
                self._fail(where, f"chunk result for {r.grant.job} which the plan did not grant")
            elif r.grant in reported:
                self._fail(where, f"grant for {r.grant.job} reported twice")
            elif r.num_computed_tokens > r.grant.num_tokens:
                self._fail(where, f"{r.num_computed_tokens} tokens computed for {r.grant.job}, "
                                  f"{r.grant.num_tokens} granted")
            reported.add(r.grant)


@attrs.frozen
class BackendReport:
    """What a passing :func:`check_backend` saw (first run)."""

    backend: str
    policy: str
    num_plans: int
    num_batches: int
    num_shadow_chunks: int
    num_calls: int
    metrics: Mapping[str, float]


def _check_calls(result: Any, observer: ContractObserver, violations: list[str]) -> None:
    for c in result.calls:
        ttft, latency = c.ttft_s, c.latency_s
        if not (math.isfinite(ttft) and 0.0 <= ttft <= latency + EPS):
            violations.append(f"call {c.session_id}#{c.call_index}: time to first token {ttft!r} "
                              f"not in [0, latency {latency!r}]")
    if len(result.calls) < len(observer.routed_ids):
        violations.append(f"{len(observer.routed_ids)} routed requests ran but only {len(result.calls)} calls "
                          "were reported")


def _fingerprint(result: Any, observer: ContractObserver) -> tuple[str, str, list[str]]:
    """What must repeat exactly (reprs: exact for floats, NaN equal to NaN)."""
    return repr(tuple(result.calls)), repr(sorted(result.metrics.items())), observer.plans


def check_backend(backend: Backend, workload: Any, policy: str | PluginRef = "harvest-slo",
                  seed: int = 0) -> BackendReport:
    """Run ``workload`` on ``backend`` twice under ``policy`` and ``seed`` and
    raise :class:`BackendContractError` on any breach of the backend contract.

    ``workload`` is passed to ``backend.run`` as it is (whatever value that
    backend accepts); it must make the policy plan shadow chunks and the
    router side place routed calls, or the check fails as vacuous."""
    ref = policy if isinstance(policy, PluginRef) else PluginRef(policy)
    shadow = ShadowConfig(ref, seed=seed)
    name = getattr(backend, "name", type(backend).__name__)
    first, second = ContractObserver(), ContractObserver()
    result = backend.run(workload, shadow, (first,))
    again = backend.run(workload, shadow, (second,))
    violations = list(first.violations)
    _check_calls(result, first, violations)
    if first.num_shadow_entries == 0:
        violations.append("no shadow chunk ran: the workload does not exercise shadow work (the check proves nothing)")
    if not result.calls:
        violations.append("no routed call was reported: the workload has no sessions (the check proves nothing)")
    a, b = _fingerprint(result, first), _fingerprint(again, second)
    for what, x, y in (("calls", a[0], b[0]), ("metrics", a[1], b[1]), ("plans", a[2], b[2])):
        if x != y:
            violations.append(f"not deterministic: the same workload and seed gave different {what}")
    if violations:
        raise BackendContractError(f"backend {name!r} broke the backend contract:\n  " + "\n  ".join(violations))
    return BackendReport(name, result.policy, first.num_plans, first.num_batches, first.num_shadow_entries,
                         len(result.calls), dict(result.metrics))


__all__ = ["BackendContractError", "BackendReport", "ContractObserver", "check_backend"]
