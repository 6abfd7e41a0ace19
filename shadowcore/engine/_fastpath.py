"""The engines' fast paths: private, not part of the contract a plugin author reads.

The public faces stay the plan/commit protocol (:class:`~shadowcore.hook.EngineHook`'s
``begin_step``/``end_step``, :class:`~shadowcore.events.EventLoop`'s ``at``/``run``, a
:class:`~shadowcore.slack.SlackController`'s ``budget``/``commit``/``observe``). What lets
an engine leave out work that provably changes nothing lives here, used by the engines of
this repository (:mod:`shadowcore.engine.instance`, :mod:`shadowcore.engine.scenario`, the
vLLM backend's scheduler), as SimPy keeps its scheduling internals off ``Environment``'s face:

* Skipping a planned step: :func:`can_skip`, :func:`quiet_until_event`,
  :func:`plans_nothing` say when ``begin_step`` would plan no grant and change no state but
  what :func:`skip_step` does; the engine then reports the iteration through
  :func:`skip_step` instead of building a snapshot.
* Planning from the batch aggregates: :func:`empty_plan_reason` says, from a
  :class:`BatchSummary` (the requests outside the engine's decode aggregate as views, the
  aggregate's slack sign), when ``begin_step`` would plan no grant and which reason it
  would count; the engine then counts it (:func:`count_empty_plan`), builds no snapshot,
  and reports the iteration through :func:`skip_step`.
* Running an event's follow-ups inline: :class:`InlineEventLoop`.

Invariants (``tests/sim/test_speed_equivalence*.py`` pin them: the results with the fast
paths are bit-identical to those without):

* Only the controller types in :data:`_SKIPPABLE` are ever skipped, by their exact type: a
  subclass may override anything, so it always takes the planned path (no flag to restate,
  nothing a subclass can get wrong). For each, ``commit`` + ``observe`` of a plan without
  grants do exactly what its entry's ``observe_skipped`` does, and ``budget`` has no side
  effect.
* A step is skipped only with no observer (it would miss a plan) and no planned step open.
* :func:`empty_plan_reason` answers only for those types, and only when ``begin_step`` would
  call no latency model beyond the base and refresh no job: otherwise ``None`` (plan it).
* The inline loop moves its clock and counts events exactly as ``run`` would have popped
  them: never past a queued event, never while ``run`` has a bound or a stop condition.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import attrs

from shadowcore.events import EventLoop
from shadowcore.hook import _ZERO_BUDGET, EngineHook
from shadowcore.latency import LatencyModel
from shadowcore.slack import (
    EagerController,
    HarvestController,
    NoShadowController,
    PrefillInstanceController,
    SlackController,
    SloSlackController,
    decode_slack_s,
    prefill_slack_s,
    remaining_prefill_s,
)
from shadowcore.types import BudgetReason, Phase, RequestView


def _earn_decode_credit(slack: SlackController, duration_s: float, decode_only: bool) -> None:
    """A credit controller's ``commit`` + ``observe`` of a plan without grants."""
    if decode_only:
        slack.credit.earn_s(duration_s)


@attrs.frozen
class _Skippable:
    #: ``budget`` is always zero (no shadow work ever): the type's own ``never_grants``.
    never_grants: bool = False
    #: What a skipped iteration does to the controller (None: nothing).
    observe_skipped: Callable[[SlackController, float, bool], None] | None = None


#: Controller types whose steps may be skipped, by exact type.
_SKIPPABLE: dict[type, _Skippable] = {
    SloSlackController: _Skippable(observe_skipped=_earn_decode_credit),
    HarvestController: _Skippable(observe_skipped=_earn_decode_credit),
    EagerController: _Skippable(),  # stateless
    PrefillInstanceController: _Skippable(),  # stateless
    NoShadowController: _Skippable(never_grants=NoShadowController.never_grants),
}


def skippable(slack: SlackController) -> _Skippable | None:
    """How ``slack``'s steps may be skipped; None: never (plan every step)."""
    return _SKIPPABLE.get(type(slack))


def _may_skip(hook: EngineHook) -> _Skippable | None:
    """What every skip test needs: no observer, a skippable controller, no planned step open."""
    if hook.observers.observers or hook.in_step:
        return None
    return _SKIPPABLE.get(type(hook.slack))


