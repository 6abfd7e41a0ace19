"""One event heap with one explicit tie-break rule (SimPy style).

Events are ``(time_s, kind, sequence, action)``: earlier time first; at equal
times the smaller ``kind`` first (backends define kinds so that, e.g., an
iteration that ends at ``t`` frees its slots before work arriving at ``t`` is
admitted); then insertion order (``sequence``). Nothing else breaks ties, so
the same inputs replay identically.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable

import attrs


@attrs.define(eq=False)
class EventLoop:
    now_s: float = 0.0
    num_events: int = 0
    _heap: list = attrs.Factory(list)
    _seq: itertools.count = attrs.Factory(itertools.count)
    _free_running: bool = False  # inside run() with no until_s and no stop

    def at(self, time_s: float, kind: int, action: Callable[[float], None]) -> None:
        """Run ``action(time_s)`` at ``time_s`` (never in the past)."""
        if time_s < self.now_s:
            raise ValueError(f"event at {time_s} is in the past (now {self.now_s})")
        heapq.heappush(self._heap, (time_s, kind, next(self._seq), action))

    def run(self, until_s: float | None = None, stop: Callable[[], bool] | None = None) -> None:
        """Process events in order until none is left, the next is after
        ``until_s``, or ``stop()`` is true after an event."""
        heap = self._heap
        self._free_running = until_s is None and stop is None
        try:
            while heap:
                if until_s is not None and heap[0][0] > until_s:
                    break
                time_s, _, _, action = heapq.heappop(heap)
                self.now_s = time_s
                self.num_events += 1
                action(time_s)
                if stop is not None and stop():
                    break
        finally:
            self._free_running = False

    def advance_to(self, time_s: float) -> bool:
        """For the action of the event being run, as its last step: when an
        event at ``time_s`` scheduled now would be the very next one ``run``
        pops (``run`` has no bound or stop condition and every queued event is
        strictly later), move the clock there, count it, and return True; the
        caller then runs that event's action itself, inline, saving the heap
        round trip. Otherwise change nothing and return False."""
        if not self._free_running or time_s < self.now_s or (self._heap and self._heap[0][0] <= time_s):
            return False
        self.now_s = time_s
        self.num_events += 1
        return True

    def inline_horizon_s(self) -> float:
        """For the action of the event being run: events of its own that end
        strictly before this time may be run inline (each as ``advance_to``
        would: the very next event ``run`` pops); ``-inf`` when ``run`` has a
        bound or a stop condition (nothing may be run inline), ``inf`` when
        nothing is queued."""
        if not self._free_running:
            return -math.inf
        return self._heap[0][0] if self._heap else math.inf

    def advance_inline(self, time_s: float, num_events: int) -> None:
        """``num_events`` events before :meth:`inline_horizon_s` were run inline
        by the current action, the last at ``time_s``: count them, move the clock."""
        if num_events <= 0:
            return
        if not self._free_running or time_s < self.now_s or (self._heap and self._heap[0][0] <= time_s):
            raise ValueError(f"inline events up to {time_s} are not before the next queued event (now {self.now_s})")
        self.now_s = time_s
        self.num_events += num_events

    def __len__(self) -> int:
        return len(self._heap)
