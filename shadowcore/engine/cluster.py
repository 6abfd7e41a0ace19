"""The simulator's cluster: engine instances on one event loop, by model and
by id; the :class:`~shadowcore.manager.ClusterPort` the router side reads.

Invariants: an instance runs at most one iteration at a time; an idle
instance starts one as soon as it is kicked and has work; iteration ends are
``STEP_END`` events (:mod:`shadowcore.engine.kinds`), wake-ups ``WAKE``.

Lazy ticks (``lazy_ticks``): an instance in a run of plain steady ticks
(``EngineInstance.can_run_steady``) does not put each tick's end on the event
heap: the cluster asks how many ends from now on are provably plain
(``EngineInstance.plain_ends``) and queues one event, at the end after them;
the ends in between are applied only when something observes the instance
(its ``touched`` callback, called by every public method that reads or changes
its state; the placement estimate reads only the queued prefill work, the latency
model and the token budget, which no plain tick changes; a cached-prefix lookup whose first
block the instance's KV holds nowhere, ``KVClassManager.may_hold_prefix``, is 0 with no
catch-up, since plain ticks name no block) or at that event. **An instance's
state is exact at every time something observes it**: a touch at ``t`` first
applies every pending end at or before ``t`` (and before the queued event), so
it sees what the eager loop would have shown; a touch that changes the
instance (a request enqueued, a shadow job that may become pending on it: the
manager's ``on_job_active``, see :meth:`EngineCluster.watch_jobs`) also cuts
the run there: the iteration then in flight ends as an ordinary ``STEP_END``
event, and the queued one is stale (popped and ignored). Plain ticks touch
nothing outside their instance and change nothing another event reads but
through those methods, so results are bit-identical to the eager loop's
(``tests/sim/test_speed_equivalence*.py``); only ``EventLoop.num_events``
moves (fewer events are popped). Tie-break: a touch at time ``t`` comes after
every pending end at ``t`` (iteration ends come first at equal times); two
instances' iteration ends at the same instant keep no order between them
beyond that.

Deferred instances (``feed``, ``defer_instances``): an instance that takes its own normal arrivals, holds no
routed call and whose hook plans nothing (or that has none; or, with the jobs watched, whose hook has no job
pending there: then it plans nothing until one activates, and the manager says so before ``pending_jobs``
shows the job) changes nothing but itself until the router side observes it, so it puts no event on the heap:
its iteration ends, arrivals, the router's settles (``kick_all``) and wake-ups wait in its ``_Local`` and are
applied, in the loop's order for one instance (time; at one instant ends, settles, arrivals, wake-ups: the
kinds' order), whenever something observes it (its ``touched``, the
placement reads, a settle's or a wake-up's own ``kick``) and, at the end of the run, by the loop's ``on_empty``.
**Its state is exact at every observation**: a read at ``t`` first applies its ends and settles at or before
``t`` and its arrivals and wake-ups before ``t`` (those at ``t`` come after the router's event at ``t``). A change
(a routed call enqueued, a job activated) makes it eager again: its iteration in flight, due wake-ups and next
arrival go on the heap; its next iteration end with no routed call in it defers it again. Only the records of its
finishes leave it (``ScenarioRun`` puts them back in finishing order) and the loop's clock at the end (the last
event of all, as the loop's would be). Ties: as with lazy ticks, two instances' events at one instant keep no
order between them beyond the kinds' order.

Placement is linear in the instances of a model per routed call, at a small
constant: an instance that holds none of the session's prefix answers from
one membership test, and the placement estimates of one instant are computed
once per (latency model, token budget, work) (:meth:`EngineCluster.estimated_prefill_completion_s`).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence

import attrs

from shadowcore.engine import _fastpath
from shadowcore.engine._fastpath import InlineEventLoop
from shadowcore.engine.instance import EngineInstance, EngineRequest
from shadowcore.engine.kinds import NORMAL, STEP_END, WAKE
from shadowcore.job import SessionHistory
from shadowcore.latency import chunked_prefill_s, windowed_prefill_s

#: Plain ends one lazy run may hold back (its end times are computed up front: a cut wastes the rest).
MAX_LAZY_ENDS = 256


class _LazyRun:
    """An instance's pending plain ends: the next one at ``pending_s``, none at or after ``stop_s``
    (the time of its queued event)."""

    __slots__ = ("pending_s", "stop_s")

    def __init__(self, pending_s: float, stop_s: float) -> None:
        self.pending_s, self.stop_s = pending_s, stop_s


class _Feed:
    """An instance's own normal arrivals: ``requests[next]`` on is still to come; ``start(instance, request id,
    request, arrival time)`` builds the engine request. ``token`` names the one queued arrival event that is live
    (a deferred instance takes its arrivals itself: its queued event goes stale)."""

    __slots__ = ("callbacks", "next", "next_s", "requests", "start", "token")

    def __init__(self, requests: Sequence[tuple], start: Callable) -> None:
        self.requests, self.start, self.next, self.token = requests, start, 0, 0
        self.next_s = requests[0][1].arrival_s if requests else math.inf  # the arrival of requests[next]
        self.callbacks: tuple | None = None  # (on_token, on_finish) of the requests ``start`` builds

    def begin(self, inst: EngineInstance, request_id: str, request, arrival_s: float) -> EngineRequest:
        """``start``'s engine request for one arrival; the first one's callbacks name the feed's own."""
        req = self.start(inst, request_id, request, arrival_s)
        if self.callbacks is None:
            self.callbacks = (req.on_token, req.on_finish)
        return req

    def owns_all(self, inst: EngineInstance) -> bool:
        """Every request waiting or running on ``inst`` came from this feed (its callbacks are the feed's):
        a request of the router side's, or of a harness around the run, reports its tokens and finish to
        callbacks that may queue events or read other instances, which a deferred instance must not run."""
        if not inst.waiting and not inst.running:
            return True
        if self.callbacks is None:
            return False
        on_token, on_finish = self.callbacks
        return all(r.on_finish == on_finish and r.on_token == on_token
                   for r in itertools.chain(inst.waiting, inst.running))

    def take(self) -> tuple:
        """The next ``(request id, request)``; ``next_s`` moves on."""
        out = self.requests[self.next]
        self.next += 1
        self.next_s = self.requests[self.next][1].arrival_s if self.next < len(self.requests) else math.inf
        return out


