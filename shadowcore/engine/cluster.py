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

Placement is linear in the instances of a model per routed call, at a small
constant: an instance that holds none of the session's prefix answers from
one membership test, and the placement estimates of one instant are computed
once per (latency model, token budget, work) (:meth:`EngineCluster.estimated_prefill_completion_s`).
"""

from __future__ import annotations

import functools
import math

import attrs

from shadowcore.engine import _fastpath
from shadowcore.engine._fastpath import InlineEventLoop
from shadowcore.engine.instance import EngineInstance
from shadowcore.engine.kinds import STEP_END, WAKE
from shadowcore.job import SessionHistory
from shadowcore.latency import windowed_prefill_s

#: Plain ends one lazy run may hold back (its end times are computed up front: a cut wastes the rest).
MAX_LAZY_ENDS = 256


class _LazyRun:
    """An instance's pending plain ends: the next one at ``pending_s``, none at or after ``stop_s``
    (the time of its queued event)."""

    __slots__ = ("pending_s", "stop_s")

    def __init__(self, pending_s: float, stop_s: float) -> None:
        self.pending_s, self.stop_s = pending_s, stop_s


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

    def instances(self, model: str) -> list[str]:
        return [i.instance_id for i in self.by_model[model]]

    def block_size(self, instance_id: str) -> int:
        return self.by_id[instance_id].block_size

    def cached_prefix_tokens(self, instance_id: str, history: SessionHistory) -> int:
        inst = self.by_id[instance_id]
        first = history.block_hash_run(inst.kv.block_size, 1)
        if not first or not inst.kv.may_hold_prefix(first[0]):
            return 0  # exact without a catch-up: plain ticks and owed evictions never add a named block
        return inst.cached_prefix_tokens(history)  # brings a lazy run up to date itself

    def estimated_prefill_completion_s(self, instance_id: str, num_uncached_tokens: int) -> float:
        inst = self.by_id[instance_id]  # no catch-up: plain ticks change none of what this reads
        work = inst.queued_prefill_tokens + num_uncached_tokens
        now = self.loop.now_s
        if now != self._estimates_at:  # the memo holds one instant's estimates (a placement's)
            self._estimates.clear()
            self._estimates_at = now
        key = (id(inst.latency), inst.limits.token_budget, work)
        prefill_s = self._estimates.get(key)
        if prefill_s is None:
            prefill_s = self._estimates[key] = windowed_prefill_s(inst.latency, work, inst.limits.token_budget,
                                                                  self.window_tokens)
        return now + prefill_s

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
        if inst.busy:  # a lazy run's instance is busy throughout
            return
        end = inst.start_step(self.loop.now_s)
        if end is not None:
            self.loop.at(end, STEP_END, lambda t, i=inst: self._on_step_end(i))

    def kick_all(self) -> None:
        for inst in self.by_id.values():
            if not inst.busy:
                self.loop.at(self.loop.now_s, WAKE, lambda t, i=inst: self.kick(i))

    def _on_step_end(self, inst: EngineInstance) -> None:
        """End ``inst``'s iteration and start its next; while that one ends
        before any other queued event, run its end inline (what the loop
        would pop next anyway: ``InlineEventLoop.advance_to``); runs of steady
        iterations with nothing to do at their ends go lazy (:meth:`_go_lazy`)
        or, where they cannot, through ``EngineInstance.run_steady`` in one call."""
        loop = self.loop
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
