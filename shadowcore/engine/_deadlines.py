"""The decode deadlines of an engine's lazy decode cohort: Eq. 1's minimum
slack over its members without a view per member (engine-private).

A member ``r`` decoding at cohort clock ``t`` has ``g = num_generated + t -
lazy_base`` tokens out (its stored counters lag the clock), so its slack
``sigma_r = c g - (now - f_r)`` with ``c = (1 - margin) T_r`` is ``D_r - now``
for the deadline ``D_r = f_r + c g = key_r + c t``, ``key_r = f_r + c
(num_generated - lazy_base)``: per TPOT SLO ``T`` every member's deadline moves
by the same ``c`` per tick, so a heap on ``key`` keeps the deadline order while
the clock runs and changes only when a member joins.

Invariant (``tests/sim/test_speed_equivalence*.py`` pin it): :meth:`min_slack_s`
equals ``min(decode_slack_s(view))`` over the live members' views, bit for
bit: a member whose real deadline is more than ``EPS_S`` past the earliest has
a float slack above the earliest's (rounding is ~1e-11 s here); every member
nearer is evaluated with the exact float expression of
:func:`shadowcore.slack.decode_slack_s`.
"""

from __future__ import annotations

import heapq
import math

import attrs

#: Far more than the rounding of ``key + c t`` and of Eq. 1 (values of at most ~1e5 s).
EPS_S = 1e-6


@attrs.define(eq=False)
class DecodeDeadlines:
    """Per TPOT SLO, a heap of (key, run_seq, request) of cohort members;
    finished members are dropped lazily."""

    margin: float
    heaps: dict = attrs.Factory(dict)

    def add(self, req) -> None:
        c = (1.0 - self.margin) * req.tpot_slo_s
        key = req.first_token_s + c * (req.num_generated - req.lazy_base)
        heapq.heappush(self.heaps.setdefault(req.tpot_slo_s, []), (key, req.run_seq, req))

    def min_slack_s(self, now_s: float, clock: int) -> float:
        """The smallest Eq. 1 slack at ``now_s`` (cohort clock ``clock``) among
        live members, exactly as :func:`shadowcore.slack.decode_slack_s` of
        their views gives it; ``inf`` with none. Per TPOT SLO only members
        whose deadline is within ``EPS_S`` of the earliest are evaluated."""
        best = math.inf
        for tpot, heap in self.heaps.items():
            while heap and heap[0][2].finish_s is not None:
                heapq.heappop(heap)
            if not heap:
                continue
            c = (1.0 - self.margin) * tpot
            limit = heap[0][0] + EPS_S
            stack = [0]
            n = len(heap)
            while stack:  # the entries with key <= limit: a heap's subtree below a larger key has none
                i = stack.pop()
                key, _, req = heap[i]
                if key > limit:
                    continue
                if req.finish_s is None:
                    s = c * (req.num_generated + clock - req.lazy_base) - (now_s - req.first_token_s)
                    best = min(best, s)
                for j in (2 * i + 1, 2 * i + 2):
                    if j < n:
                        stack.append(j)
        return best
