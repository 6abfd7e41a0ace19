"""The simulator's cluster: engine instances on one event loop, by model and
by id; the :class:`~shadowcore.manager.ClusterPort` the router side reads.

Invariants: an instance runs at most one iteration at a time; an idle
instance starts one as soon as it is kicked and has work; iteration ends are
``STEP_END`` events (:mod:`shadowcore.engine.kinds`), wake-ups ``WAKE``.
"""

from __future__ import annotations

import attrs

from shadowcore.engine._fastpath import InlineEventLoop
from shadowcore.engine.instance import EngineInstance
from shadowcore.engine.kinds import STEP_END, WAKE
from shadowcore.job import SessionHistory
from shadowcore.latency import windowed_prefill_s


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

    def instances(self, model: str) -> list[str]:
        return [i.instance_id for i in self.by_model[model]]

    def block_size(self, instance_id: str) -> int:
        return self.by_id[instance_id].block_size

    def cached_prefix_tokens(self, instance_id: str, history: SessionHistory) -> int:
        return self.by_id[instance_id].cached_prefix_tokens(history)

    def estimated_prefill_completion_s(self, instance_id: str, num_uncached_tokens: int) -> float:
        inst = self.by_id[instance_id]
        work = inst.queued_prefill_tokens + num_uncached_tokens
        return self.loop.now_s + windowed_prefill_s(inst.latency, work, inst.limits.token_budget, self.window_tokens)

    def kick(self, inst: EngineInstance) -> None:
        """Start an iteration on an idle instance now (no-op when busy)."""
        if inst.busy:
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
        iterations with nothing to do at their ends go through
        ``EngineInstance.run_steady`` in one call."""
        loop = self.loop
        ticks = True  # False right after run_steady stopped at an end that is not a plain tick
        while True:
            if ticks and loop.inline_horizon_s() > loop.now_s and inst.can_run_steady():
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