class _Local:
    """A deferred instance's own events not yet applied: the end of its iteration in flight (``end_s``; inf:
    idle), the router's settles (``kick_all``) and wake-ups at it, by time; ``last_s``: its last event applied."""

    __slots__ = ("end_s", "feed", "last_s", "settles", "wakes")

    def __init__(self, end_s: float, feed: _Feed) -> None:
        self.end_s, self.feed, self.last_s = end_s, feed, end_s
        self.settles: deque = deque()
        self.wakes: deque = deque()


@attrs.define(eq=False)
class EngineCluster:
    """The instances of a run; the ``ClusterPort`` the router side reads.

    The placement estimate treats an instance's queued prefill work as requests
    of at most ``window_tokens`` each (0: no window), every one from an empty
    context; while the queued work fits one window this is the plain estimate,
    beyond it the plain estimate would price one impossible prompt longer than
    the model's window (which a table-based latency model refuses).
    """

    loop: InlineEventLoop
    by_model: dict[str, list[EngineInstance]]
    by_id: dict[str, EngineInstance]
    window_tokens: int = 0
    #: Runs of plain ticks wait for an observer (see the module docstring); off: one run per queued event.
    lazy_ticks: bool = True
    #: The router side tells :meth:`job_activated` of every job that may become pending (:meth:`watch_jobs`);
    #: without it only instances whose hook never grants (or that have none) run lazily.
    jobs_watched: bool = False
    num_lazy_runs: int = 0  # lazy runs started (a diagnostic)
    num_lazy_cuts: int = 0  # of which cut by a change before their queued event (a diagnostic)
    _lazy: dict = attrs.field(init=False, factory=dict)  # instance -> _LazyRun
    #: (id of a latency model, token budget, work) -> the windowed prefill estimate, for the instant
    #: ``_estimates_at`` only (a latency model is pure; its instances outlive the instant)
    _estimates: dict = attrs.field(init=False, factory=dict)
    _estimates_at: float = attrs.field(init=False, default=math.nan)
    #: (id of a latency model, token budget) -> (the model, whether its one-chunk prefill time never falls: :meth:`_monotone`)
    _monotone_models: dict = attrs.field(init=False, factory=dict)
    #: Instances that take their own normal arrivals (:meth:`feed`) may be deferred (see the module docstring).
    defer_instances: bool = True
    num_deferrals: int = 0  # instances deferred (a diagnostic)
    _feeds: dict = attrs.field(init=False, factory=dict)  # instance -> _Feed
    _deferred: dict = attrs.field(init=False, factory=dict)  # instance -> _Local

    def instances(self, model: str) -> list[str]:
        return [i.instance_id for i in self.by_model[model]]

    def _up_to_now(self, instance_id: str) -> EngineInstance:
        """The instance, a deferred one with its own events up to now applied (the port's reads of what its
        own arrivals and admissions change)."""
        inst = self.by_id[instance_id]
        if self._deferred and inst in self._deferred:
            self._sync(inst)
        return inst

    def num_waiting(self, instance_id: str) -> int:
        """Requests waiting on ``instance_id`` now."""
        return len(self._up_to_now(instance_id).waiting)

    def block_size(self, instance_id: str) -> int:
        return self.by_id[instance_id].block_size

    def cached_prefix_tokens(self, instance_id: str, history: SessionHistory) -> int:
        inst = self.by_id[instance_id]
        first = history.block_hash_run(inst.kv.block_size, 1)
        if not first or not inst.kv.may_hold_prefix(first[0]):
            # exact with no catch-up: plain ticks, owed evictions and a deferred instance's own events (its feed's
            # normal requests, whose blocks no session names: ``KVClassManager.allocate``'s private promise) never
            # add a block a history's prefix starts with; they only take blocks away
            return 0
        return inst.cached_prefix_tokens(history)  # brings a lazy run or a deferred instance up to now itself

    def estimated_prefill_completion_s(self, instance_id: str, num_uncached_tokens: int) -> float:
        # no lazy catch-up: plain ticks change none of what this reads; a deferred instance's arrivals do
        inst = self._up_to_now(instance_id)
        return self.loop.now_s + self._prefill_s(inst, inst.queued_prefill_tokens + num_uncached_tokens)

    def prefill_completion_floor_s(self, instance_id: str, num_uncached_tokens: int) -> float:
        """A value :meth:`estimated_prefill_completion_s` is not below now, whatever the instance's queued
        work, read with no catch-up of a deferred instance: the estimate with no work queued, where the
        instance's one-chunk prefill time never falls with its tokens (:meth:`_monotone`); ``-inf`` elsewhere.

        Why it is a bound, in floats: up to one window (or with none) ``windowed_prefill_s`` is one sum of
        chunk times in order, each not negative, the last one's growing with its tokens and a new chunk
        starting after a full one, and a rounded sum never falls when a term grows; past one window it is at
        least one whole window's time. Past one window for ``num_uncached_tokens`` too, the product of whole
        windows may round either way, so the floor is lowered by a relative 1e-9 there."""
        inst = self.by_id[instance_id]
        if not self._monotone(inst):
            return -math.inf
        t = self.loop.now_s + self._prefill_s(inst, num_uncached_tokens)
        if 0 < self.window_tokens < num_uncached_tokens:
            t -= 1e-9 * abs(t)
        return t

    def _prefill_s(self, inst: EngineInstance, work: int) -> float:
        """``windowed_prefill_s`` of ``work`` on ``inst``, memoised for the instant (a placement's reads)."""
        now = self.loop.now_s
        if now != self._estimates_at:  # the memo holds one instant's estimates (a placement's)
            self._estimates.clear()
            self._estimates_at = now
        key = (id(inst.latency), inst.limits.token_budget, work)
        prefill_s = self._estimates.get(key)
        if prefill_s is None:
            prefill_s = self._estimates[key] = windowed_prefill_s(inst.latency, work, inst.limits.token_budget,
                                                                  self.window_tokens)
        return prefill_s

    def _monotone(self, inst: EngineInstance) -> bool:
        """One prefill chunk of ``n`` tokens from an empty context (``chunked_prefill_s``) takes a time that is
        not negative and never falls as ``n`` grows to the token budget: checked once per (latency model, token
        budget), by computing every one (what :meth:`prefill_completion_floor_s`'s bound rests on)."""
        budget = inst.limits.token_budget
        key = (id(inst.latency), budget)
        seen = self._monotone_models.get(key)
        if seen is None or seen[0] is not inst.latency:  # (the model is kept: its id is never another's)
            times = [chunked_prefill_s(inst.latency, n, budget) for n in range(budget + 1)]
            seen = self._monotone_models[key] = (
                inst.latency, times[0] >= 0 and all(a <= b for a, b in itertools.pairwise(times)))
        return seen[1]

    def watch_jobs(self, manager) -> None:
        """Let ``manager`` (a :class:`~shadowcore.manager.ShadowManager`) cut an instance's lazy run whenever
        one of its jobs may become pending there, so instances whose hook could grant run lazily too."""
        manager.on_job_active = self.job_activated
        self.jobs_watched = True

    def job_activated(self, instance_id: str) -> None:
        """A job on ``instance_id`` may now miss tokens: its next iteration start must see it."""
        inst = self.by_id.get(instance_id)
        if inst is not None and inst.touched is not None:
            inst.touched(True)

    def kick(self, inst: EngineInstance) -> None:
        """Start an iteration on an idle instance now (no-op when busy)."""
        local = self._deferred.get(inst)
        if local is not None:  # a wake-up among its own events, after its arrivals now
            self._sync(inst)
            local.wakes.append(self.loop.now_s)
            return
        if inst.busy:  # a lazy run's instance is busy throughout
            return
        end = inst.start_step(self.loop.now_s)
        if end is not None:
            self.loop.at(end, STEP_END, lambda t, i=inst: self._on_step_end(i))

    def kick_all(self) -> None:
        deferred = self._deferred
        for inst in self.by_id.values():
            local = deferred.get(inst) if deferred else None
            if local is not None:  # is it idle now? asked in order among its own events
                local.settles.append(self.loop.now_s)
            elif not inst.busy:
                self.loop.at(self.loop.now_s, WAKE, lambda t, i=inst: self.kick(i))

    def _on_step_end(self, inst: EngineInstance) -> None:
        """End ``inst``'s iteration and start its next; while that one ends
        before any other queued event, run its end inline (what the loop
        would pop next anyway: ``InlineEventLoop.advance_to``); runs of steady
        iterations with nothing to do at their ends go lazy (:meth:`_go_lazy`)
        or, where they cannot, through ``EngineInstance.run_steady`` in one call."""
        loop = self.loop
        if inst in self._feeds and self._may_defer(inst):
            self._defer(inst)  # this end, not yet applied, is its first deferred event
            return
        ticks = True  # False right after run_steady stopped at an end that is not a plain tick
        while True:
            if ticks and inst.can_run_steady():
                if self._go_lazy(inst):
                    return
                if loop.inline_horizon_s() > loop.now_s:
                    last, num, end = inst.run_steady(loop.now_s, loop.inline_horizon_s())
                    if num:
                        loop.advance_inline(last, num - 1)  # the first end is this event
                        if not loop.advance_to(end):
                            loop.at(end, STEP_END, lambda t, i=inst: self._on_step_end(i))
                            return
                        ticks = False
                        continue
            ticks = True
            inst.end_step(loop.now_s)
            if inst.busy:
                return
            end = inst.start_step(loop.now_s)
            if end is None:
                return
            if not loop.advance_to(end):
                loop.at(end, STEP_END, lambda t, i=inst: self._on_step_end(i))
                return

    # -- lazy ticks ------------------------------------------------------------------
    def _go_lazy(self, inst: EngineInstance) -> bool:
        """The steady iteration of ``inst`` in flight ends now: hold its plain ends back, queue one event
        after them; False (nothing changed) when that is not allowed or none is provably plain."""
        if not self.lazy_ticks or not self.loop.free_running:
            return False
        if not self.jobs_watched and inst.hook is not None and not _fastpath.plans_nothing(inst.hook):
            return False  # a job could become pending on it unseen
        num, stop_s = inst.plain_ends(self.loop.now_s, MAX_LAZY_ENDS)
        if not num:
            return False
        run = _LazyRun(self.loop.now_s, stop_s)
        self._lazy[inst] = run
        inst.touched = functools.partial(self._touched, inst, run)
        self.num_lazy_runs += 1
        self.loop.at(stop_s, STEP_END, lambda t, i=inst, r=run: self._on_lazy_end(i, r))
        return True

    def _catch_up(self, inst: EngineInstance, run: _LazyRun, horizon_s: float) -> None:
        """Apply the pending ends before ``horizon_s`` (never the one at ``run.stop_s``)."""
        horizon_s = min(horizon_s, run.stop_s)
        if run.pending_s >= horizon_s:
            return
        _, num, end = inst.run_steady(run.pending_s, horizon_s)
        if not num or end < horizon_s:
            raise AssertionError(f"{inst.instance_id}: a lazy run stopped at {end}, before {horizon_s}: "
                                 "an end plain_ends proved plain was not")
        run.pending_s = end

    def _touched(self, inst: EngineInstance, run: _LazyRun, change: bool) -> None:
        """Something observes ``inst`` now: its pending ends at or before now first; a change cuts the run
        (the iteration then in flight ends as its own event; the queued one goes stale)."""
        now = self.loop.now_s
        self._catch_up(inst, run, math.nextafter(now, math.inf))
        if change and run.pending_s < run.stop_s:
            self._end_lazy(inst)
            self.num_lazy_cuts += 1
            self.loop.at(run.pending_s, STEP_END, lambda t, i=inst: self._on_step_end(i))

    def _on_lazy_end(self, inst: EngineInstance, run: _LazyRun) -> None:
        """The queued event of a lazy run: its pending ends before now, then the end at now as any other."""
        if self._lazy.get(inst) is not run:
            return  # cut before: that end had its own event
        self._catch_up(inst, run, self.loop.now_s)
        self._end_lazy(inst)
        if run.pending_s != self.loop.now_s:
            raise AssertionError(f"{inst.instance_id}: a lazy run's iteration ends at {run.pending_s}, "
                                 f"its event at {self.loop.now_s}")
        self._on_step_end(inst)

    def _end_lazy(self, inst: EngineInstance) -> None:
        del self._lazy[inst]
        inst.touched = None

    # -- deferred instances ------------------------------------------------------------
    def feed(self, inst: EngineInstance, requests: Sequence[tuple], start: Callable) -> None:
        """``inst`` takes its own normal arrivals: ``requests`` are ``(request id, request)`` pairs in arrival
        order (``request.arrival_s``); ``start(inst, request id, request, arrival_s)`` builds each one's
        :class:`EngineRequest`, which the cluster enqueues at its arrival. Before the run."""
        feed = self._feeds[inst] = _Feed(requests, start)
        self.loop.on_empty = self._drain
        self._queue_arrival(inst, feed)

    def _queue_arrival(self, inst: EngineInstance, feed: _Feed) -> None:
        if feed.next < len(feed.requests):
            token = feed.token
            self.loop.at(feed.next_s, NORMAL, lambda t, i=inst, f=feed, k=token: self._on_arrival(i, f, k))

    def _on_arrival(self, inst: EngineInstance, feed: _Feed, token: int) -> None:
        """An eager instance's next arrival (its event queues the one after, then starts it)."""
        if token != feed.token:
            return  # stale: the instance was deferred and took this arrival itself
        rid, r = feed.take()
        self._queue_arrival(inst, feed)
        inst.enqueue(feed.begin(inst, rid, r, self.loop.now_s))
        self.kick(inst)

    def _may_defer(self, inst: EngineInstance) -> bool:
        """Nothing but its own arrivals and iterations changes ``inst`` until the router side observes it: no
        routed call in it, a hook that plans nothing (or none), or one with no job pending there while the jobs
        are watched (:meth:`watch_jobs`: a job's activation observes the instance, before it shows; the
        controller's skipped steps are its own iterations'), the engine's own iteration methods, a loop
        that will pop every queued event, and no request in it but its feed's (:meth:`_Feed.owns_all`)."""
        hook = inst.hook
        quiet = (hook is None or _fastpath.plans_nothing(hook)
                 or (self.jobs_watched and _fastpath.quiet_until_event(hook)))
        return (self.defer_instances and self.loop.free_running and inst not in self._lazy and quiet
                and not inst.holds_routed
                and type(inst).start_step is EngineInstance.start_step
                and type(inst).end_step is EngineInstance.end_step and self._feeds[inst].owns_all(inst))

    def _defer(self, inst: EngineInstance) -> None:
        """The iteration of ``inst`` ending now is its first deferred event (not yet applied)."""
        feed = self._feeds[inst]
        feed.token += 1  # its queued arrival event goes stale: it takes that arrival itself
        local = self._deferred[inst] = _Local(self.loop.now_s, feed)
        inst.touched = functools.partial(self._observed, inst, local)
        self.num_deferrals += 1

    def _observed(self, inst: EngineInstance, local: _Local, change: bool) -> None:
        """``inst``'s ``touched`` while deferred: its events up to now first; a change (a routed call enqueued,
        a job activated) makes it eager again."""
        self._sync(inst)
        if change:
            self._undefer(inst, local)

    def _undefer(self, inst: EngineInstance, local: _Local) -> None:
        """Back to the loop: the iteration in flight, the wake-ups due now, the next arrival as events."""
        del self._deferred[inst]
        inst.touched = None
        loop = self.loop
        if local.end_s != math.inf:
            loop.at(local.end_s, STEP_END, lambda t, i=inst: self._on_step_end(i))
        for w in local.wakes:  # all at now: the earlier ones were applied
            loop.at(w, WAKE, lambda t, i=inst: self.kick(i))
        local.feed.token += 1
        self._queue_arrival(inst, local.feed)

    def _sync(self, inst: EngineInstance, until_s: float | None = None) -> None:
        """Apply the deferred events of ``inst`` at or before now (``until_s``): its iteration ends and the
        settles (in that order at one instant), not its arrivals or wake-ups at that instant, which come after
        an event now."""
        local = self._deferred[inst]
        touched, inst.touched = inst.touched, None
        try:
            self._advance(inst, local, self.loop.now_s if until_s is None else until_s)
        finally:
            inst.touched = touched

    def _advance(self, inst: EngineInstance, local: _Local, t: float) -> None:
        """The instance's own events in the loop's order (time, then: end, settle, arrival, wake-up), up to
        ``t`` (ends and settles at ``t`` included, arrivals and wake-ups at ``t`` not)."""
        feed, settles, wakes = local.feed, local.settles, local.wakes
        while True:
            e, a = local.end_s, feed.next_s
            s = settles[0] if settles else math.inf
            w = wakes[0] if wakes else math.inf
            if e <= s and e <= a and e <= w:
                if e > t or e == math.inf:
                    return
                self._local_end(inst, local, min(s, a, w, math.nextafter(t, math.inf)))
            elif s <= a and s <= w:
                if s > t:
                    return
                settles.popleft()
                if not inst.busy:
                    wakes.append(s)  # kick_all's wake-up, after the arrivals at s
            elif a <= w:
                if a >= t:
                    return
                rid, r = feed.take()
                inst.enqueue(feed.begin(inst, rid, r, a))
                self._local_kick(inst, local, a)
            else:
                if w >= t:
                    return
                wakes.popleft()
                self._local_kick(inst, local, w)

    def _local_kick(self, inst: EngineInstance, local: _Local, now_s: float) -> None:
        local.last_s = now_s
        if not inst.busy:
            end = inst.start_step(now_s)
            if end is not None:
                local.end_s = end

    def _local_end(self, inst: EngineInstance, local: _Local, horizon_s: float) -> None:
        """:meth:`_on_step_end` for a deferred instance: its iteration in flight ends at ``local.end_s``; its
        next iterations run here while they end before ``horizon_s`` (its next other event, or the bound)."""
        now = local.end_s
        ticks = True
        while True:
            if ticks and inst.can_run_steady() and horizon_s > now:
                last, num, end = inst.run_steady(now, horizon_s)
                if num:
                    local.last_s, local.end_s, now = last, end, end
                    if end >= horizon_s:
                        return
                    ticks = False
                    continue
            ticks = True
            inst.end_step(now)
            local.last_s = now
            if inst.busy:
                raise AssertionError(f"{inst.instance_id}: an iteration started inside a deferred end")
            end = inst.start_step(now)
            local.end_s = math.inf if end is None else end
            if end is None or end >= horizon_s:
                return
            now = end

    def _drain(self) -> None:
        """The loop has no event left: every deferred instance runs to its end; the clock stops at the last
        event of all, as the loop's would."""
        end = self.loop.now_s
        for inst, local in list(self._deferred.items()):
            self._sync(inst, math.inf)
            end = max(end, local.last_s)
            inst.touched = None
        self._deferred.clear()
        self.loop.now_s = end
