"""The agreement harness: what a shadow hook saw and decided per iteration
(:class:`PlanRecorder`, an observer), in engine-neutral terms, and the match
of two engines' planned steps by their inputs (:func:`compare_steps`), e.g.
the simulator against vLLM's scheduler in virtual time
(``tests/vllm/test_virtual_agreement.py``). For P/D, what a decode
instance's push policy was asked and answered (:class:`PushRecorder` wraps a
:class:`~shadowcore.pd.PushPolicy`; engines may record
:class:`~shadowcore.pd.PushDecision` themselves) and the match of two
engines' push decisions by their inputs (:func:`compare_pushes`;
``tests/vllm/test_pd_agreement.py``).

Invariants: a recorded step depends only on the snapshot, the plan and the
job source's jobs; two steps are compared only when everything their decision
depends on (besides the controller's credit) is identical.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs


@attrs.frozen
class PlannedStep:
    """What one hook saw and decided in one iteration, in engine-neutral terms.

    ``batch`` is the scheduled normal and routed work as (request id, phase,
    tokens, context) sorted by id (engines order their batches differently;
    the slack controller does not depend on the order); ``jobs`` the pending
    shadow jobs before the plan, in the order the hook takes them
    (non-increasing switch probability, then the job source's sequence), as
    (session, target, epoch, next token, target tokens, switch probability);
    ``grants`` the plan in batch order.
    """

    instance_id: str
    now_s: float
    batch: tuple[tuple[str, str, int, int], ...]
    num_waiting: int
    admission_blocked: bool
    num_free_token_budget: int
    num_shadow_room_tokens: int
    jobs: tuple[tuple[str, str, int, int, int, float], ...]
    budget_reason: str
    grants: tuple[tuple[str, str, int, int], ...]

    @property
    def batch_inputs(self) -> tuple:
        """The iteration as the engine built it (time, batch, queue)."""
        return (round(self.now_s, 9), self.batch, self.num_waiting, self.admission_blocked)

    @property
    def inputs(self) -> tuple:
        """Everything the decision depends on (besides the controller's credit)."""
        return (*self.batch_inputs, self.num_free_token_budget, self.num_shadow_room_tokens, self.jobs)

    def plannable_inputs(self, n_min: int) -> tuple:
        """:attr:`inputs` with the jobs dropped when all they miss together is
        below ``n_min``: no plan can grant any of them (the hook's chunk is at
        most their sum and at least ``n_min``), so such sets decide alike."""
        missing = sum(target - next_token for _, _, _, next_token, target, _ in self.jobs)
        jobs = self.jobs if missing >= n_min else ()
        return (*self.batch_inputs, self.num_free_token_budget, self.num_shadow_room_tokens, jobs)

    @property
    def decision(self) -> tuple:
        return (self.budget_reason, self.grants)


@attrs.define(eq=False)
class PlanRecorder:
    """An observer (``on_plan``) recording :class:`PlannedStep` per instance;
    ``jobs_of(instance_id)`` lists the job source's jobs (any state)."""

    jobs_of: Callable[[str], Sequence[Any]]
    steps: dict[str, list[PlannedStep]] = attrs.Factory(dict)

    def on_plan(self, snapshot: Any, plan: Any) -> None:
        granted: dict[Any, int] = {}
        for g in plan.grants:
            granted[g.job] = granted.get(g.job, 0) + g.num_tokens
        jobs = []
        ordered = sorted(self.jobs_of(snapshot.instance_id), key=lambda j: (-j.switch_probability, j.sequence))
        for job in ordered:
            next_token = job.num_held_tokens + job.num_inflight_tokens - granted.get(job.key, 0)
            stale = job.epoch != job.history.epoch
            if stale or job.num_target_tokens > next_token:  # pending before this plan
                jobs.append((job.key.session_id, job.key.target_model, job.history.epoch,
                             0 if stale else next_token, job.num_target_tokens, round(job.switch_probability, 12)))
        batch = tuple(sorted((v.request_id, v.phase.value, v.num_scheduled_tokens, v.num_context_tokens)
                             for v in snapshot.batch))
        grants = tuple((g.job.session_id, g.job.target_model, g.start_token, g.num_tokens) for g in plan.grants)
        self.steps.setdefault(snapshot.instance_id, []).append(PlannedStep(
            snapshot.instance_id, snapshot.now_s, batch, snapshot.num_waiting, snapshot.admission_blocked,
            snapshot.num_free_token_budget, snapshot.num_shadow_room_tokens, tuple(jobs),
            plan.budget.reason.value, grants))


@attrs.frozen
class Agreement:
    """Two engines' planned steps on one instance, matched by their inputs."""

    instance_id: str
    num_steps: tuple[int, int]  # non-idle planned steps (reference, other)
    num_lockstep: int  # leading steps identical in inputs and decision
    num_same_batch: int  # steps (time, batch, queue) present in both
    num_compared: int  # ... whose pending jobs were identical too
    num_compared_with_grants: int
    num_compared_multi_job: int  # ... that granted two or more jobs (their order was checked)
    mismatches: tuple[tuple[PlannedStep, PlannedStep], ...]  # same inputs, different decision
    first_divergence: tuple[PlannedStep | None, PlannedStep | None]


def _active(steps: Sequence[PlannedStep]) -> list[PlannedStep]:
    return [s for s in steps if s.batch or s.grants or s.jobs]


def compare_steps(instance_id: str, reference: Sequence[PlannedStep], other: Sequence[PlannedStep],
                  n_min: int = 0) -> Agreement:
    """Match steps with identical inputs (:meth:`PlannedStep.plannable_inputs`)
    and compare the decisions."""
    a, b = _active(reference), _active(other)
    lockstep = 0
    for x, y in zip(a, b, strict=False):
        if x.plannable_inputs(n_min) != y.plannable_inputs(n_min) or x.decision != y.decision:
            break
        lockstep += 1
    divergence = (a[lockstep] if lockstep < len(a) else None, b[lockstep] if lockstep < len(b) else None)
    by_batch = {s.batch_inputs: s for s in b}
    same = [(x, by_batch[x.batch_inputs]) for x in a if x.batch_inputs in by_batch]
    compared = [(x, y) for x, y in same if x.plannable_inputs(n_min) == y.plannable_inputs(n_min)]
    return Agreement(
        instance_id, (len(a), len(b)), lockstep, len(same), len(compared),
        sum(1 for x, y in compared if x.grants or y.grants),
        sum(1 for x, y in compared if len(x.grants) > 1 or len(y.grants) > 1),
        tuple((x, y) for x, y in compared if x.decision != y.decision), divergence,
    )


@attrs.define(eq=False)
class PushRecorder:
    """A :class:`~shadowcore.pd.PushPolicy` that records every question to
    ``policy`` and its answer (``clock()``: the time of the question)."""

    policy: Any
    clock: Callable[[], float]
    decisions: dict[str, list[Any]] = attrs.Factory(dict)

    def pull(self, link: Any, candidates: Sequence[Any]) -> Any:
        from shadowcore.pd import PushDecision

        grant = self.policy.pull(link, candidates)
        self.decisions.setdefault(link.decode_instance_id, []).append(
            PushDecision.of(link, candidates, grant, self.clock()))
        return grant


@attrs.frozen
class PushAgreement:
    """Two engines' push decisions on one decode instance, matched by their inputs."""

    decode_id: str
    num_decisions: tuple[int, int]  # (reference, other)
    num_grants: tuple[int, int]
    num_matched: int  # the other's decisions whose inputs the reference also saw
    num_matched_with_grants: int
    mismatches: tuple[tuple[Any, Any], ...]  # same inputs, different grant
    num_same_grant_sequence: int  # leading grants identical in both (job, start, tokens)


def compare_pushes(decode_id: str, reference: Sequence[Any], other: Sequence[Any]) -> PushAgreement:
    """Match :class:`~shadowcore.pd.PushDecision` records by their inputs and compare the grants."""
    by_inputs: dict[tuple, Any] = {}
    for d in reference:
        by_inputs.setdefault(d.inputs, d)
    matched = [(by_inputs[d.inputs], d) for d in other if d.inputs in by_inputs]
    ref_grants = [d.grant for d in reference if d.grant is not None]
    other_grants = [d.grant for d in other if d.grant is not None]
    lead = 0
    for a, b in zip(ref_grants, other_grants, strict=False):
        if a != b:
            break
        lead += 1
    return PushAgreement(
        decode_id, (len(reference), len(other)), (len(ref_grants), len(other_grants)), len(matched),
        sum(1 for a, b in matched if a.grant or b.grant), tuple((a, b) for a, b in matched if a.grant != b.grant),
        lead)
