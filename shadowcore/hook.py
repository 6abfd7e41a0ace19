"""[3] The engine hook: the one object a backend calls, once per iteration.

``plan = hook.begin_step(snapshot)`` then, after the iteration ran,
``hook.end_step(outcome)`` (plan, then commit, as vLLM's ``schedule()`` /
``update_from_output()``). In between the backend runs the plan's grants last
in its batch and reports what it computed.

Invariants (property-tested):

* A plan has no shadow tokens when the snapshot shows a waiting request or a
  blocked admission (unless the policy is Eager).
* The predicted iteration time with the plan fits the budget: the whole
  iteration for slack and idle budgets, the added time for credit budgets.
* Shadow tokens never exceed the token budget left, the shadow KV room, or the
  missing tokens of the jobs; a plan below ``n_min`` is empty.
* Grants are whole blocks, go to jobs in the grant order, and start where
  the job's held prefix ends. The grant order is the job source's
  (non-increasing switch probability, older job first), except under a
  controller that is ``imminent_first``: then imminent jobs first, then the
  others, each group in the source's order (:func:`grant_order`, the one
  owner of the rule; the simulator and vLLM's scheduler both plan here).
* A controller that ``reads_imminence`` is told whether the first pending
  job in the grant order (the one the grant starts with) is imminent; no
  other is told anything. An ``imminent_first`` controller that does not
  read imminence is refused at construction (no source would mark its jobs).
* Deterministic: the same snapshots and outcomes give the same plans.

The hook's face is the plan/commit protocol only. The engines of this
repository also skip steps the hook provably plans nothing for; that fast path
is theirs (``shadowcore.engine._fastpath``), not part of this contract.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import attrs

from shadowcore.job import SessionHistory, ShadowJob
from shadowcore.latency import LatencyModel, PrefillChunk
from shadowcore.metrics import ObserverSet
from shadowcore.slack import SlackController
from shadowcore.types import BudgetReason, JobKey, ShadowGrant, SlackBudget, StepOutcome, StepPlan, StepSnapshot

_ZERO_BUDGET = {BudgetReason.WAITING: "waiting", BudgetReason.BLOCKED: "blocked"}


@runtime_checkable
class EnginePort(Protocol):
    """What the hook asks the engine it is attached to about its KV cache."""

    @property
    def block_size(self) -> int:
        ...

    def cached_prefix_tokens(self, history: SessionHistory) -> int:
        """Tokens of ``history`` this instance holds (device or host tier)."""
        ...

    def eviction_count(self) -> int:
        """A counter that changes whenever a cached block is evicted; while it
        is unchanged a job's held prefix is still valid."""
        ...


@runtime_checkable
class JobSource(Protocol):
    """Where a hook gets its jobs: the router-side :class:`~shadowcore.manager.ShadowManager`, or an
    engine-local table of shadow requests (the vLLM scheduler's)."""

    def pending_jobs(self, instance_id: str) -> list[ShadowJob]:
        """Jobs on the instance with tokens missing, highest switch probability first."""
        ...

    def job(self, key: JobKey) -> ShadowJob | None:
        ...


