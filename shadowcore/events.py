"""One event heap with one explicit tie-break rule (SimPy style).

Events are ``(time_s, kind, sequence, action)``: earlier time first; at equal
times the smaller ``kind`` first (backends define kinds so that, e.g., an
iteration that ends at ``t`` frees its slots before work arriving at ``t`` is
admitted); then insertion order (``sequence``). Nothing else breaks ties, so
the same inputs replay identically.

This is the whole public face: ``at``, ``run``, ``peek_s``. The simulator
engine's inline fast path is a private subclass
(``shadowcore.engine._fastpath.InlineEventLoop``).
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

    def at(self, time_s: float, kind: int, action: Callable[[float], None]) -> None:
        """Run ``action(time_s)`` at ``time_s`` (never in the past)."""
        if time_s < self.now_s:
            raise ValueError(f"event at {time_s} is in the past (now {self.now_s})")
        heapq.heappush(self._heap, (time_s, kind, next(self._seq), action))

    def run(self, until_s: float | None = None, stop: Callable[[], bool] | None = None) -> None:
        """Process events in order until none is left, the next is after
        ``until_s``, or ``stop()`` is true after an event."""
        heap = self._heap
        while heap:
            if until_s is not None and heap[0][0] > until_s:
                break
            time_s, _, _, action = heapq.heappop(heap)
            self.now_s = time_s
            self.num_events += 1
            action(time_s)
            if stop is not None and stop():
                break

    def peek_s(self) -> float:
        """The time of the next queued event (``inf`` when none is queued)."""
        return self._heap[0][0] if self._heap else math.inf

    def __len__(self) -> int:
        return len(self._heap)