def can_skip(hook: EngineHook) -> bool:
    """True when ``hook.begin_step`` on a steady decode batch (nothing waiting,
    no admission blocked, every request decoding) would provably plan no grant
    and change no state but what :func:`skip_step` does, so an engine may call
    :func:`skip_step` instead of building the snapshot: a skippable controller
    and either one that never grants, no pending job here, or pending jobs that
    need no refresh and miss fewer whole-block tokens than ``n_min`` (or than
    one block), which the hook's sizing would then never grant."""
    kind = _may_skip(hook)
    if kind is None:
        return False
    if kind.never_grants:
        return True
    jobs = hook.manager.pending_jobs(hook.instance_id)
    if not jobs:
        return True
    evictions = hook.port.eviction_count()
    missing = 0
    for pending in jobs:
        if pending.validated_at != evictions or pending.epoch != pending.history.epoch:
            return False  # begin_step would refresh it
        missing += pending.num_missing_tokens
    block = hook.port.block_size
    n = missing // block * block
    return n == 0 or n < hook.slack.n_min


def quiet_until_event(hook: EngineHook) -> bool:
    """True when :func:`can_skip` holds and keeps holding until something
    outside this instance's steady iterations happens: a skippable controller
    that never grants, or no pending job on this instance (a job becomes
    pending only through the router side or a routed call's output, both events
    of their own)."""
    kind = _may_skip(hook)
    return kind is not None and (kind.never_grants or not hook.manager.pending_jobs(hook.instance_id))


def plans_nothing(hook: EngineHook) -> bool:
    """True when ``hook.begin_step`` on *any* snapshot would plan no grant and
    change no state but what :func:`skip_step` does (a skippable controller that
    never grants): an engine may then build no snapshot at all and report each
    iteration (empty ones with 0.0 s) through :func:`skip_step`."""
    kind = _may_skip(hook)
    return kind is not None and kind.never_grants


def skip_accounting(hook: EngineHook) -> Callable[[float, bool], None] | None:
    """:func:`skip_step` for this hook as one callable ``(duration_s,
    decode_only)``, or None when it does nothing (an engine may then leave
    the calls out). Only for a hook whose steps may be skipped."""
    kind = _SKIPPABLE[type(hook.slack)]
    return None if kind.observe_skipped is None else functools.partial(kind.observe_skipped, hook.slack)


def skip_step(hook: EngineHook, duration_s: float, decode_only: bool) -> None:
    """An iteration :func:`can_skip` allowed ran for ``duration_s``: the
    controller's accounting for it (``commit`` + ``observe`` of a plan without
    grants); no plan, no outcome, no observer call."""
    kind = _SKIPPABLE[type(hook.slack)]
    if kind.observe_skipped is not None:
        kind.observe_skipped(hook.slack, duration_s, decode_only)


@attrs.frozen
class BatchSummary:
    """What the hook would see in a snapshot, with the engine's decode
    aggregate in place of its per-request views: ``views`` are the batch's
    requests outside the aggregate (batch order); ``aggregate_slack_positive(margin)``
    says whether every aggregated decode's Eq. 1 slack (:func:`decode_slack_s`
    at ``now_s``) is > 0. The other fields are the snapshot's."""

    now_s: float
    num_waiting: int
    admission_blocked: bool
    tpot_slo_s: float
    num_free_token_budget: int
    num_shadow_room_tokens: int
    is_idle: bool
    has_routed: bool  # anywhere in the batch
    views: tuple[RequestView, ...]
    aggregate_slack_positive: Callable[[float], bool]


def _slack_positive(s: BatchSummary, latency: LatencyModel, margin: float, chunk_tokens: int) -> bool:
    """``min_batch_slack_s(snapshot) > 0``: every request's slack, the aggregate's by its sign."""
    for r in s.views:
        if r.phase is Phase.DECODE:
            v = decode_slack_s(r, s.now_s, margin)
        else:
            v = prefill_slack_s(r, s.now_s, margin, remaining_prefill_s(r, latency, chunk_tokens))
        if not v > 0:
            return False
    return s.aggregate_slack_positive(margin)