@attrs.define(eq=False)
class EngineHook:
    """Per-instance planner of shadow chunks."""

    instance_id: str
    manager: JobSource  # a ShadowManager, or an engine-local job table
    slack: SlackController
    latency: LatencyModel
    port: EnginePort
    observers: ObserverSet = attrs.Factory(ObserverSet)
    #: Iterations by what decided their shadow work (``shadowcore.diagnostics.STEP_REASONS``): each
    #: ``begin_step`` counts one; an engine that skips an iteration as provably empty counts it with the
    #: reason ``begin_step`` would have given (the engines' fast paths: ``count_empty_plan``, ``count_skipped``).
    step_counts: dict[str, int] = attrs.field(init=False, factory=dict)
    _pending: tuple[StepSnapshot, StepPlan] | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        if self.slack.imminent_first and not self.slack.reads_imminence:
            raise ValueError(f"{type(self.slack).__name__}: imminent_first without reads_imminence (the job sources "
                             "track imminence only for a controller that reads it: no job would ever come first)")

    @property
    def in_step(self) -> bool:
        """A plan is open: ``begin_step`` was called and its ``end_step`` not yet."""
        return self._pending is not None

    def begin_step(self, snapshot: StepSnapshot) -> StepPlan:
        if self._pending is not None:
            raise RuntimeError(f"{self.instance_id}: begin_step twice without end_step")
        base = snapshot.batch_shape
        base_s = self.latency.predict_s(base)
        budget, jobs = self.budget(snapshot)
        jobs = self._refreshed_jobs() if jobs is None else jobs  # the reason is the jobs' first (STEP_REASONS)
        grants: tuple[ShadowGrant, ...] = ()
        predicted = base_s
        if self._takes_no_grant(jobs):
            why = "no_jobs"
        elif budget.budget_s > 0:
            limit = min(snapshot.num_free_token_budget, snapshot.num_shadow_room_tokens)
            grants, predicted = self._size(jobs, lambda chunks: self.latency.predict_s(base.with_prefills(chunks)),
                                           base_s, budget, limit)
            why = "granted" if grants else self._empty_reason(limit)
        else:
            why = _ZERO_BUDGET.get(budget.reason, "zero_budget")
        if not self.slack.never_grants:  # a controller that never grants is not counted (shadowcore.diagnostics)
            self.step_counts[why] = self.step_counts.get(why, 0) + 1
        plan = StepPlan(
            self.instance_id, snapshot.iteration, budget, grants, base_s, predicted,
            normal_priority=self.slack.normal_priority, imminent_first=self.slack.imminent_first,
        )
        self._reserve(plan)
        self.slack.commit(snapshot, plan)
        self._pending = (snapshot, plan)
        self.observers.emit("on_plan", snapshot, plan)
        return plan

    def end_step(self, outcome: StepOutcome) -> None:
        if self._pending is None or outcome.iteration != self._pending[1].iteration:
            raise RuntimeError(f"{self.instance_id}: end_step without a matching begin_step")
        snapshot, plan = self._pending
        self._pending = None
        reported = {r.grant for r in outcome.results}
        for grant in plan.grants:
            if grant not in reported:
                self._commit(grant, 0)
        for r in outcome.results:
            self._commit(r.grant, r.num_computed_tokens)
        self.slack.observe(snapshot, plan, outcome)
        self.observers.emit("on_step_end", snapshot, plan, outcome)

    # -- planning -------------------------------------------------------------------
    def budget(self, snapshot: StepSnapshot) -> tuple[SlackBudget, list[ShadowJob] | None]:
        """The controller's budget for ``snapshot``, and the refreshed pending
        jobs when they were needed for it (a controller that
        ``reads_imminence`` is told whether the first is imminent); ``None``
        when they were not read. Changes no state but the refresh."""
        if not self.slack.reads_imminence:
            return self.slack.budget(snapshot, self.latency), None
        jobs = self._refreshed_jobs()
        return self.slack.budget(snapshot, self.latency, imminent=bool(jobs) and jobs[0].imminent), jobs

    def _refreshed_jobs(self) -> list[ShadowJob]:
        """Pending jobs in the grant order (:func:`grant_order`), each checked
        against the cache; the source is asked again only when a refresh may
        have changed which jobs are pending (a job whose prefix got fully
        cached drops out): when a refresh moved a job's epoch or held
        prefix. A refresh that leaves both as they were changes no job's
        missing tokens, so the source's answer would be the same list."""
        evictions = self.port.eviction_count()
        jobs = self.manager.pending_jobs(self.instance_id)
        refreshed = False
        for job in jobs:
            if job.validated_at != evictions or job.epoch != job.history.epoch:
                before = (job.epoch, job.num_held_tokens)
                job.refresh(self.port.cached_prefix_tokens(job.history), evictions)
                refreshed = refreshed or (job.epoch, job.num_held_tokens) != before
        if refreshed:
            jobs = self.manager.pending_jobs(self.instance_id)
        return grant_order(jobs) if self.slack.imminent_first else jobs

    def _takes_no_grant(self, jobs: Sequence[ShadowJob]) -> bool:
        """True when ``jobs`` (refreshed) together miss fewer whole-block tokens
        than the smallest grant (``n_min`` tokens, at least one block): then no
        budget, token budget or room makes :meth:`_size` grant anything (its
        ``upper`` is below its ``smallest``, or zero). The one owner of that
        rule: ``begin_step`` counts such a step as ``no_jobs`` before it asks
        the budget, and the engines' fast paths skip on it."""
        block = self.port.block_size
        return sum(j.num_missing_tokens for j in jobs) // block < max(1, -(-self.slack.n_min // block))

    def _size(
        self, jobs: Sequence[ShadowJob], predict_with: Callable[[tuple[PrefillChunk, ...]], float], base_s: float,
        budget: SlackBudget, limit: int,
    ) -> tuple[tuple[ShadowGrant, ...], float]:
        """Lines 10-14: the largest whole-block n that fits, capped, >= n_min;
        ``predict_with(chunks)`` is the iteration's time with ``chunks`` added
        (``base_s`` with none). Pure."""
        block = self.port.block_size
        upper, smallest = self._grant_range(jobs, limit)
        if upper <= 0:
            return (), base_s

        def fits(num_blocks: int) -> tuple[bool, float]:
            t = predict_with(_chunks(jobs, num_blocks * block))
            used = t - base_s if budget.bounds_stretch else t
            return used <= budget.budget_s, t

        lo, lo_s = 0, base_s
        if smallest > upper or (0 < smallest < upper and not fits(smallest)[0]):
            return (), base_s  # fits is monotone: nothing from n_min up fits (a routed step's small credit)
        ok, t_hi = fits(upper)
        if ok:
            lo, lo_s = upper, t_hi
        else:
            hi = upper
            while hi - lo > 1:  # invariant: fits(lo), not fits(hi)
                mid = (lo + hi) // 2
                ok, t_mid = fits(mid)
                if ok:
                    lo, lo_s = mid, t_mid
                else:
                    hi = mid
        n = lo * block
        if n == 0 or n < self.slack.n_min:
            return (), base_s
        return _grants(jobs, n), lo_s

    def _grant_range(self, jobs: Sequence[ShadowJob], limit: int) -> tuple[int, int]:
        """(upper, smallest): the most whole blocks a grant may have (``limit``
        tokens, the jobs' missing tokens) and the fewest (``n_min`` tokens);
        with ``upper <= 0`` or ``smallest > upper`` nothing is granted, which
        needs no latency lookup (engines' fast paths rely on this)."""
        block = self.port.block_size
        return min(limit, sum(j.num_missing_tokens for j in jobs)) // block, -(-self.slack.n_min // block)

    def _empty_reason(self, limit: int) -> str:
        """Why a positive budget with pending jobs planned nothing: less token
        budget or shadow KV room than the smallest grant (``n_min``, at least
        one block), or else what fits the budget and the jobs is below it."""
        block = self.port.block_size
        return "no_room" if limit < max(block, -(-self.slack.n_min // block) * block) else "below_n_min"

    def _reserve(self, plan: StepPlan) -> None:
        for g in plan.grants:
            job = self.manager.job(g.job)
            assert job is not None
            job.reserve(g.num_tokens)

    def _commit(self, grant: ShadowGrant, num_computed: int) -> None:
        job = self.manager.job(grant.job)
        if job is not None:  # closed meanwhile: the routed call took over
            job.commit(grant.epoch, grant.start_token, grant.num_tokens, num_computed)


def grant_order(jobs: Sequence[ShadowJob]) -> list[ShadowJob]:
    """The grant order under an ``imminent_first`` controller: ``jobs`` (in the
    source's order) with the imminent ones moved ahead of the rest, each group
    keeping its order (a stable partition)."""
    return [j for j in jobs if j.imminent] + [j for j in jobs if not j.imminent]


def _take(jobs: Sequence[ShadowJob], num_tokens: int) -> list[tuple[ShadowJob, int]]:
    out = []
    left = num_tokens
    for job in jobs:
        if left <= 0:
            break
        n = min(left, job.num_missing_tokens)
        if n > 0:
            out.append((job, n))
            left -= n
    return out


def _chunks(jobs: Sequence[ShadowJob], num_tokens: int) -> tuple[PrefillChunk, ...]:
    return tuple(PrefillChunk(n, job.next_token) for job, n in _take(jobs, num_tokens))


def _grants(jobs: Sequence[ShadowJob], num_tokens: int) -> tuple[ShadowGrant, ...]:
    return tuple(
        ShadowGrant(job.key, job.epoch, job.next_token, n, job.switch_probability, job.imminent)
        for job, n in _take(jobs, num_tokens)
    )
