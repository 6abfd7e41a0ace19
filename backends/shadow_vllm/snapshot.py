"""What the shadow scheduler tells the core about a vLLM step: the translation
of a ``SchedulerOutput`` into the core's terms.

:class:`SnapshotTranslation` is mixed into
:class:`~shadow_vllm.scheduler.ShadowSchedulerMixin`: the
:class:`~shadowcore.types.StepSnapshot` the hook plans from, the
:class:`~shadowcore.latency.BatchShape` and decode-only test of a step the hook
skips (without building the snapshot), and the backend contract's
:class:`~shadowcore.backend.BatchReport` of a planned step.

Invariants (``tests/vllm/test_scheduler.py``, ``test_virtual*.py``):

* A request is decoding when it has its first token and ``before >=
  num_tokens - 1`` (``before``: its computed tokens before this step; vLLM
  has already advanced ``num_computed_tokens``); else it is a prefill chunk
  of ``num_scheduled`` tokens from ``before``.
* ``_shadow_batch_shape`` and ``_shadow_decode_only`` agree with the
  snapshot's ``batch_shape`` / ``is_decode_only`` of the same output.
* The snapshot's free token budget is what vLLM's limits leave after its own
  work (0 with no sequence seat left); ``admission_blocked``: something waits
  though budget and seats were left.
* Nothing here changes vLLM's state (but the one-time ``_shadow_prefill_flag``
  probe of the installed vLLM).
"""

from __future__ import annotations

import operator
from typing import Any

from shadow_vllm.vllm_internals import SchedulerOutput
from shadowcore.backend import BatchEntry, BatchReport
from shadowcore.latency import BatchShape, PrefillChunk
from shadowcore.types import Phase, RequestKind, RequestView, StepSnapshot

_IS_PREFILL_CHUNK = operator.attrgetter("is_prefill_chunk")


class SnapshotTranslation:
    """vLLM step -> the core's snapshot, batch shape and batch report (a mixin of the shadow scheduler)."""

    # Provided by the scheduler (vLLM's and the shadow mixin's attributes).
    requests: dict[str, Any]
    shadow_first_token_s: dict[str, float]
    shadow_arrival_s: dict[str, float]
    shadow_routed: set[str]
    shadow_running: set[str]
    _shadow_awaiting_first: set[str]
    _shadow_prefill_flag: bool

    def _shadow_decode_only(self, out: SchedulerOutput) -> bool:
        """Whether the snapshot of ``out`` would be decode-only (its batch
        shape's ``is_decode_only``: every request has its first token and
        ``before >= num_tokens - 1``), without building it (synchronous
        scheduling: ``num_computed_tokens`` already counts this step's)."""
        scheduled, requests, awaiting = out.num_scheduled_tokens, self.requests, self._shadow_awaiting_first
        # Every scheduled request is a normal or routed one (shadows are admitted after this test), and such
        # a live request is in ``_shadow_awaiting_first`` exactly until it has its first token.
        if not scheduled or awaiting and not awaiting.isdisjoint(scheduled):
            return False
        if not out.scheduled_spec_decode_tokens and self._shadow_prefill_flag:
            # Without draft tokens a request with n > 1 is a prefill (num_computed <= num_tokens), and
            # for n == 1 "before >= num_tokens - 1" is "num_computed >= num_tokens", the negation of
            # vLLM's own is_prefill_chunk (set for every scheduled request in _update_after_schedule).
            if out.total_num_scheduled_tokens != len(scheduled):
                return False
            try:
                return not any(map(_IS_PREFILL_CHUNK, map(requests.__getitem__, scheduled)))
            except AttributeError:  # a vLLM without the flag: the loop below from now on
                self._shadow_prefill_flag = False
        for rid, n in scheduled.items():
            request = requests[rid]
            if request.num_computed_tokens - n < request.num_tokens - 1:
                return False
        return True

    def _shadow_batch_shape(self, out: SchedulerOutput) -> BatchShape:
        """The snapshot's ``batch_shape`` of ``out``, without building the snapshot."""
        requests, first = self.requests, self.shadow_first_token_s
        prefills, decodes = [], []
        for rid, n in out.num_scheduled_tokens.items():
            request = requests[rid]
            before = request.num_computed_tokens - n
            if rid in first and before >= request.num_tokens - 1:
                decodes.append(before)
            else:
                prefills.append(PrefillChunk(n, before))
        return BatchShape(tuple(prefills), tuple(decodes))

    def _shadow_snapshot(self, out: SchedulerOutput, now_s: float, iteration: int) -> StepSnapshot:
        slo = self.shadow_config.slo
        views = []
        for rid, n in out.num_scheduled_tokens.items():
            request = self.requests[rid]
            kind = RequestKind.ROUTED if rid in self.shadow_routed else RequestKind.NORMAL
            before = request.num_computed_tokens - n  # already advanced by vLLM
            arrival_s = self.shadow_arrival_s.get(rid, now_s)
            first_s = self.shadow_first_token_s.get(rid)
            if first_s is not None and before >= request.num_tokens - 1:
                views.append(RequestView(rid, kind, Phase.DECODE, arrival_s, n, before, slo.ttft_s, slo.tpot_s,
                                         0, first_s, max(0, request.num_output_tokens - 1)))
            else:
                rest = max(0, request.num_tokens - before - n)
                views.append(RequestView(rid, kind, Phase.PREFILL, arrival_s, n, before, slo.ttft_s, slo.tpot_s,
                                         rest))
        num_waiting = len(self.waiting) + len(self.kv_holding_waiting)
        budget = min(self.max_num_scheduled_tokens, self.scheduler_config.max_num_batched_tokens)
        free_tokens = max(0, budget - out.total_num_scheduled_tokens)
        seats = len(self.running) < self.max_num_running_reqs
        blocked = num_waiting > 0 and free_tokens > 0 and seats  # it waits though budget and seats were left
        room = self.shadow_bridge.shadow_room_blocks(now_s) * self.block_size
        return StepSnapshot(self.shadow_config.instance_id, iteration, now_s, views, num_waiting,
                            blocked, slo.tpot_s, free_tokens if seats else 0, room)

    def _shadow_batch_report(self, out: SchedulerOutput, iteration: int) -> BatchReport:
        """The step as vLLM's output schedules it, in its order (shadow chunks were admitted last)."""
        entries = []
        for rid, n in out.num_scheduled_tokens.items():
            if rid in self.shadow_running:
                entry = self.shadow_jobs.entry(rid)
                entries.append(BatchEntry(rid, "shadow", n, None if entry is None else entry.job.key))
            else:
                entries.append(BatchEntry(rid, "routed" if rid in self.shadow_routed else "normal", n))
        bridge = self.shadow_bridge
        return BatchReport(self.shadow_config.instance_id, iteration, tuple(entries), bridge.num_shadow_blocks,
                           bridge.cap_blocks)