def _budget_sign(slack: SlackController, s: BatchSummary, latency: LatencyModel) -> tuple[bool, BudgetReason] | None:
    """(``budget(snapshot).budget_s > 0``, its reason) for the exact types whose
    ``budget`` this restates; None for any other."""
    kind = type(slack)
    if kind is EagerController:
        return True, BudgetReason.EAGER
    if kind not in (SloSlackController, HarvestController, PrefillInstanceController):
        return None
    if s.num_waiting > 0:
        return False, BudgetReason.WAITING
    if s.admission_blocked:
        return False, BudgetReason.BLOCKED
    if kind is PrefillInstanceController:  # max(0, min(max_iteration_s > 0, slack)) > 0
        return _slack_positive(s, latency, slack.margin, slack.chunk_tokens), BudgetReason.PREFILL_SLACK
    if s.is_idle:
        return slack.beta * s.tpot_slo_s > 0, BudgetReason.IDLE
    if kind is HarvestController:  # max(0, min(balance, cap > 0)) > 0
        return slack.credit.balance_s > 0, BudgetReason.CREDIT
    if s.has_routed:
        return slack.credit.balance_s > 0, BudgetReason.ROUTED_CREDIT
    return _slack_positive(s, latency, slack.margin, slack.chunk_tokens), BudgetReason.SLO_SLACK


def empty_plan_reason(hook: EngineHook, summary: BatchSummary) -> str | None:
    """The reason ``hook.begin_step`` would count for the snapshot ``summary``
    stands for, when it would plan no grant and change no state but that
    count and what :func:`skip_step` does (``commit``/``observe`` of an empty
    plan); None when it might grant, refresh a job, or is not a type restated
    here (then build the snapshot and plan). The same steps as ``begin_step``:
    a zero budget counts its reason; a positive one with no pending job counts
    ``no_jobs``; pending jobs that need no refresh and miss fewer whole-block
    tokens than ``n_min`` (or none) make ``_size`` return nothing before any
    latency lookup, counting ``EngineHook._empty_reason``."""
    if _may_skip(hook) is None:
        return None
    sign = _budget_sign(hook.slack, summary, hook.latency)
    if sign is None:
        return None
    positive, reason = sign
    if not positive:
        return _ZERO_BUDGET.get(reason, "zero_budget")
    jobs = hook.manager.pending_jobs(hook.instance_id)
    if not jobs:
        return "no_jobs"
    evictions = hook.port.eviction_count()
    missing = 0
    for pending in jobs:
        if pending.validated_at != evictions or pending.epoch != pending.history.epoch:
            return None  # begin_step would refresh it
        missing += pending.num_missing_tokens
    block = hook.port.block_size
    n = missing // block * block
    if n == 0 or n < hook.slack.n_min:
        return hook._empty_reason(min(summary.num_free_token_budget, summary.num_shadow_room_tokens))
    return None


def count_empty_plan(hook: EngineHook, why: str) -> None:
    """``begin_step``'s count of a plan :func:`empty_plan_reason` answered for."""
    hook.step_counts[why] = hook.step_counts.get(why, 0) + 1


@attrs.define(eq=False)
class InlineEventLoop(EventLoop):
    """:class:`~shadowcore.events.EventLoop` whose running action may run its
    own next events inline, saving the heap round trip, when nothing queued
    comes first and ``run`` has neither a bound nor a stop condition."""

    _free_running: bool = False  # inside run() with no until_s and no stop

    def run(self, until_s: float | None = None, stop: Callable[[], bool] | None = None) -> None:
        self._free_running = until_s is None and stop is None
        try:
            super().run(until_s, stop)
        finally:
            self._free_running = False

    def advance_to(self, time_s: float) -> bool:
        """For the action of the event being run, as its last step: when an
        event at ``time_s`` scheduled now would be the very next one ``run``
        pops (``run`` has no bound or stop condition and every queued event is
        strictly later), move the clock there, count it, and return True; the
        caller then runs that event's action itself, inline. Otherwise change
        nothing and return False."""
        if not self._free_running or time_s < self.now_s or self.peek_s() <= time_s:
            return False
        self.now_s = time_s
        self.num_events += 1
        return True

    def inline_horizon_s(self) -> float:
        """For the action of the event being run: events of its own that end
        strictly before this time may be run inline (each as ``advance_to``
        would); ``-inf`` when ``run`` has a bound or a stop condition, ``inf``
        when nothing is queued."""
        return self.peek_s() if self._free_running else -math.inf

    def advance_inline(self, time_s: float, num_events: int) -> None:
        """``num_events`` events before :meth:`inline_horizon_s` were run inline
        by the current action, the last at ``time_s``: count them, move the clock."""
        if num_events <= 0:
            return
        if not self._free_running or time_s < self.now_s or self.peek_s() <= time_s:
            raise ValueError(f"inline events up to {time_s} are not before the next queued event (now {self.now_s})")
        self.now_s = time_s
        self.num_events += num_events
