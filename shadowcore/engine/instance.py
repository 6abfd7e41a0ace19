"""The deterministic in-memory engine: the kit's fake engine and the
simulator backend's engine are this one implementation.

One instance has vLLM v1 semantics. Each iteration, in order: running decodes,
then in-flight prefill chunks, then FCFS admissions from the waiting queue,
under a token budget (default 2,048) and a sequence cap (default 256); then
the shadow chunks the core's engine hook plans, last. Iteration times come
from a :class:`~shadowcore.latency.LatencyModel` (plus host-tier reloads).
KV goes through the core's :class:`~shadowcore.kv.KVClassManager`: a request
reserves the blocks of its tokens at admission (prefix hits shared, host-tier
hits reloaded over PCIe and charged to that iteration) and one more block
whenever a decode fills its last; when a block cannot be found, the most
recently admitted running request is preempted by recompute (its blocks freed,
its cached prefix kept) and re-queued at the front. A failed admission blocks
admission for the iteration and is reported to the hook. A finished request's
full blocks (prompt and output) whose KV was computed stay cached, as in vLLM:
``(num_tokens - 1) // block_size`` of them (the last sampled token's KV never
is), and a prefix hit covers at most ``num_tokens - 1`` tokens in whole blocks
(vLLM's ``get_computed_blocks``).

Invariants (tested in ``tests/test_engine.py``):

* scheduled tokens <= token budget; running sequences <= sequence cap;
* KV blocks in use never exceed the pool (the KV manager's accounting);
* every admitted request finishes, or is preempted and re-admitted; a
  request that could never fit in the pool is rejected (``rejected``), never
  left waiting;
* a prefix hit never exceeds what is cached;
* a shadow chunk runs only when the hook's plan granted it, and never more
  tokens than granted.

Runs of steady decode iterations with nothing to do at their ends (no
finish, no request waiting, no grant possible before the next event) are taken
in one call (``EngineInstance.run_steady``): every iteration still happens,
with the same durations, busy time, clock values, credit and KV reservations.
The cluster may hold such a run's ends back until something observes the
instance (lazy ticks, :mod:`shadowcore.engine.cluster`): while ``touched`` is
set, every public method that reads or changes the instance's state
(``enqueue``, ``cached_prefix_tokens``, ``eviction_count``,
``sync_requests``) calls it first, so the state it reads is exact.

While the lazy decode cohort lives (``EngineInstance.lazy_decodes``), a
decoding normal request's ``num_computed_tokens``, ``num_generated``,
history count and ``num_blocks`` (with its KV owner's private blocks: the rest
sit in the instance's decode pool, a KV owner of its own) may lag; they are
exact whenever the request finishes, whenever the instance runs a
per-request (slow) iteration or builds a full snapshot for its hook, and after ``EngineInstance.sync_requests()``. Mixed iterations
(prefill chunks, admissions) keep the cohort and are scheduled from its
aggregates (``EngineInstance._start_agg``): their per-request work is for the
requests outside it, so their cost does not grow with the decode batch; their
results equal the per-request path's (``tests/sim/test_speed_equivalence.py``).

Determinism: callers drive instances from one
:class:`shadowcore.events.EventLoop`; nothing here reads a clock or an RNG.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import heapq
import math
import operator
from collections import deque
from collections.abc import Callable, Sequence

import attrs

from shadowcore.backend import BatchEntry, BatchReport
from shadowcore.engine import _fastpath
from shadowcore.engine._deadlines import DecodeDeadlines
from shadowcore.hook import EngineHook
from shadowcore.job import SessionHistory
from shadowcore.kv import KVClass, KVClassManager
from shadowcore.latency import BatchShape, LatencyModel, PrefillChunk, decode_run_s
from shadowcore.types import (
    ChunkResult,
    DecodeAggregate,
    Phase,
    RequestKind,
    RequestView,
    StepOutcome,
    StepPlan,
    StepSnapshot,
)


@attrs.define(eq=False)
class EngineRequest:
    """A routed call or a normal request; its tokens are the first
    ``num_tokens`` of ``history`` (prompt, then generated output)."""

    request_id: str
    kind: RequestKind
    history: SessionHistory
    num_prompt_tokens: int
    num_output_tokens: int
    arrival_s: float
    ttft_slo_s: float
    tpot_slo_s: float
    num_oracle_tokens: int = 0
    num_generated: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prefix hit at first admission
    num_blocks: int = 0
    num_admissions: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    pending_reload_s: float = 0.0
    on_token: Callable[[EngineRequest, float], None] | None = None
    on_finish: Callable[[EngineRequest, float], None] | None = None
    rejected: bool = False  # could never fit in the KV pool (vLLM rejects such prompts)
    run_seq: int = 0  # admission order on its instance (running order), set at each admission
    # >= 0: in the instance's lazy decode cohort; num_computed_tokens, num_generated and the history lag
    # by (instance's steady iteration count - lazy_base) tokens until the instance materialises them.
    lazy_base: int = -1
    # >= 0: a cohort member past its first block boundary (a phase member, see EngineInstance._reserve_due): its
    # next block boundary not yet in num_blocks; the blocks of its boundaries from here to the instance's
    # _pooled_upto are in the instance's decode pool (the KV owner _pool_id) until handed to it (_attribute).
    pool_from: int = -1
    #: Its history's block hashes are its own: no other request, session or job ever names one (a normal
    #: request's fresh prompt in a count-only history of its own). Its first admission then allocates its
    #: blocks as the KV manager's private blocks (``KVClassManager.allocate(private=True)``).
    private_kv: bool = False
    _owner: str = attrs.field(default="", init=False, repr=False)  # owner_id of admission _owner_of
    _owner_of: int = attrs.field(default=-1, init=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_generated

    @property
    def owner_id(self) -> str:
        """The KV owner of this admission: ``{request_id}@{num_admissions}`` (built once per admission)."""
        if self._owner_of != self.num_admissions:
            self._owner = f"{self.request_id}@{self.num_admissions}"
            self._owner_of = self.num_admissions
        return self._owner

    @property
    def is_decoding(self) -> bool:
        return self.num_tokens - self.num_computed_tokens == 1 and self.first_token_s is not None

    def view(self, num_scheduled: int) -> RequestView:
        if self.is_decoding:
            return RequestView(
                self.request_id, self.kind, Phase.DECODE, self.arrival_s, num_scheduled, self.num_computed_tokens,
                self.ttft_slo_s, self.tpot_slo_s, 0, self.first_token_s, max(0, self.num_generated - 1),
            )
        remaining = self.num_tokens - self.num_computed_tokens - num_scheduled
        return RequestView(
            self.request_id, self.kind, Phase.PREFILL, self.arrival_s, num_scheduled, self.num_computed_tokens,
            self.ttft_slo_s, self.tpot_slo_s, remaining,
        )


_ROUTED = RequestKind.ROUTED


def append_output_to_history(req: EngineRequest, now_s: float) -> None:
    """An ``on_token`` callback: the request's own history grows with its
    output (normal traffic). Engines recognise it and inline it."""
    req.history.append(1)


@attrs.frozen
class EngineLimits:
    token_budget: int = 2048
    max_num_seqs: int = 256


@attrs.define(eq=False)
class EngineInstance:
    """One engine instance: waiting queue, running list, KV pool, hook."""

    instance_id: str
    model: str
    kv: KVClassManager
    latency: LatencyModel
    tpot_slo_s: float
    limits: EngineLimits = attrs.Factory(EngineLimits)
    hook: EngineHook | None = None
    waiting: deque = attrs.Factory(deque)
    running: list = attrs.Factory(list)
    busy: bool = False
    iteration: int = 0
    queued_prefill_tokens: int = 0
    busy_s: float = 0.0
    num_shadow_tokens: int = 0
    num_preemptions: int = 0
    num_rejected: int = 0
    num_iterations_run: int = 0
    last_batch_tokens: int = 0
    num_gpus: int = 1
    validate_values: bool = True  # attrs validators on the snapshots it builds (the simulator turns them off)
    idle_power_w: float = 0.0  # per GPU
    busy_power_w: float = 0.0  # per GPU
    _step: tuple | None = None
    # Steady-decode fast path (see _start_steady): every running request decodes,
    # with these aggregates of their contexts; ``_due`` need a block before the next.
    _steady: bool = False
    _ctx_total: int = 0
    _ctx_max: int = 0
    _due: list = attrs.Factory(list)
    # Cohort members at their first block boundary now (from _lazy_due at this clock): each needs exactly
    # one block before the next decode, then joins its phase; reserved with _due (_reserve_decodes).
    _due_lazy: list = attrs.Factory(list)
    # The cohort's phase members (see _reserve_due): live ones per phase (clock mod block_size); how many need a
    # block before the next decode (from _advance_cohort to the next start); the last clock whose phase blocks
    # were taken into the decode pool, the KV owner _pool_id (made at the first cohort).
    _phase_live: list = attrs.Factory(list)
    _due_phase: int = 0
    _pooled_upto: int = -1
    _pool_id: str = ""
    num_fast_iterations: int = 0  # iterations run by the fast path; the lazy cohort's clock
    _steady_s: float = 0.0
    # Lazy decode cohort (see _start_cohort): normal requests advance as offsets from the clock above.
    lazy_decodes: bool = True
    _cohort: bool = False
    _eager: list = attrs.Factory(list)  # running requests outside the cohort, in running order
    _lazy_finish: list = attrs.Factory(list)  # heap (clock at finish, run_seq, request)
    # clock -> the members whose first block boundary is the end at that clock (keys above the clock; every
    # clock value is looked up once, by _reserve_due or _advance_cohort); finished ones are skipped there
    _lazy_due: dict = attrs.Factory(dict)
    _longest: list = attrs.Factory(list)  # heap (-(context - clock), run_seq, request)
    _num_admitted: int = 0
    num_lazy_finishes: int = 0  # requests that finished as cohort members (a diagnostic)
    # Mixed iterations from the aggregates (see _start_agg): while the cohort lives, the running
    # requests not decoding, in running order; the cohort's decode deadlines (built on first use).
    _prefilling: list = attrs.Factory(list)
    _deadlines: DecodeDeadlines | None = None
    _agg: tuple | None = None  # the aggregate iteration in flight: (entries, results, duration, skipped)
    num_agg_iterations: int = 0  # iterations scheduled from the aggregates (a diagnostic)
    num_agg_snapshots: int = 0  # of which planned on a full snapshot (views of every request; a diagnostic)
    steady_runs: bool = True  # run_steady may take runs of plain ticks (off: one round trip per iteration)
    num_steady_ticks: int = 0  # iteration ends taken by run_steady (a diagnostic)
    # plain_ends' look-ahead (clock, decodes, total and longest context, the next durations), reused by run_steady
    _ahead: tuple | None = attrs.field(default=None, init=False, repr=False)
    # Set by the cluster while this instance's steady run is lazy (ends not yet applied): every public
    # method that reads or changes its state calls it first (True: a change, the run is cut there).
    touched: Callable[[bool], None] | None = attrs.field(default=None, init=False, repr=False)
    _num_routed: int = 0  # routed calls among the running requests (a steady iteration's has_routed)
    # The hook is None or does nothing at all (_fastpath.inert), as found at this iteration's start (start_step)
    # or before a steady run (can_run_steady): that iteration's (or run's) hook calls are skipped.
    _inert: bool = attrs.field(default=False, init=False, repr=False)

    def energy_j(self, wall_s: float) -> float:
        """GPU energy over ``wall_s``: idle power throughout, busy power while iterating."""
        return self.num_gpus * (self.idle_power_w * wall_s + (self.busy_power_w - self.idle_power_w) * self.busy_s)

    # -- EnginePort ---------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.kv.block_size

    def cached_prefix_tokens(self, history: SessionHistory) -> int:
        if self.touched is not None:
            self.touched(False)
        block = self.kv.block_size  # (remembered per history while no named block moves: see cached_prefix_blocks)
        return self.kv.cached_prefix_blocks(history, (history.epoch, history.num_tokens // block),
                                            history.block_hashes) * block

    def eviction_count(self) -> int:
        if self.touched is not None:
            self.touched(False)
        return self.kv.eviction_count

    @property
    def holds_routed(self) -> bool:
        """A routed call is waiting or running here (its tokens and finish are the router side's events)."""
        return self._num_routed > 0 or any(r.kind is _ROUTED for r in self.waiting)

    # -- queue --------------------------------------------------------------------
    def enqueue(self, req: EngineRequest) -> None:
        if self.touched is not None:
            self.touched(True)
        self.waiting.append(req)  # start_step leaves the fast path while anything waits
        self.queued_prefill_tokens += req.num_tokens

    # -- one iteration ------------------------------------------------------------
    def start_step(self, now_s: float) -> float | None:
        """Plan and start an iteration; its end time, or None when idle."""
        hook = self.hook
        self._inert = hook is None or _fastpath.inert(hook)  # for this iteration, its end included
        if self._steady and not self.waiting:
            end = self._start_steady(now_s)
            if end is not None:
                return end
        self._steady = False
        if self._cohort:
            end = self._start_agg(now_s)
            if end is not _CLASSIC:
                return end
            self._drop_cohort()
        batch, blocked = self._schedule(now_s)
        if self._inert or _fastpath.plans_nothing(self.hook):
            return self._start_unplanned(batch, now_s)
        used = sum(n for _, n in batch)
        with _validation(self.validate_values):
            snapshot = StepSnapshot(
                self.instance_id, self.iteration, now_s, [r.view(n) for r, n in batch], len(self.waiting), blocked,
                self.tpot_slo_s, max(0, self.limits.token_budget - used),
                self.kv.shadow_room_blocks(now_s) * self.kv.block_size,
            )
        plan = self.hook.begin_step(snapshot) if self.hook is not None else None
        results, chunks, reload_s = self._run_shadow(plan, now_s)
        if plan is not None and self.hook.observers.observers:  # the backend contract's on_batch
            self.hook.observers.emit("on_batch", self._batch_report(batch, results))
        if not batch and not chunks:
            if self.hook is not None:
                self.hook.end_step(StepOutcome(self.instance_id, self.iteration, 0.0, results))
            self.iteration += 1
            return None
        duration = self._duration(batch, snapshot, chunks, used, reload_s)
        self._step = (batch, results, duration, None)
        self.busy = True
        return now_s + duration

    def _start_unplanned(self, batch: list[tuple[EngineRequest, int]], now_s: float) -> float | None:
        """start_step's rest when no hook can plan anything (none, or
        ``_fastpath.plans_nothing``): no snapshot and no shadow chunk; the batch's shape
        is the snapshot's (prefill chunks, then decode contexts, each in batch
        order), and the hook hears of the iteration through ``_fastpath.skip_step``."""
        if not batch:
            if not self._inert:
                _fastpath.skip_step(self.hook, 0.0, False, False)
            self.iteration += 1
            return None
        reload_s = 0.0
        prefills, decodes = [], []
        for r, n in batch:
            reload_s += r.pending_reload_s
            r.pending_reload_s = 0.0
            if r.is_decoding:
                decodes.append(r.num_computed_tokens)
            else:
                prefills.append(PrefillChunk(n, r.num_computed_tokens))
        duration = self.latency.predict_s(BatchShape(prefills, decodes)) + reload_s
        self.last_batch_tokens = sum(n for _, n in batch)
        decode_only = bool(decodes) and not prefills
        self._step = (batch, [], duration, (decode_only, decode_only and any(r.kind is _ROUTED for r, _ in batch)))
        self.busy = True
        return now_s + duration

    def end_step(self, now_s: float) -> None:
        if self._agg is not None:
            self._end_agg(now_s)
            return
        if self._step is None:
            self._end_steady(now_s)
            return
        batch, results, duration, skipped = self._step  # skipped: None when the hook planned it, else (decode_only, routed)
        self._step = None
        self._close_iteration(results, duration, skipped, now_s)
        for req, n in batch:
            if req in self.running:  # not preempted meanwhile
                self._advance(req, n, now_s)
        self._check_steady()

    # -- steady decode iterations (fast path) ---------------------------------------
    # An iteration where nothing waits, every running request decodes one token
    # and the hook provably grants nothing (_fastpath.can_skip) is the slow
    # path's iteration with its constant parts skipped: the same batch (all
    # running requests, one token each, in running order), the same block
    # reservations in the same order, the same duration (the latency model's
    # predict_decodes_s from the aggregates is bit-identical to predict_s), the
    # same per-request updates and callbacks in batch order, and the hook's
    # accounting through skip_step. No snapshot, view, plan or outcome is built.
    # With the lazy cohort, a steady iteration can_skip refuses (its pending
    # jobs need a refresh, or miss n_min tokens or more) is what _start_agg
    # would schedule with no entry: _fastpath.empty_plan_reason on the
    # aggregate summary decides it here (its count, then on as a steady
    # iteration; the aggregate path's duration predict_batch_s is
    # predict_decodes_s's, bit-identical), and only when it might grant does
    # _start_agg_planned plan it, as _start_agg would have.
    # tests/sim/test_speed_equivalence.py pins that the results are identical.
    #
    # Lazy decode cohort (``lazy_decodes``): in a run of steady iterations, a
    # normal request whose only per-token work is its own history's count
    # (append_output_to_history, no token ids) is not touched per iteration:
    # its counters lag by (num_fast_iterations - lazy_base) tokens, its finish
    # waits in a heap keyed by that clock, its first block boundary in a dict
    # from that clock to the members reaching one there (every clock value is
    # looked up exactly once, as the clock passes it); after it, it is a phase
    # member whose boundaries' blocks are pooled (_reserve_due, _attribute:
    # its num_blocks lags like its counters), and the longest context comes
    # from a heap keyed by context - clock (every
    # context grows by one per iteration, so that order never changes). It is
    # brought up to date when it finishes (in running order among the others)
    # and before any slow iteration (_drop_cohort); sync_requests() does it on
    # demand. Other requests (routed calls with callbacks) advance one by one.

    def _check_steady(self) -> None:
        """After a slow iteration: the decoding requests' aggregates and due
        list, the others (prefilling) apart; steady when none prefills. With
        ``lazy_decodes`` (and no decode with a pending reload) the lazy cohort
        starts, which mixed iterations then keep (_start_agg)."""
        bs = self.kv.block_size
        total = longest = 0
        due, prefilling = [], []
        for req in self.running:
            c = req.num_computed_tokens
            if req.first_token_s is None or req.num_prompt_tokens + req.num_generated - c != 1:
                prefilling.append(req)
                continue
            if req.pending_reload_s:
                self._steady = False
                return
            total += c
            if c > longest:  # noqa: PLR1730 (faster than max)
                longest = c
            if c + 2 > req.num_blocks * bs:
                due.append(req)
        self._steady = bool(self.running) and not prefilling
        self._ctx_total, self._ctx_max, self._due, self._due_lazy, self._due_phase = total, longest, due, [], 0
        if self.running and self.lazy_decodes and (self._steady or self._agg_allowed()):
            self._start_cohort(prefilling)

    def _start_cohort(self, prefilling: list) -> None:
        """Split the decoding running requests into the lazy cohort and the
        eager rest; ``prefilling`` are the others, in running order."""
        clock, bs = self.num_fast_iterations, self.kv.block_size
        due = set(self._due)
        skip = set(prefilling)
        eager, finish, longest = [], [], []
        due_at: dict[int, list] = {}
        for req in self.running:
            if skip and req in skip:
                continue
            c, seq = req.num_computed_tokens, req.run_seq
            if not _lazy_eligible(req):
                eager.append(req)  # routed calls stay eager: run_steady's ticks then carry none
                continue
            longest.append((clock - c, seq, req))
            req.lazy_base = clock
            finish.append((clock + req.num_output_tokens - req.num_generated, seq, req))
            if req not in due:
                _due_at(due_at, clock + req.num_blocks * bs - 1 - c, req)
        for heap in (finish, longest):
            heapq.heapify(heap)
        self._eager, self._lazy_finish, self._lazy_due, self._longest = eager, finish, due_at, longest
        self._prefilling, self._deadlines = prefilling, None
        self._phase_live, self._due_phase = [0] * bs, 0
        if not self._pool_id:
            self._pool_id = f"decode-pool:{self.instance_id}"
            self.kv.pool_owner(self._pool_id)
        self._cohort = True

    def sync_requests(self) -> None:
        """Bring the lazy cohort's counters, histories and blocks up to date
        (they are otherwise only while the instance runs a slow iteration);
        who holds the pooled blocks changes, nothing the pool shows."""
        if self.touched is not None:
            self.touched(False)
        clock = self.num_fast_iterations
        for req in self.running:
            if req.lazy_base >= 0:
                _materialise(req, clock)
                if req.pool_from >= 0:
                    self._attribute(req)

    def _drop_cohort(self) -> None:
        clock = self.num_fast_iterations
        for req in self.running:
            if req.lazy_base >= 0:
                _materialise(req, clock)
                req.lazy_base = -1
                if req.pool_from >= 0:
                    self._attribute(req)
                    req.pool_from = -1
        self._eager, self._lazy_finish, self._lazy_due, self._longest = [], [], {}, []
        self._prefilling, self._deadlines, self._due_lazy, self._due_phase = [], None, [], 0
        self._phase_live = []
        self._cohort = False

    def _attribute(self, req: EngineRequest) -> None:
        """A phase member's blocks taken into the decode pool so far (its
        boundaries from ``pool_from`` to ``_pooled_upto``, one block each)
        handed to it: its ``num_blocks`` and its KV owner's blocks are exact."""
        start, upto, bs = req.pool_from, self._pooled_upto, self.kv.block_size
        if start <= upto:
            k = (upto - start) // bs + 1
            self.kv.move_private(self._pool_id, req.owner_id, k)
            req.num_blocks += k
            req.pool_from = start + k * bs

    # -- mixed iterations from the aggregates ---------------------------------------
    # While the lazy cohort lives, an iteration _start_steady cannot take
    # (prefill chunks, admissions, or a hook that may grant) is scheduled from
    # the aggregates too: every decoding request decodes one token (cohort
    # members by the clock, eager ones one by one), the block boundaries they
    # reach are reserved in running order (the due list), then the
    # prefilling requests' chunks and the admissions, as _schedule does,
    # provided every reservation provably succeeds (together they fit in free
    # and idle blocks: nobody is preempted; otherwise the slow path runs). The
    # hook's plan: when _fastpath.empty_plan_reason proves it empty, its count
    # and skip_step, no snapshot; otherwise the snapshot is built (the
    # cohort's counters brought up to date, as the slow path has them) and
    # planned. The iteration time: the latency model's predict_batch_s on the
    # decode aggregates (bit-identical to predict_s; the contexts when it has
    # none). At the end: the decodes in running order (_advance_cohort), then
    # the chunks and admissions in batch order, and whoever now decodes joins
    # the decode set (_join). Per-request work is for the prefilling and eager
    # requests, block boundaries, joins and finishes; not for the cohort.
    # tests/sim/test_speed_equivalence.py pins that results equal the slow
    # path's (lazy_decodes off).

    def _agg_allowed(self) -> bool:
        """The methods the aggregate path restates are this class's, and the
        hook (if any) has no observer (it sees every batch) and no open plan."""
        cls = type(self)
        if cls is not EngineInstance and (
                cls._schedule is not EngineInstance._schedule or cls._advance is not EngineInstance._advance
                or cls._reserve is not EngineInstance._reserve or cls._finish is not EngineInstance._finish):
            return False
        if self._inert:  # (found at this iteration's start: no hook, or no observer and no open plan)
            return True
        hook = self.hook
        return hook is None or not (hook.observers.observers or hook.in_step)

    def _start_agg(self, now_s: float) -> float | object:
        """Start an iteration from the aggregates and return its end, or
        return _CLASSIC with nothing changed (the slow path then runs)."""
        if not self.running or not self._agg_allowed():
            return _CLASSIC
        sched = self._schedule_agg(now_s)
        if sched is None:
            return _CLASSIC
        entries, blocked, nd = sched
        prefills, dctx = [], []  # dctx: re-admitted requests whose prefix is all cached decode at once
        used = nd
        for r, n in entries:
            used += n
            if r.num_prompt_tokens + r.num_generated - r.num_computed_tokens == 1 and r.first_token_s is not None:
                dctx.append(r.num_computed_tokens)
            else:
                prefills.append(PrefillChunk(n, r.num_computed_tokens))
        hook = self.hook
        why = None
        if not self._inert and not _fastpath.plans_nothing(hook):
            room = _ShadowRoom(self.kv, now_s)  # asked only when a plan's size depends on it
            why = self._empty_plan_reason(now_s, entries, blocked, used, room)
            if why is None:
                return self._start_agg_planned(now_s, entries, blocked, used, room())
            _fastpath.count_empty_plan(hook, why)
        reload_s = 0.0
        for r, _ in entries:  # decodes have none pending (consumed at their admission)
            reload_s += r.pending_reload_s
            r.pending_reload_s = 0.0
        duration = self._predict_agg(prefills, nd, dctx) + reload_s
        decode_only = bool(nd or dctx) and not prefills
        routed = decode_only and (any(r.kind is _ROUTED for r in self._eager)  # routed decodes are all eager
                                  or any(r.kind is _ROUTED for r, _ in entries))
        self._agg = (entries, [], duration, (decode_only, routed))
        self.last_batch_tokens = used
        self.num_agg_iterations += 1
        self.busy = True
        return now_s + duration

    def _schedule_agg(self, now_s: float) -> tuple[list, bool, int] | None:
        """_schedule from the aggregates: (the prefill chunks and admissions
        in batch order, admission blocked, number of decodes); None with
        nothing changed when the decodes outgrow the token budget or the
        reservations might not all fit."""
        kv, bs = self.kv, self.kv.block_size
        nd = len(self.running) - len(self._prefilling)
        budget = self.limits.token_budget - nd
        if budget < 0:
            return None
        needs = self._decode_needs() if self._due else []
        total = len(self._due_lazy) + self._due_phase
        for n in needs:
            if n > 0:
                total += n
        entries, grow = [], []
        for req in self._prefilling:
            if budget <= 0:
                break
            n = min(budget, req.num_prompt_tokens + req.num_generated - req.num_computed_tokens)
            need = -(-(req.num_computed_tokens + n + 1) // bs) - req.num_blocks
            if need > 0:
                grow.append((req, need))
                total += need
            entries.append((req, n))
            budget -= n
        if total > kv.num_free_blocks + kv.num_idle_blocks:
            return None
        if self._due or self._due_lazy or self._due_phase:
            self._reserve_decodes(needs, now_s)
        for req, need in grow:  # as _reserve, which finds them without preempting
            if not kv.extend(req.owner_id, (), need, now_s):
                raise AssertionError(f"{self.instance_id}: a reservation that fits failed")
            req.num_blocks += need
        k = len(entries)
        blocked = self._admit_waiting(budget, entries, now_s) if self.waiting else False
        if len(entries) > k:
            self._prefilling += [e[0] for e in entries[k:]]
        return entries, blocked, nd

    def _predict_agg(self, prefills: list, nd: int, dctx: list) -> float:
        """The iteration's time: the decodes (nd of the decode set, then
        ``dctx``) and ``prefills``, as predict_s of the slow path's shape."""
        total, longest = self._ctx_total + sum(dctx), max(self._ctx_max, *dctx) if dctx else self._ctx_max
        fast = getattr(self.latency, "predict_batch_s", None)
        t = fast(tuple(prefills), nd + len(dctx), total, longest) if fast is not None else None
        if t is None:
            pre = set(self._prefilling)
            ctx = [self._context(r) for r in self.running if r not in pre] + dctx
            t = self.latency.predict_s(BatchShape(prefills, ctx))
        return t

    def _empty_plan_reason(self, now_s: float, entries: list, blocked: bool, used: int, room: _ShadowRoom) -> str | None:
        """``_fastpath.empty_plan_reason`` on the aggregate snapshot
        (:meth:`_summary`), the values it builds (the views, the snapshot,
        the controller's budget, the sizing's chunks) validated as every
        other snapshot's are (``validate_values``)."""
        with _validation(self.validate_values):
            return _fastpath.empty_plan_reason(self.hook, lambda: self._summary(now_s, entries, blocked, used), room)

    def _summary(self, now_s: float, entries: list, blocked: bool, used: int) -> StepSnapshot:
        """The snapshot with the cohort as a DecodeAggregate: views of the
        eager decodes and the entries only (for empty_plan_reason, which is
        given the shadow room apart: the field here is 0, never read).
        Called inside ``_validation`` (:meth:`_empty_plan_reason`)."""
        eager = self._eager
        members = len(self.running) - len(self._prefilling) - len(eager)
        if eager:
            total = self._ctx_total - sum(r.num_computed_tokens for r in eager)
            views = [r.view(1) for r in eager]
            views.extend(r.view(n) for r, n in entries)
        else:  # the usual: routed calls are the only eager requests
            total, views = self._ctx_total, [r.view(n) for r, n in entries]
        return StepSnapshot(
            self.instance_id, self.iteration, now_s, views, len(self.waiting), blocked, self.tpot_slo_s,
            max(0, self.limits.token_budget - used), 0,
            DecodeAggregate(members, total, self._cohort_max(), self._cohort_min_slack_s))

    def _cohort_min_slack_s(self, now_s: float, margin: float) -> float:
        """The smallest Eq. 1 slack at ``now_s`` among the cohort's members (DecodeDeadlines)."""
        d = self._deadlines
        if d is None or d.margin != margin:
            d = self._deadlines = DecodeDeadlines(margin)
            for req in self.running:
                if req.lazy_base >= 0:
                    d.add(req)
        return d.min_slack_s(now_s, self.num_fast_iterations)

    def _start_agg_planned(self, now_s: float, entries: list, blocked: bool, used: int, room: int) -> float:
        """The hook may grant: the slow path's snapshot and plan, on the
        aggregate schedule (the cohort's counters brought up to date)."""
        self.sync_requests()
        pre = set(self._prefilling)
        batch = [(r, 1) for r in self.running if r not in pre] + entries
        with _validation(self.validate_values):
            snapshot = StepSnapshot(
                self.instance_id, self.iteration, now_s, [r.view(n) for r, n in batch], len(self.waiting), blocked,
                self.tpot_slo_s, max(0, self.limits.token_budget - used), room,
            )
        plan = self.hook.begin_step(snapshot)
        results, chunks, reload_s = self._run_shadow(plan, now_s)
        duration = self._duration(entries, snapshot, chunks, used, reload_s)
        self._agg = (entries, results, duration, None)
        self.num_agg_iterations += 1
        self.num_agg_snapshots += 1
        self.busy = True
        return now_s + duration

    def _close_iteration(self, results: Sequence, duration: float, skipped: tuple | None, now_s: float) -> None:
        """What every iteration's end does first, planned or aggregate: the
        instance is idle again, the shadow chunks' KV is released to the cache,
        the hook sees the outcome (``end_step``) or the skipped step's
        accounting (``skipped``: ``(decode_only, routed)``), the iteration
        counter moves on."""
        self.busy = False
        self.busy_s += duration
        self.num_iterations_run += 1
        for r in results:
            if r.num_computed_tokens:
                self.kv.release(_shadow_owner(r.grant), now_s)
                self.num_shadow_tokens += r.num_computed_tokens
        if skipped is None:  # planned (so a hook): it sees the outcome
            if self.hook is not None:
                self.hook.end_step(StepOutcome(self.instance_id, self.iteration, duration, results))
        elif not self._inert:  # skipped: its accounting (none for an inert hook, whatever it is now)
            _fastpath.skip_step(self.hook, duration, *skipped)
        self.iteration += 1

    def _end_agg(self, now_s: float) -> None:
        """End an aggregate iteration: as end_step, the decodes by the cohort
        clock and _advance_cohort, then the entries in batch order."""
        entries, results, duration, skipped = self._agg  # skipped: None when planned, else (decode_only, routed)
        self._agg = None
        self._close_iteration(results, duration, skipped, now_s)
        self.num_fast_iterations += 1
        self._advance_cohort(now_s)
        clock = self.num_fast_iterations
        left = []  # entries that finished or now decode (each in _prefilling once)
        for req, n in entries:
            self._advance(req, n, now_s)
            if req.finish_s is not None:
                left.append(req)
            elif req.first_token_s is not None and req.num_prompt_tokens + req.num_generated - req.num_computed_tokens == 1:
                self._join(req, clock)
                left.append(req)
        if left:
            if len(left) == 1:  # the usual: one admission's prompt done
                self._prefilling.remove(left[0])
            else:
                gone = set(left)
                self._prefilling = [r for r in self._prefilling if r not in gone]
            if len(self._due) > 1:
                self._due.sort(key=_run_seq)
        self._steady = bool(self.running) and not self._prefilling

    def _join(self, req: EngineRequest, clock: int) -> None:
        """A request that now decodes joins the decode set (cohort or eager)."""
        bs, c, seq = self.kv.block_size, req.num_computed_tokens, req.run_seq
        self._ctx_total += c
        if c > self._ctx_max:  # noqa: PLR1730 (faster than max)
            self._ctx_max = c
        due = c + 2 > req.num_blocks * bs
        if _lazy_eligible(req):
            longest = self._longest
            heapq.heappush(longest, (clock - c, seq, req))
            if len(longest) > 4 * len(self.running) + _LONGEST_SLACK:  # mostly finished members: drop them at once
                self._longest = [e for e in longest if e[2].finish_s is None]
                heapq.heapify(self._longest)
            req.lazy_base = clock
            heapq.heappush(self._lazy_finish, (clock + req.num_output_tokens - req.num_generated, seq, req))
            if not due:
                _due_at(self._lazy_due, clock + req.num_blocks * bs - 1 - c, req)
            if self._deadlines is not None:
                self._deadlines.add(req)
        else:
            bisect.insort(self._eager, req, key=_run_seq)
        if due:
            self._due.append(req)

    def _context(self, req: EngineRequest) -> int:
        """A running request's computed tokens now (lazy ones: stored + lag)."""
        if req.lazy_base < 0:
            return req.num_computed_tokens
        return req.num_computed_tokens + self.num_fast_iterations - req.lazy_base

    def _start_steady(self, now_s: float) -> float | None:
        """Start a steady decode iteration, or return None for the slow path:
        before any reservation when one could preempt (the slow path then
        preempts), or after them when the hook may grant (the slow path then
        finds them made and plans)."""
        if len(self.running) > self.limits.token_budget:
            return None
        if (self._due or self._due_lazy or self._due_phase) and not self._reserve_decodes(self._decode_needs(), now_s):
            return None
        nd = len(self.running)
        hook = self.hook
        if self._inert:
            pass  # no hook, or one that does nothing (_fastpath.inert)
        elif _fastpath.can_skip(hook):  # after the reservations, as begin_step is
            _fastpath.count_skipped(hook)  # counted as begin_step would (no_jobs)
        else:
            if not self._cohort or not self._agg_allowed():
                return None  # the slow path finds the blocks reserved and does the rest
            # What _start_agg would do with no entry (nothing prefills or waits, the blocks are reserved):
            room = _ShadowRoom(self.kv, now_s)
            why = self._empty_plan_reason(now_s, [], False, nd, room)
            if why is None:
                self._steady = False
                return self._start_agg_planned(now_s, [], False, nd, room())
            _fastpath.count_empty_plan(hook, why)  # and on: a steady iteration (the same batch and duration)
        fast = getattr(self.latency, "predict_decodes_s", None)
        duration = fast(nd, self._ctx_total, self._ctx_max) if fast is not None else None
        if duration is None:
            ctx = tuple(self._context(r) for r in self.running)
            duration = self.latency.predict_s(BatchShape((), ctx))
        self.last_batch_tokens = nd
        self._step = None
        self._steady_s = duration
        self.busy = True
        return now_s + duration

    def _decode_needs(self) -> list[int]:
        """Blocks each request of the due list needs for its next decode (its
        context now, as _context gives it, + 2 slots, in whole blocks)."""
        bs, clock = self.kv.block_size, self.num_fast_iterations
        return [-(-((r.num_computed_tokens if r.lazy_base < 0 else r.num_computed_tokens + clock - r.lazy_base) + 2)
                  // bs) - r.num_blocks for r in self._due]

    def _reserve_decodes(self, needs: list[int], now_s: float) -> bool:
        """The due list's blocks (``needs``), one block for each member of
        ``_due_lazy`` and ``_due_phase`` blocks into the decode pool, or False
        with nothing changed. Every extend succeeds when they fit in free and
        idle blocks (a normal owner may evict any idle block), so the slow
        path would preempt nobody either; in one go (extend_private, whose
        outcome does not depend on the order of its needs)."""
        due, bs, at_boundary, num_phase = self._due, self.kv.block_size, self._due_lazy, self._due_phase
        if num_phase and not due and not at_boundary and not needs:  # the usual: the phase members' blocks only
            if not self.kv.extend_private(((self._pool_id, num_phase),), now_s):
                return False
            self._due_phase, self._pooled_upto = 0, self.num_fast_iterations
            return True
        if len(due) != len(needs):
            raise ValueError(f"{self.instance_id}: {len(needs)} needs for {len(due)} due requests")
        grow = [(req.owner_id, need) for req, need in zip(due, needs) if need > 0]
        if at_boundary:
            grow += [(req.owner_id, 1) for req in at_boundary]
        if num_phase:
            grow.append((self._pool_id, num_phase))
        if not self.kv.extend_private(grow, now_s):
            return False
        lazy_due, clock = self._lazy_due, self.num_fast_iterations
        if at_boundary:  # their first boundary (see _reserve_due): phase members from here on
            for req in at_boundary:
                req.num_blocks += 1
                req.pool_from = clock + bs
            self._phase_live[clock % bs] += len(at_boundary)
            self._due_lazy = []
        self._due_phase, self._pooled_upto = 0, clock
        for req, need in zip(due, needs):
            if need > 0:
                req.num_blocks += need
            if req.lazy_base >= 0:  # its next block boundary
                _due_at(lazy_due, req.lazy_base + req.num_blocks * bs - 1 - req.num_computed_tokens, req)
        due.clear()
        return True

    def _end_steady(self, now_s: float) -> None:
        """End a steady decode iteration: one token for every running request,
        in running order (finishes included), then the next aggregates."""
        duration = self._steady_s
        self.busy = False
        self.busy_s += duration
        self.num_iterations_run += 1
        self.num_fast_iterations += 1
        if not self._inert:
            _fastpath.skip_step(self.hook, duration, True, self._num_routed > 0)  # the batch: every running request
        self.iteration += 1
        if self._cohort:
            self._advance_cohort(now_s)
        else:
            self._advance_all(now_s)
        self._steady = bool(self.running)

    # -- runs of steady iterations (macro-steps) --------------------------------------
    # Between two events of the run, a lazy cohort with no eager request, no
    # waiting request and a hook that provably grants nothing until the next
    # event has a fully determined future: each iteration's end is a clock
    # tick (no finish), its block boundaries are reservations that cannot
    # preempt (checked before the end is taken), and the next duration comes
    # from the aggregates (every context + 1, the longest + 1). run_steady
    # does exactly what end_step + start_step would for each such iteration,
    # in the same order and with the same float operations (busy time and the
    # clock are the same sums in the same order, the controller gets each
    # skip_step), without the Python round trips in between.

    def can_run_steady(self) -> bool:
        """A steady iteration is in flight and :meth:`run_steady` may run: the
        class keeps this class's ``start_step`` and ``end_step`` (a subclass's
        per-iteration additions must run), the
        lazy cohort holds every running request, nothing waits, and the hook
        (if any) grants nothing until the next event: it can skip now, and
        its controller never grants or this instance has no pending job (a
        job becomes pending only through another event); and the end in
        flight finishes no cohort member (run_steady would take no end)."""
        finish = self._lazy_finish
        if finish and finish[0][0] <= self.num_fast_iterations + 1:  # the commonest no, asked first
            return False
        cls = type(self)
        if (not self.steady_runs or self._step is not None or self._agg is not None or not self._cohort or self._eager
                or self._prefilling or self.waiting or self._due or self._due_lazy or self._due_phase
                or not self.busy or getattr(self.latency, "predict_decodes_s", None) is None
                or (cls is not EngineInstance and (cls.end_step is not EngineInstance.end_step
                                                   or cls.start_step is not EngineInstance.start_step))):
            return False
        hook = self.hook
        self._inert = hook is None or _fastpath.inert(hook)  # for run_steady's iterations (asked right after)
        return self._inert or _fastpath.quiet_until_event(hook)

    def run_steady(self, now_s: float, horizon_s: float) -> tuple[float, int, float]:
        """The steady iteration in flight ends at ``now_s`` (the clock is
        there). While its end is a plain tick (no cohort member finishes; the
        block boundaries reached so far fit in free and idle blocks) end it
        and start the next, which must end strictly before ``horizon_s`` to be
        ended here too. Only after :meth:`can_run_steady`. Returns (time of
        the last end taken here, number of ends taken, end of the iteration
        now in flight); with 0 ends nothing changed.

        The block reservations of all these starts go to the KV manager in one
        ``extend_private`` at the end: nothing is released in between and a
        normal owner's growth takes free blocks, then LRU idle blocks, with no
        regard to time or owner order, so one call leaves exactly the state of
        the calls one by one (``tests/sim/test_speed_equivalence_macro.py``).
        A latency model with ``predict_decode_span_s`` (``VidurLatencyModel``)
        is asked once per span of steps that give the same time, not once per
        step; its promise is that each step of the span gives that value."""
        finish, lazy_due, phase = self._lazy_finish, self._lazy_due, self._phase_live
        if finish and finish[0][0] <= self.num_fast_iterations + 1:  # the end in flight finishes a member
            return now_s, 0, now_s
        predict, kv = self.latency.predict_decodes_s, self.kv
        span, span_end = getattr(self.latency, "predict_decode_span_s", None), -1
        # the cohort is all of the batch: no routed call (those are eager, on_token is theirs)
        tick = None if self._inert else _fastpath.tick_accounting(self.hook, True, False)
        nd, clock, total, longest = len(self.running), self.num_fast_iterations, self._ctx_total, self._ctx_max
        next_finish = finish[0][0] if finish else math.inf
        ahead, i = (_NO_AHEAD, 0) if self._ahead is None else self._ahead_from(clock, nd, total, longest)
        room = -2  # what reservations here may take: free and idle blocks, read at the first boundary
        needs: list[tuple[str, int]] = []
        pooled, bs = 0, len(phase)  # pooled: the phase members' blocks of _reserve_due's boundaries, summed
        t, last, d, busy, start, num_ahead = now_s, now_s, self._steady_s, self.busy_s, clock, len(ahead)
        try:  # t: the in-flight iteration's end; after the k-th end here, contexts total + k nd, longest + k
            while True:
                c = clock + 1
                if c >= next_finish:
                    break
                p = phase[c % bs]
                if p or c in lazy_due:  # a boundary at c (see _reserve_due)
                    if room == -2:  # nothing changes the pool in this loop: the same value as at its start
                        room = kv.num_free_blocks + kv.num_idle_blocks
                    if c in lazy_due:
                        room = self._reserve_due(c, room, needs)
                    elif p <= room:  # phase members only: _reserve_due's one need, added to the others
                        pooled, room, self._pooled_upto = pooled + p, room - p, c
                    else:
                        room = -1
                    if room < 0:
                        break
                busy += d  # the end of the iteration in flight (end_step)
                clock = c
                last = t
                if tick is not None:
                    tick(d)
                if i < num_ahead:  # plain_ends' look-ahead: predict's value for this very step
                    d = ahead[i]
                    i += 1
                elif c >= span_end:  # (before it: still in the latency model's span, predict's value unchanged)
                    if span is not None:  # predict's value, and how many steps from here give it too
                        d, m = span(nd, total + (c - start) * nd, longest + c - start)
                        span_end = c + m
                    else:  # the next iteration (start_step); may raise, as start_step would
                        d = predict(nd, total + (c - start) * nd, longest + c - start)
                t += d
                if t >= horizon_s:
                    break
        finally:  # the state of the ends taken (also when the latency model raised)
            if pooled:
                needs.append((self._pool_id, pooled))
            if needs:
                kv.extend_private(needs, last)  # fits: checked against room; the order of needs does not matter
            num = clock - start
            if num:
                self.busy_s = busy
                self.num_iterations_run += num
                self.num_fast_iterations = clock
                self.num_steady_ticks += num
                if not self._inert:
                    _fastpath.count_skipped(self.hook, num)
                self.iteration += num
                self._ctx_total, self._ctx_max, self._steady_s = total + num * nd, longest + num, d
        return last, num, t

    def plain_ends(self, now_s: float, max_ends: int) -> tuple[int, float]:
        """How many iteration ends from the one in flight (ending at ``now_s``)
        on are provably plain ticks that :meth:`run_steady` takes, at most
        ``max_ends``, and the end time of the iteration in flight after them;
        changes nothing. Only after :meth:`can_run_steady`, and only as long as
        nothing but this instance's own ticks changes its state: then
        ``run_steady(now_s, horizon)`` with ``horizon`` at most that time
        takes every end before ``horizon`` and stops exactly there.

        Proof of the bound: no cohort member finishes before the finish heap's
        top, and every member's blocks cover its context + 2 at the start of
        the iteration in flight (the due list is empty), so over ``j`` ends it
        needs at most ``ceil(j / block_size)`` blocks, and all ``n`` members at
        most ``n * ceil(j / block_size)``: within the free and idle blocks for
        ``j <= block_size * (free_and_idle // n)``. The end times are
        ``run_steady``'s sums, the same float operations in the same order."""
        finish, kv, nd = self._lazy_finish, self.kv, len(self.running)
        if not nd:
            return 0, now_s
        clock = self.num_fast_iterations
        num = max_ends
        if finish:
            num = min(num, finish[0][0] - clock - 1)
        num = min(num, kv.block_size * ((kv.num_free_blocks + kv.num_idle_blocks) // nd))
        # a step that gives None or raises ends the list: run_steady meets it there, at its time
        ds = decode_run_s(self.latency, nd, self._ctx_total, self._ctx_max, num) if num > 0 else []
        self._ahead = (clock, nd, self._ctx_total, self._ctx_max, ds)  # run_steady's next durations (pure values)
        return len(ds), functools.reduce(operator.add, ds, now_s)  # now_s + ds[0] + ds[1] ..., in that order

    def _ahead_from(self, clock: int, nd: int, total: int, longest: int) -> tuple[list, int]:
        """plain_ends' durations still ahead of a steady run at these aggregates, and where they
        start (the latency model is pure: the same arguments give the same values); ([], 0) when
        the run is not the one plain_ends looked at."""
        ahead = self._ahead
        if ahead is not None and ahead[1] == nd:
            k = clock - ahead[0]
            if k >= 0 and total == ahead[2] + k * nd and longest == ahead[3] + k:
                return ahead[4], k
        return _NO_AHEAD, 0

    def _reserve_due(self, clock: int, room: int, needs: list) -> int:
        """The cohort members whose block boundary ``clock`` reaches get their
        blocks (as _start_steady would after the end at ``clock``), appended
        to ``needs``, when they fit in ``room``; returns the room left, or -1
        with nothing changed when they do not fit.

        A member filed under ``clock`` in ``_lazy_due`` has ``num_blocks *
        block_size - 1`` tokens of context at ``clock`` (its key's definition;
        materialising keeps it): it needs exactly one block now and one every
        ``block_size`` clocks after, at the clocks of its phase (``clock`` mod
        ``block_size``), until it finishes. So from its first boundary on it
        is a phase member: counted in ``_phase_live``, its blocks taken for
        the whole phase at once into the decode pool (one need) and handed to
        it later (_attribute): O(1) per boundary, not per member."""
        bs = self.kv.block_size
        phase, p = self._phase_live, clock % bs
        num = phase[p]
        members = self._lazy_due.pop(clock, None)
        live = [req for req in members if req.finish_s is None] if members is not None else ()
        if num + len(live) > room:
            if members is not None:
                self._lazy_due[clock] = members
            return -1
        for req in live:
            req.num_blocks += 1
            needs.append((req.owner_id, 1))
            req.pool_from = clock + bs
        if num:
            needs.append((self._pool_id, num))
        phase[p] = num + len(live)
        self._pooled_upto = clock
        return room - num - len(live)

    def _advance_all(self, now_s: float) -> None:
        """Every running request, one by one: one token, finish or block check."""
        bs = self.kv.block_size
        total = longest = 0
        due = self._due
        for req in list(self.running):
            if self._advance_one(req, now_s):
                continue
            c = req.num_computed_tokens
            total += c
            longest = max(longest, c)
            if c + 2 > req.num_blocks * bs:
                due.append(req)
        self._ctx_total, self._ctx_max = total, longest

    def _advance_one(self, req: EngineRequest, now_s: float) -> bool:
        """One decode token for an eager request; True when it finished."""
        req.num_computed_tokens += 1
        req.num_generated += 1
        on_token = req.on_token
        if on_token is append_output_to_history and req.history.token_ids is None:
            req.history.num_tokens += 1  # what SessionHistory.append(1) does without token ids
        elif on_token is not None:
            on_token(req, now_s)
        if req.num_generated >= req.num_output_tokens:
            self._finish(req, now_s)
            return True
        return False

    def _advance_cohort(self, now_s: float) -> None:
        """The eager requests one by one and the cohort's finishes, merged in
        running order; then the aggregates from the heaps."""
        clock = self.num_fast_iterations
        total = self._ctx_total + len(self.running) - len(self._prefilling)  # every decode's context + 1
        finish, due, eager_max = self._lazy_finish, self._due, 0
        if self._eager:
            done = []
            while finish and finish[0][0] == clock:
                done.append(heapq.heappop(finish)[2])
            total, eager_max = self._advance_eager(done, total, now_s)
        else:  # the cohort's finishes alone, in running order (nothing here pushes onto the heap)
            while finish and finish[0][0] == clock:
                total -= self._finish_lazy(heapq.heappop(finish)[2], clock, now_s)
        if self._due_lazy or self._due_phase:  # every start reserves them or leaves the cohort
            raise AssertionError(f"{self.instance_id}: boundary blocks of clock {clock - 1} not reserved")
        members = self._lazy_due.pop(clock, None)
        if members is not None:
            self._due_lazy = [req for req in members if req.finish_s is None]
        self._due_phase = self._phase_live[clock % self.kv.block_size]
        if len(due) > 1:
            due.sort(key=_run_seq)
        top = self._longest  # _cohort_max, inline (once per iteration end)
        while top and top[0][2].finish_s is not None:
            heapq.heappop(top)
        longest = clock - top[0][0] if top else 0
        self._ctx_total, self._ctx_max = total, eager_max if eager_max > longest else longest  # noqa: FURB136 (faster than max)

    def _advance_eager(self, done: list, total: int, now_s: float) -> tuple[int, int]:
        """_advance_cohort's merge: the eager requests one by one and the
        finishing members ``done``, in running order; (total, longest eager)."""
        clock, bs = self.num_fast_iterations, self.kv.block_size
        i, eager, due, eager_max = 0, [], self._due, 0
        for req in self._eager:
            while i < len(done) and done[i].run_seq < req.run_seq:
                total -= self._finish_lazy(done[i], clock, now_s)
                i += 1
            if self._advance_one(req, now_s):
                total -= req.num_computed_tokens
                continue
            eager.append(req)
            c = req.num_computed_tokens
            if c > eager_max:  # noqa: PLR1730 (faster than max)
                eager_max = c
            if c + 2 > req.num_blocks * bs:
                due.append(req)
        for req in done[i:]:
            total -= self._finish_lazy(req, clock, now_s)
        self._eager = eager
        return total, eager_max

    def _cohort_max(self) -> int:
        """The longest context among the cohort's members (0 with none)."""
        top = self._longest
        while top and top[0][2].finish_s is not None:
            heapq.heappop(top)
        return self.num_fast_iterations - top[0][0] if top else 0

    def _finish_lazy(self, req: EngineRequest, clock: int, now_s: float) -> int:
        """Bring a finishing cohort member up to date and finish it; its context."""
        lag = clock - req.lazy_base  # _materialise, inline
        if lag:
            req.num_computed_tokens += lag
            req.num_generated += lag
            req.history.num_tokens += lag
        req.lazy_base = -1
        if req.pool_from >= 0:  # its pooled blocks, then it leaves its phase
            self._attribute(req)
            self._phase_live[req.pool_from % self.kv.block_size] -= 1
            req.pool_from = -1
        self.num_lazy_finishes += 1
        self._finish(req, now_s)
        return req.num_computed_tokens

    # -- scheduling -----------------------------------------------------------------
    def _schedule(self, now_s: float) -> tuple[list[tuple[EngineRequest, int]], bool]:
        budget = self.limits.token_budget
        batch: list[tuple[EngineRequest, int]] = []
        running, bs, preemptions = self.running, self.kv.block_size, self.num_preemptions
        for decoding in (True, False):  # decodes first, then in-flight prefill chunks
            for req in list(running):
                if budget <= 0:
                    break
                left = req.num_prompt_tokens + req.num_generated - req.num_computed_tokens
                if (left == 1 and req.first_token_s is not None) != decoding:  # is_decoding, inlined
                    continue
                if self.num_preemptions != preemptions and req not in running:  # preempted meanwhile
                    continue
                n = min(budget, left)
                # _reserve, when it has blocks to find (without any, it changes nothing)
                if (-(-(req.num_computed_tokens + n + 1) // bs) > req.num_blocks
                        and not self._reserve(req, req.num_computed_tokens + n, now_s, batch)):
                    continue
                batch.append((req, n))
                budget -= n
        return batch, self._admit_waiting(budget, batch, now_s)

    def _admit_waiting(self, budget: int, batch: list, now_s: float) -> bool:
        """FCFS admissions into ``batch`` within ``budget``; True when one was blocked."""
        waiting, running, max_seqs, kv = self.waiting, self.running, self.limits.max_num_seqs, self.kv
        while waiting and budget > 0 and len(running) < max_seqs:
            req = waiting[0]
            num_tokens = req.num_prompt_tokens + req.num_generated  # req.num_tokens
            if -(-(num_tokens + 1) // kv.block_size) > kv.num_blocks:
                self._reject(waiting.popleft(), now_s)
                continue
            if not self._admit(req, now_s):
                return True
            waiting.popleft()
            running.append(req)
            self._num_routed += req.kind is _ROUTED
            req.run_seq = self._num_admitted
            self._num_admitted += 1
            n = min(budget, num_tokens - req.num_computed_tokens)
            batch.append((req, n))
            budget -= n
        return False

    def _reserve(self, req: EngineRequest, num_tokens: int, now_s: float, batch: list) -> bool:
        """Blocks for ``num_tokens`` (+1 slot for the sampled token); preempts
        the most recently admitted request until they fit. False if ``req``
        itself was preempted."""
        need = -(-(num_tokens + 1) // self.kv.block_size) - req.num_blocks
        while need > 0 and not self.kv.extend(req.owner_id, (), need, now_s):
            victim = self.running[-1]
            self._preempt(victim, now_s, batch)
            if victim is req:
                return False
        req.num_blocks += max(0, need)
        return True

    def _preempt(self, req: EngineRequest, now_s: float, batch: list) -> None:
        self.running.remove(req)
        self._num_routed -= req.kind is _ROUTED
        batch[:] = [(r, n) for r, n in batch if r is not req]
        self.kv.release(req.owner_id, now_s)
        req.num_computed_tokens = 0
        req.num_blocks = 0
        req.num_admissions += 1
        self.waiting.appendleft(req)
        self.queued_prefill_tokens += req.num_tokens
        self.num_preemptions += 1

    def _admit(self, req: EngineRequest, now_s: float) -> bool:
        kv = self.kv
        bs = kv.block_size
        if req.num_oracle_tokens and req.num_admissions == 0:  # oracle: the prefix is cached for free
            owner = f"oracle:{req.request_id}"
            if kv.allocate(owner, req.history.block_hashes(bs, req.num_oracle_tokens // bs), 0,
                           KVClass.NORMAL, now_s) is not None:
                kv.release(owner, now_s)
        # A re-admitted (preempted) private request names its own released blocks: the KV manager alone decides
        # (allocate's may_hold_prefix check), so the flag is passed as it is.
        private = req.private_kv
        num_tokens = req.num_prompt_tokens + req.num_generated  # req.num_tokens
        hashes = (req.history.block_hash_run if private else req.history.block_hashes)(bs, num_tokens // bs)
        total = -(-(num_tokens + 1) // bs)
        alloc = kv.allocate(req.owner_id, hashes, total - len(hashes), KVClass.NORMAL, now_s, private=private)
        if alloc is None:
            return False
        # vLLM's get_computed_blocks: a hit covers at most num_tokens - 1 tokens in whole blocks (the last
        # token is always computed), so a fully cached prompt still recomputes its last block.
        hit = min(alloc.num_device_hit_blocks + alloc.num_host_hit_blocks, (num_tokens - 1) // bs) * bs
        if req.num_cached_tokens is None:
            req.num_cached_tokens = hit
        req.num_computed_tokens = hit
        req.num_blocks = total
        req.pending_reload_s = alloc.reload_s
        self.queued_prefill_tokens -= num_tokens
        return True

    def _advance(self, req: EngineRequest, n: int, now_s: float) -> None:
        req.num_computed_tokens += n
        if req.num_computed_tokens < req.num_tokens:
            return  # a partial prefill chunk
        if req.first_token_s is None:
            req.first_token_s = now_s
        req.num_generated += 1
        on_token = req.on_token
        if on_token is append_output_to_history and req.history.token_ids is None:
            req.history.num_tokens += 1  # what SessionHistory.append(1) does without token ids
        elif on_token is not None:
            on_token(req, now_s)
        if req.num_generated >= req.num_output_tokens:
            self._finish(req, now_s)

    def _reject(self, req: EngineRequest, now_s: float) -> None:
        """A request longer than the whole pool ends at once, marked rejected."""
        req.rejected = True
        req.finish_s = now_s
        self.queued_prefill_tokens -= req.num_tokens
        self.num_rejected += 1
        if req.on_finish is not None:
            req.on_finish(req, now_s)

    def _finish(self, req: EngineRequest, now_s: float) -> None:
        req.finish_s = now_s
        self.running.remove(req)
        self._num_routed -= req.kind is _ROUTED
        # Cache the full blocks whose KV was computed, as vLLM does: the last sampled token's KV never is,
        # so (num_tokens - 1) // block_size blocks.
        kv, history = self.kv, req.history
        bs = kv.block_size
        num_full = (req.num_prompt_tokens + req.num_generated - 1) // bs  # req.num_tokens - 1
        kv.release_and_cache(req.owner_id,
                             (history.block_hash_run if req.private_kv else history.block_hashes)(bs, num_full),
                             f"commit:{req.request_id}", now_s)
        if req.on_finish is not None:
            req.on_finish(req, now_s)

    # -- shadow chunks --------------------------------------------------------------
    def _batch_report(self, batch: list[tuple[EngineRequest, int]], results: list[ChunkResult]) -> BatchReport:
        """The iteration as it runs: the scheduled requests in batch order, then the shadow chunks."""
        entries = [BatchEntry(r.request_id, r.kind.value, n) for r, n in batch]
        entries += [BatchEntry(_shadow_owner(c.grant), "shadow", c.num_computed_tokens, c.grant.job)
                    for c in results if c.num_computed_tokens]
        return BatchReport(self.instance_id, self.iteration, tuple(entries), self.kv.num_shadow_blocks,
                           self.kv.cap_blocks)

    def _duration(self, entries: list, snapshot: StepSnapshot, chunks: tuple, used: int, reload_s: float) -> float:
        """The iteration's predicted duration: the batch with the plan's chunks, plus the host-tier
        reloads of ``entries`` (taken: each is paid once) and of the chunks; records the tokens run."""
        for r, _ in entries:
            reload_s += r.pending_reload_s
            r.pending_reload_s = 0.0
        self.last_batch_tokens = used + sum(c.num_new_tokens for c in chunks)
        return self.latency.predict_s(snapshot.batch_shape.with_prefills(chunks)) + reload_s

    def _run_shadow(self, plan: StepPlan | None, now_s: float) -> tuple[list[ChunkResult], tuple, float]:
        results: list[ChunkResult] = []
        chunks: list[PrefillChunk] = []
        reload_s = 0.0
        if plan is None:
            return results, (), reload_s
        bs = self.kv.block_size
        for g in plan.grants:
            job = self.hook.manager.job(g.job)
            computed = 0
            if job is not None and job.history.epoch == g.epoch:
                hashes = job.history.block_hashes(bs, g.end_token // bs)
                if self.kv.match_prefix(hashes).num_blocks >= g.start_token // bs:
                    alloc = self.kv.allocate(_shadow_owner(g), hashes, 0, KVClass.SHADOW, now_s)
                    if alloc is not None:
                        computed = g.num_tokens
                        reload_s += alloc.reload_s
                        chunks.append(PrefillChunk(g.num_tokens, g.start_token))
            results.append(ChunkResult(g, computed))
        return results, tuple(chunks), reload_s


def _materialise(req: EngineRequest, clock: int) -> None:
    """A cohort member's counters and history, caught up to ``clock``."""
    lag = clock - req.lazy_base
    if lag:
        req.num_computed_tokens += lag
        req.num_generated += lag
        req.history.num_tokens += lag
        req.lazy_base = clock


def _due_at(due_at: dict, clock: int, req: EngineRequest) -> None:
    """``req`` needs a block after the end at ``clock`` (the lazy due index)."""
    at = due_at.get(clock)
    if at is None:
        due_at[clock] = [req]
    else:
        at.append(req)


def _run_seq(req: EngineRequest) -> int:
    return req.run_seq


def _lazy_eligible(req: EngineRequest) -> bool:
    """A normal request whose only per-token work is its own history's count."""
    return (req.on_token is append_output_to_history and req.history.token_ids is None
            and req.kind is RequestKind.NORMAL)


_CLASSIC = object()  # _start_agg: run the slow path
_NO_AHEAD: list = []  # _ahead_from: no look-ahead (never appended to)
# The longest-context heap keeps finished members until they surface; past 4 entries per running request plus
# this many, _join rebuilds it from the live ones (the same minimum key: _cohort_max's answer does not change).
_LONGEST_SLACK = 64


class _ShadowRoom:
    """The KV manager's shadow room at ``now_s`` in tokens, computed on the
    first call (``shadow_room_blocks`` only counts: asking later at the same
    instant, with nothing allocated in between, gives the same value)."""

    __slots__ = ("_kv", "_now_s", "_tokens")

    def __init__(self, kv: KVClassManager, now_s: float) -> None:
        self._kv, self._now_s, self._tokens = kv, now_s, -1

    def __call__(self) -> int:
        if self._tokens < 0:
            self._tokens = self._kv.shadow_room_blocks(self._now_s) * self._kv.block_size
        return self._tokens


class _ValidatorsOff:
    """attrs validators off inside the block, as before it after (a plain
    context manager: cheaper than ``attrs.validators.disabled()``'s generator)."""

    __slots__ = ("_before",)

    def __enter__(self) -> None:
        self._before = attrs.validators.get_disabled()
        attrs.validators.set_disabled(True)

    def __exit__(self, *exc: object) -> None:
        attrs.validators.set_disabled(self._before)


_VALIDATORS_ON = contextlib.nullcontext()


def _validation(enabled: bool):
    """Run attrs validators or not (values built by trusted engine code only)."""
    return _VALIDATORS_ON if enabled else _ValidatorsOff()


def _shadow_owner(g) -> str:
    return f"shadow:{g.job.session_id}:{g.job.target_model}:{g.start_token}"


def pool_blocks(hbm_bytes_total: float, weight_bytes: float, kv_bytes_per_token: float, block_size: int,
                memory_utilization: float = 0.9) -> int:
    """KV blocks of an instance: what HBM leaves after weights (vLLM's
    ``gpu_memory_utilization`` share), in blocks."""
    free = hbm_bytes_total * memory_utilization - weight_bytes
    if free <= 0:
        raise ValueError(f"weights ({weight_bytes:.3g} B) leave no KV memory in {hbm_bytes_total:.3g} B")
    return max(1, math.floor(free / (block_size * kv_bytes_per_token)))
