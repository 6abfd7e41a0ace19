"""A deterministic in-memory engine for tests, conformance checks and the
quick-start scenario.

It is a small continuous-batching cluster, not the simulator: iteration times
come from a :class:`~shadowcore.latency.LatencyModel`; each instance runs
running decodes, then in-flight prefill chunks, then FCFS admissions under a
token budget; KV is reserved at admission (prompt and output) through the
core's :class:`~shadowcore.kv.KVClassManager`, so nothing is preempted; a
blocked admission stops admission for the iteration. Shadow chunks run last,
exactly as the hook planned, each holding its KV only for its iteration.

Determinism: one event heap; simultaneous events are ordered by
``(time, kind, sequence)`` with kinds ``STEP_END < CALL < NORMAL < WAKE``, so
an iteration that ends at ``t`` frees its slots before work arriving at ``t``
is admitted; ``sequence`` is the insertion counter.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable

import attrs

from shadowcore.hook import EngineHook
from shadowcore.job import SessionHistory
from shadowcore.kv import KVClass, KVClassManager
from shadowcore.latency import LatencyModel, PrefillChunk
from shadowcore.types import (
    ChunkResult,
    Phase,
    RequestKind,
    RequestView,
    StepOutcome,
    StepPlan,
    StepSnapshot,
)

STEP_END, CALL, NORMAL, WAKE = 0, 1, 2, 3


@attrs.define(eq=False)
class FakeRequest:
    """A routed call or a normal request inside one instance."""

    request_id: str
    kind: RequestKind
    history: SessionHistory  # the prompt is its first num_prompt_tokens tokens
    num_prompt_tokens: int
    num_output_tokens: int
    arrival_s: float
    ttft_slo_s: float
    tpot_slo_s: float
    num_oracle_tokens: int = 0
    num_cached_tokens: int = 0
    num_computed_tokens: int = 0
    num_generated: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    reload_s: float = 0.0
    on_token: Callable[["FakeRequest", float], None] | None = None
    on_finish: Callable[["FakeRequest", float], None] | None = None

    @property
    def in_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    def view(self, num_scheduled: int) -> RequestView:
        phase = Phase.PREFILL if self.in_prefill else Phase.DECODE
        context = self.num_computed_tokens if phase is Phase.PREFILL else self.num_prompt_tokens + self.num_generated
        remaining = max(0, self.num_prompt_tokens - self.num_computed_tokens - num_scheduled)
        return RequestView(
            self.request_id, self.kind, phase, self.arrival_s, num_scheduled, context, self.ttft_slo_s,
            self.tpot_slo_s, remaining if phase is Phase.PREFILL else 0, self.first_token_s,
            max(0, self.num_generated - 1),
        )


@attrs.define(eq=False)
class FakeInstance:
    """One engine instance: queue, running set, KV pool and its hook."""

    instance_id: str
    model: str
    kv: KVClassManager
    latency: LatencyModel
    tpot_slo_s: float
    token_budget: int = 2048
    max_num_seqs: int = 256
    hook: EngineHook | None = None
    waiting: deque = attrs.Factory(deque)
    running: list = attrs.Factory(list)
    busy: bool = False
    iteration: int = 0
    queued_prefill_tokens: int = 0
    busy_s: float = 0.0
    num_shadow_tokens: int = 0
    _step: tuple | None = None

    # -- EnginePort ---------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.kv.block_size

    def cached_prefix_tokens(self, history: SessionHistory) -> int:
        hashes = history.block_hashes(self.kv.block_size)
        return self.kv.match_prefix(hashes).num_blocks * self.kv.block_size

    def eviction_count(self) -> int:
        return self.kv.eviction_count

    # -- one iteration ------------------------------------------------------------
    def start_step(self, now_s: float) -> float | None:
        """Schedule, plan shadow chunks, run; returns the iteration's end or None (idle)."""
        batch, blocked = self._schedule(now_s)
        used = sum(n for _, n in batch)
        snapshot = StepSnapshot(
            self.instance_id, self.iteration, now_s, [r.view(n) for r, n in batch], len(self.waiting), blocked,
            self.tpot_slo_s, max(0, self.token_budget - used),
            self.kv.shadow_room_blocks(now_s) * self.kv.block_size,
        )
        plan = self.hook.begin_step(snapshot) if self.hook is not None else None
        results, chunks, reload_s = self._run_shadow(plan, now_s)
        if not batch and not chunks:
            if self.hook is not None:
                self.hook.end_step(StepOutcome(self.instance_id, self.iteration, 0.0, results))
            self.iteration += 1
            return None
        reload_s += sum(r.reload_s for r, _ in batch)
        for r, _ in batch:
            r.reload_s = 0.0
        duration = self.latency.predict_s(snapshot.shape().with_prefills(chunks)) + reload_s
        self._step = (batch, results, duration)
        self.busy = True
        return now_s + duration

    def end_step(self, now_s: float) -> None:
        batch, results, duration = self._step
        self._step = None
        self.busy = False
        self.busy_s += duration
        for r in results:
            if r.num_computed_tokens:  # dropped grants never held blocks
                self.kv.release(_shadow_owner(r), now_s)
                self.num_shadow_tokens += r.num_computed_tokens
        if self.hook is not None:
            self.hook.end_step(StepOutcome(self.instance_id, self.iteration, duration, results))
        self.iteration += 1
        for req, n in batch:
            self._advance(req, n, now_s)

    def _schedule(self, now_s: float) -> tuple[list[tuple[FakeRequest, int]], bool]:
        budget = self.token_budget
        batch = []
        for req in self.running:  # decodes first, then in-flight prefill chunks
            if not req.in_prefill and budget > 0:
                batch.append((req, 1))
                budget -= 1
        for req in self.running:
            if req.in_prefill and budget > 0:
                n = min(budget, req.num_prompt_tokens - req.num_computed_tokens)
                batch.append((req, n))
                budget -= n
        blocked = False
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if not self._admit(req, now_s):
                blocked = True
                break
            self.waiting.popleft()
            self.running.append(req)
            n = min(budget, req.num_prompt_tokens - req.num_computed_tokens)
            batch.append((req, n))
            budget -= n
        return batch, blocked

    def _admit(self, req: FakeRequest, now_s: float) -> bool:
        bs = self.kv.block_size
        if req.num_oracle_tokens:  # oracle: the prefix appears cached, for free
            oracle = req.history.block_hashes(bs, req.num_oracle_tokens // bs)
            if self.kv.allocate(f"oracle:{req.request_id}", oracle, 0, KVClass.NORMAL, now_s) is not None:
                self.kv.release(f"oracle:{req.request_id}", now_s)
        hashes = req.history.block_hashes(bs, req.num_prompt_tokens // bs)
        total_blocks = -(-(req.num_prompt_tokens + req.num_output_tokens) // bs)
        alloc = self.kv.allocate(req.request_id, hashes, total_blocks - len(hashes), KVClass.NORMAL, now_s)
        if alloc is None:
            return False
        hit = (alloc.num_device_hit_blocks + alloc.num_host_hit_blocks) * bs
        req.num_cached_tokens = min(hit, req.num_prompt_tokens - 1)
        req.num_computed_tokens = req.num_cached_tokens
        req.reload_s = alloc.reload_s
        self.queued_prefill_tokens -= req.num_prompt_tokens
        return True

    def _advance(self, req: FakeRequest, n: int, now_s: float) -> None:
        if req.in_prefill:
            req.num_computed_tokens += n
            if req.in_prefill:
                return
            req.first_token_s = now_s
        req.num_generated += 1
        if req.on_token is not None:
            req.on_token(req, now_s)
        if req.num_generated >= req.num_output_tokens:
            self._finish(req, now_s)

    def _finish(self, req: FakeRequest, now_s: float) -> None:
        req.finish_s = now_s
        self.running.remove(req)
        self.kv.release(req.request_id, now_s)
        if req.kind is RequestKind.ROUTED:  # cache the output blocks, as vLLM does
            owner = f"commit:{req.request_id}"
            hashes = req.history.block_hashes(self.kv.block_size)
            if self.kv.allocate(owner, hashes, 0, KVClass.NORMAL, now_s) is not None:
                self.kv.release(owner, now_s)
        if req.on_finish is not None:
            req.on_finish(req, now_s)

    def _run_shadow(self, plan: StepPlan | None, now_s: float):
        results, chunks, reload_s = [], [], 0.0
        if plan is None:
            return results, chunks, reload_s
        bs = self.kv.block_size
        for g in plan.grants:
            job = self.hook.manager.job(g.job)
            if job is None or job.history.epoch != g.epoch:
                results.append(ChunkResult(g, 0))
                continue
            hashes = job.history.block_hashes(bs, g.end_token // bs)
            if self.kv.match_prefix(hashes).num_blocks < g.start_token // bs:  # prefix lost: stale grant
                results.append(ChunkResult(g, 0))
                continue
            alloc = self.kv.allocate(_shadow_owner(ChunkResult(g, 0)), hashes, 0, KVClass.SHADOW, now_s)
            if alloc is None:
                results.append(ChunkResult(g, 0))
                continue
            results.append(ChunkResult(g, g.num_tokens))
            chunks.append(PrefillChunk(g.num_tokens, g.start_token))
            reload_s += alloc.reload_s
        return results, tuple(chunks), reload_s


def _shadow_owner(r: ChunkResult) -> str:
    g = r.grant
    return f"shadow:{g.job.session_id}:{g.job.target_model}:{g.start_token}"


@attrs.define(eq=False)
class EventLoop:
    """One heap of ``(time, kind, sequence, action)``; see the module docstring."""

    now_s: float = 0.0
    _heap: list = attrs.Factory(list)
    _seq: itertools.count = attrs.Factory(itertools.count)

    def at(self, time_s: float, kind: int, action: Callable[[float], None]) -> None:
        if time_s < self.now_s:
            raise ValueError(f"event at {time_s} is in the past (now {self.now_s})")
        heapq.heappush(self._heap, (time_s, kind, next(self._seq), action))

    def run(self, until_s: float | None = None, stop: Callable[[], bool] | None = None) -> None:
        while self._heap:
            if until_s is not None and self._heap[0][0] > until_s:
                break
            time_s, _, _, action = heapq.heappop(self._heap)
            self.now_s = time_s
            action(time_s)
            if stop is not None and stop():
                break

