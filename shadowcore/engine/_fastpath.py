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
* Planning from the batch aggregates: :func:`empty_plan_reason` says, from a snapshot with
  a :class:`~shadowcore.types.DecodeAggregate` (views only for the requests outside the
  engine's decode aggregate), when ``begin_step`` would plan no grant and which reason it
  would count; the engine then counts it (:func:`count_empty_plan`), builds no full
  snapshot, and reports the iteration through :func:`skip_step`. Jobs that take no
  grant decide first (``no_jobs``), before any snapshot is built.
* Counting what was skipped: :func:`count_skipped` counts the iterations skipped on
  :func:`can_skip` (one by one or in runs) as ``begin_step`` would have
  (``no_jobs``), so a hook's step counts sum to its iterations on every path.
* Running an event's follow-ups inline: :class:`InlineEventLoop`.

Invariants (``tests/sim/test_speed_equivalence*.py`` pin them: the results with the fast
paths are bit-identical to those without):

* Only the controller types in :data:`_SKIPPABLE` are ever skipped, by their exact type: a
  subclass may override anything, so it always takes the planned path (no flag to restate,
  nothing a subclass can get wrong). For each, ``commit`` + ``observe`` of a plan without
  grants do exactly what its entry's ``observe_skipped`` does, and ``budget`` has no side
  effect.
* A step is skipped only with no observer (it would miss a plan) and no planned step open.
* :func:`empty_plan_reason` answers only for the types in ``_BUDGET_ON_AGGREGATE`` (their
  own ``budget`` and the hook's own ``_size`` on the aggregate snapshot: one owner per
  rule), after the same job refresh ``begin_step`` does; otherwise ``None``.
* The inline loop moves its clock and counts events exactly as ``run`` would have popped
  them: never past a queued event, never while ``run`` has a bound or a stop condition.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import attrs

from shadowcore.events import EventLoop
from shadowcore.hook import _ZERO_BUDGET, EngineHook
from shadowcore.latency import LatencyModel, PrefillChunk
from shadowcore.slack import (
    EagerController,
    HarvestController,
    NoShadowController,
    PrefillInstanceController,
    SlackController,
    SloSlackController,
)
from shadowcore.types import Phase, StepSnapshot


def _earn_decode_credit(slack: SlackController, duration_s: float, decode_only: bool, routed: bool) -> None:
    """A credit controller's ``commit`` + ``observe`` of a plan without grants."""
    if slack.credit.accrues(decode_only, routed):
        slack.credit.earn_s(duration_s)


@attrs.frozen
class _Skippable:
    #: ``budget`` is always zero (no shadow work ever): the type's own ``never_grants``.
    never_grants: bool = False
    #: What a skipped iteration does to the controller (None: nothing).
    observe_skipped: Callable[[SlackController, float, bool, bool], None] | None = None


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
    for pending in jobs:
        if pending.validated_at != evictions or pending.epoch != pending.history.epoch:
            return False  # begin_step would refresh it
    return hook._takes_no_grant(jobs)


def quiet_until_event(hook: EngineHook) -> bool:
    """True when :func:`can_skip` holds and keeps holding until something
    outside this instance's steady iterations happens: a skippable controller
    that never grants, or no pending job on this instance (a job becomes
    pending only through the router side or a routed call's output, both events
    of their own)."""
    kind = _may_skip(hook)
    return kind is not None and (kind.never_grants or not hook.manager.pending_jobs(hook.instance_id))


def inert(hook: EngineHook) -> bool:
    """True when ``hook`` does nothing at all for an iteration of any shape:
    :func:`plans_nothing` holds and a skipped step changes nothing
    (:func:`skip_step`, :func:`count_skipped` and :func:`tick_accounting` do
    nothing for its controller; :func:`can_skip` and :func:`quiet_until_event`
    hold). An engine that finds it so at an iteration's start may run that
    iteration (its end included) as with no hook, calling none of those."""
    return not (hook.observers.observers or hook._pending is not None) and type(hook.slack) in _INERT


#: Controller types :func:`inert` holds for (with no observer and no open plan: :func:`_may_skip`'s test, inline,
#: as it is asked at every iteration start): never grants, a skipped step changes nothing.
_INERT = frozenset(t for t, kind in _SKIPPABLE.items() if kind.never_grants and kind.observe_skipped is None)


def plans_nothing(hook: EngineHook) -> bool:
    """True when ``hook.begin_step`` on *any* snapshot would plan no grant and
    change no state but what :func:`skip_step` does (a skippable controller that
    never grants): an engine may then build no snapshot at all and report each
    iteration (empty ones with 0.0 s) through :func:`skip_step`."""
    kind = _may_skip(hook)
    return kind is not None and kind.never_grants


def tick_accounting(hook: EngineHook, decode_only: bool, routed: bool) -> Callable[[float], None] | None:
    """:func:`skip_step` for a run of skipped iterations of one shape
    (``decode_only``, ``routed``) as one callable ``(duration_s)``, or None when
    it does nothing for that shape: what a credit controller's skipped step
    does is decided by its credit's ``accrues(decode_only, routed)``, which
    reads only its configuration, so it is asked once per run, not per
    iteration (``_earn_decode_credit``'s rule, one owner). Only for a hook
    whose steps may be skipped, and only while nothing changes the controller's
    configuration (a run of an engine's own steady iterations)."""
    kind = _SKIPPABLE[type(hook.slack)]
    if kind.observe_skipped is None:
        return None
    if kind.observe_skipped is _earn_decode_credit:
        credit = hook.slack.credit
        return credit.earn_s if credit.accrues(decode_only, routed) else None
    observe, slack = kind.observe_skipped, hook.slack
    return lambda duration_s: observe(slack, duration_s, decode_only, routed)


def skip_step(hook: EngineHook, duration_s: float, decode_only: bool, routed: bool) -> None:
    """An iteration :func:`can_skip` allowed ran for ``duration_s``: the
    controller's accounting for it (``commit`` + ``observe`` of a plan without
    grants); no plan, no outcome, no observer call. ``decode_only`` and
    ``routed`` are its snapshot's ``batch_shape.is_decode_only`` and
    ``has_routed`` (the routed-step credit accrues by both)."""
    kind = _SKIPPABLE[type(hook.slack)]
    if kind.observe_skipped is not None:
        kind.observe_skipped(hook.slack, duration_s, decode_only, routed)


#: Controller types whose ``budget`` reads of a snapshot only what an aggregate snapshot
#: (:class:`~shadowcore.types.DecodeAggregate`) answers, and changes nothing.
_BUDGET_ON_AGGREGATE = (SloSlackController, HarvestController, EagerController, PrefillInstanceController)


def empty_plan_reason(hook: EngineHook, snapshot_of: Callable[[], StepSnapshot],
                      room_tokens: Callable[[], int] | None = None) -> str | None:
    """The reason ``hook.begin_step`` would count for the iteration the
    snapshot ``snapshot_of()`` stands for (its decode aggregate in place of
    those views), when it would plan no grant and change no state but that
    count, the job refresh it does first, and what :func:`skip_step` does
    (``commit``/``observe`` of an empty plan); None when it might grant, or the
    controller is not of a type in ``_BUDGET_ON_AGGREGATE`` (then build the
    full snapshot and plan: its refresh then finds nothing to do). The same
    steps as ``begin_step``, on the controller's own ``budget``: the jobs
    refreshed first (``EngineHook._refreshed_jobs``; ``budget`` of a
    controller that ``reads_imminence`` then finds nothing left to refresh), and
    jobs that take no grant (``EngineHook._takes_no_grant``: none pending, or
    tails below the smallest grant) count ``no_jobs`` with no snapshot built
    and no budget asked (``budget`` is pure for these types); else a zero
    budget counts its reason; under a positive one, jobs for which the hook's
    own ``_size`` grants nothing (timed from the aggregates by
    ``predict_batch_s``, bit-identical; without it only when
    ``EngineHook._grant_range`` leaves no range, which needs no latency
    lookup) count ``EngineHook._empty_reason``.

    ``room_tokens``: the snapshot's ``num_shadow_room_tokens`` on demand
    (then that field is not read): only the sizing of pending jobs under a
    positive budget needs it, so an engine whose KV manager computes the room
    (``shadow_room_blocks``) leaves that out for the other iterations."""
    if _may_skip(hook) is None or type(hook.slack) not in _BUDGET_ON_AGGREGATE:
        return None
    jobs = hook._refreshed_jobs()
    if hook._takes_no_grant(jobs):
        return "no_jobs"
    snapshot = snapshot_of()
    budget, read = hook.budget(snapshot)  # (a controller that reads imminence refreshes again: nothing left)
    jobs = jobs if read is None else read
    if not budget.budget_s > 0:
        return _ZERO_BUDGET.get(budget.reason, "zero_budget")
    room = snapshot.num_shadow_room_tokens if room_tokens is None else room_tokens()
    limit = min(snapshot.num_free_token_budget, room)
    upper, smallest = hook._grant_range(jobs, limit)
    if upper <= 0 or smallest > upper:
        return hook._empty_reason(limit)
    predict_with = _aggregate_predictor(snapshot, hook.latency)
    if predict_with is None:
        return None
    grants, _ = hook._size(jobs, predict_with, predict_with(()), budget, limit)  # pure: the hook sizes it again
    return None if grants else hook._empty_reason(limit)


def _aggregate_predictor(snapshot: StepSnapshot, latency: LatencyModel) -> Callable[[tuple], float] | None:
    """``chunks -> latency.predict_s(snapshot.batch_shape.with_prefills(chunks))`` of the
    full snapshot, from the views and the decode aggregate (``predict_batch_s``,
    bit-identical), or None when the model cannot tell from aggregates."""
    fast = getattr(latency, "predict_batch_s", None)
    agg = snapshot.aggregate
    if fast is None or agg is None:
        return None
    prefills = tuple(PrefillChunk(r.num_scheduled_tokens, r.num_context_tokens) for r in snapshot.batch
                     if r.phase is Phase.PREFILL and r.num_scheduled_tokens > 0)
    decodes = [r.num_context_tokens for r in snapshot.batch if r.phase is Phase.DECODE]
    nd, total = agg.num_decodes + len(decodes), agg.total_context + sum(decodes)
    longest = max(agg.max_context, *decodes) if decodes else agg.max_context
    if fast(prefills, nd, total, longest) is None:
        return None
    return lambda chunks: fast(prefills + tuple(chunks), nd, total, longest)


def count_empty_plan(hook: EngineHook, why: str) -> None:
    """``begin_step``'s count of a plan :func:`empty_plan_reason` answered for."""
    hook.step_counts[why] = hook.step_counts.get(why, 0) + 1


def count_skipped(hook: EngineHook, num: int = 1) -> None:
    """``begin_step``'s count of ``num`` iterations skipped on :func:`can_skip`
    or :func:`quiet_until_event` (no job takes a grant: ``no_jobs``), so that
    the counts cover every iteration, skipped or planned, with the reason
    ``begin_step`` would have counted; nothing for a controller that never
    grants (its steps are not counted: it has no shadow work to explain)."""
    if num and not _SKIPPABLE[type(hook.slack)].never_grants:
        hook.step_counts["no_jobs"] = hook.step_counts.get("no_jobs", 0) + num


@attrs.define(eq=False)
class InlineEventLoop(EventLoop):
    """:class:`~shadowcore.events.EventLoop` whose running action may run its
    own next events inline, saving the heap round trip, when nothing queued
    comes first and ``run`` has neither a bound nor a stop condition."""

    _free_running: bool = False  # inside run() with no until_s and no stop
    #: Called once when a free run has popped every event (the cluster's deferred instances run to their end
    #: there); it queues nothing.
    on_empty: Callable[[], None] | None = None

    def run(self, until_s: float | None = None, stop: Callable[[], bool] | None = None) -> None:
        self._free_running = until_s is None and stop is None
        try:
            super().run(until_s, stop)
            if self._free_running and self.on_empty is not None:
                self.on_empty()
                if self._heap:
                    raise AssertionError("on_empty queued an event")
        finally:
            self._free_running = False

    @property
    def free_running(self) -> bool:
        """Inside ``run`` with neither a bound nor a stop condition: every queued event will be popped."""
        return self._free_running

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
