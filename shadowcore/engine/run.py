"""One scenario under one policy on in-memory engine instances: the cluster,
the composition root's router side, the workload played by the
:class:`~shadowcore.engine.driver.SessionDriver`, and the summary metrics.

:class:`ScenarioRun` is the driver's :class:`~shadowcore.engine.driver.ServingPort`
for an :class:`~shadowcore.engine.cluster.EngineCluster`; a backend subclasses it
to build its instances (:meth:`ScenarioRun.build_instance`) and, where its
workload is not the scenario's synthetic one, :meth:`ScenarioRun.session_plans`
or :meth:`ScenarioRun.normal_traffic`.

Invariants: the workload is fixed before the first event (given, or drawn from
the scenario's seed), so every policy sees identical sessions and normal
requests; the policy's randomness comes from the :class:`ShadowConfig` seed
through the composition root. A normal request meets its SLO when its TTFT is
within ``max(slo.ttft_s, 5 x its isolated prefill)`` and its TPOT within the
instance's TPOT SLO; a rejected one is counted and is a miss. A normal request
with a :class:`~shadowcore.workloads.prefix.PromptPrefix` shares its leading
blocks with equal prefixes (``normal_hit_rate``: cached / prompt tokens of the
measured normal requests).
"""

from __future__ import annotations

import array
import contextlib
import gc
import itertools
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import attrs
import numpy as np

from shadowcore.config import ShadowConfig
from shadowcore.engine import _fastpath
from shadowcore.engine._fastpath import InlineEventLoop
from shadowcore.engine.cluster import EngineCluster
from shadowcore.engine.driver import CallOutcome, OnTokens, SessionDriver
from shadowcore.engine.instance import EngineInstance, EngineRequest, append_output_to_history
from shadowcore.engine.records import CallRecord, ScenarioResult, hit_rate, mean
from shadowcore.engine.workload import (
    NormalRequest,
    SessionPlan,
    Workload,
    draw_normal,
    draw_sessions,
    normal_requests,
)
from shadowcore.hook import EngineHook
from shadowcore.job import SessionHistory
from shadowcore.kv import KVClassPolicy
from shadowcore.latency import chunked_prefill_s
from shadowcore.pipeline import ShadowRuntime, build_runtime
from shadowcore.policy import PolicySpec, load_policy
from shadowcore.types import CallPlacement, RequestKind
from shadowcore.workloads.prefix import PrefixHistory, PromptPrefix


class Records:
    """An append-only list of equal-shaped tuples kept as one typed array per field
    (:mod:`array` type codes; ``"?"``: a bool, stored as a byte), read as that list
    of tuples. A run keeps one record per finished normal request for its whole
    duration: 9 to 24 bytes a record here, against a tuple and its boxed values
    (about 100 bytes) in a list, so the records' memory grows with the run's
    requests at a tenth of the cost.

    Invariant: iteration, indexing and ``len`` give exactly the tuples appended,
    in order, with the values appended (floats as C doubles: exact; ints within
    64 bits, else ``append`` raises ``OverflowError``)."""

    __slots__ = ("_appends", "_bools", "_columns")

    def __init__(self, *typecodes: str) -> None:
        if not typecodes:
            raise ValueError("Records needs at least one field")
        self._bools = tuple(i for i, c in enumerate(typecodes) if c == "?")
        self._columns = tuple(array.array("b" if c == "?" else c) for c in typecodes)
        self._appends = tuple(column.append for column in self._columns)  # (bound once: one a finished request)

    def append(self, record: tuple) -> None:
        appends = self._appends
        if len(record) != len(appends):
            raise ValueError(f"a record of {len(appends)} fields, got {record!r}")
        for append, value in zip(appends, record):
            append(value)

    def _row(self, values: tuple) -> tuple:
        if not self._bools:
            return values
        return tuple(bool(v) if i in self._bools else v for i, v in enumerate(values))

    def __len__(self) -> int:
        return len(self._columns[0])

    def __iter__(self) -> Iterator[tuple]:
        return map(self._row, zip(*self._columns)) if self._bools else zip(*self._columns)

    def __getitem__(self, index: int) -> tuple:
        return self._row(tuple(column[index] for column in self._columns))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Records | list | tuple):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return f"Records({list(self)!r})"

    def reorder(self, order: Sequence[int] | np.ndarray) -> None:
        """Keep the records in ``order`` (a permutation of their indices): record ``order[k]`` becomes the k-th.
        Each column is gathered in C (numpy over the array's buffer), values exact: O(n) for any n."""
        idx = _permutation(order, len(self))
        self._columns = tuple(array.array(c.typecode, np.frombuffer(c, dtype=c.typecode)[idx].tobytes())
                              for c in self._columns)

    def __reduce__(self):
        return _records, (tuple("?" if i in self._bools else c.typecode for i, c in enumerate(self._columns)),
                          list(self))


def _permutation(order: Sequence[int] | np.ndarray, n: int) -> np.ndarray:
    """``order`` as an index array, or ValueError when it is not a permutation of ``range(n)``."""
    idx = np.asarray(order)
    if n == 0 and idx.shape == (0,):
        return np.zeros(0, dtype=np.intp)
    ok = idx.shape == (n,) and idx.dtype.kind in "iu" and 0 <= idx.min() and idx.max() < n
    if ok:
        seen = np.zeros(n, dtype=bool)
        seen[idx] = True
        ok = bool(seen.all())  # n indices in range, all hit: each exactly once
    if not ok:
        raise ValueError("Records.reorder needs a permutation of the record indices")
    return idx.astype(np.intp, copy=False)


def _records(typecodes: tuple[str, ...], rows: list[tuple]) -> Records:
    out = Records(*typecodes)
    for row in rows:
        out.append(row)
    return out


@attrs.define(eq=False)
class ScenarioRun:
    """One scenario (a :class:`~shadowcore.engine.workload.ScenarioSpec`)
    under one policy. ``workload``: the sessions and normal requests to play
    (default: :meth:`draw_workload`); ``sessions``: scripted sessions in place
    of the workload's (its normal traffic stays). After construction
    ``workload`` is the complete workload the run plays."""

    scenario: Any
    shadow: ShadowConfig
    observers: tuple = ()
    workload: Workload | None = None
    sessions: tuple[SessionPlan, ...] | None = None
    loop: InlineEventLoop = attrs.field(init=False, factory=InlineEventLoop)
    policy: PolicySpec = attrs.field(init=False)
    cluster: EngineCluster = attrs.field(init=False)
    runtime: ShadowRuntime = attrs.field(init=False)
    driver: SessionDriver = attrs.field(init=False)
    #: (arrival, met SLO) of every finished normal request, in finishing order
    normal: Records = attrs.field(init=False, factory=lambda: Records("d", "?"))
    #: (arrival, prompt tokens, cached prompt tokens) of every finished normal request (0 cached if rejected)
    normal_tokens: Records = attrs.field(init=False, factory=lambda: Records("d", "q", "q"))
    rejected_normal: list[str] = attrs.field(init=False, factory=list)  # longer than a whole KV pool
    #: When each record of ``normal`` and of ``rejected_normal`` was made: the cluster's deferred instances
    #: finish their requests out of the loop's order, and :meth:`run` puts the records back in finishing order.
    _normal_finish_s: array.array = attrs.field(init=False, factory=lambda: array.array("d"))
    _rejected_finish_s: array.array = attrs.field(init=False, factory=lambda: array.array("d"))
    _dedicated: set[str] = attrs.field(init=False, factory=set)
    #: (id of the instance's latency model, token budget, prompt tokens) -> its isolated prefill time (pure in
    #: all three: computed once; the instances of one model share one latency model and budget)
    _isolated_s: dict[tuple[int, int, int], float] = attrs.field(init=False, factory=dict)
    #: A normal request without a prefix is a fresh prompt in a history of its own: its KV blocks are the KV
    #: manager's private blocks (``EngineRequest.private_kv``). A run whose other parts name a normal
    #: request's blocks (the P/D fabric pins them on the decode instance) turns this off.
    private_normal_kv: ClassVar[bool] = True

    def __attrs_post_init__(self) -> None:
        sc = self.scenario
        self.policy = load_policy(self.shadow.policy, field="shadow.policy")
        extra = 1 if self.policy.dedicated_instances else 0
        self.cluster = self.build_cluster(extra)
        by_model = self.cluster.by_model
        dedicated = {m: insts[-1].instance_id for m, insts in by_model.items()} if extra else {}
        self.runtime = build_runtime(self.shadow, self.cluster, sc.models, dedicated)
        self.cluster.watch_jobs(self.runtime.manager)
        for obs in self.observers:
            self.runtime.observers.add(obs)
        for inst in self.cluster.by_id.values():  # fixed order: attach draws from the runtime's generator
            inst.hook = self.attach_hook(inst)
            if inst.hook is not None:
                self.runtime.check_reach(inst.hook, inst.tpot_slo_s)
        self._dedicated.update(dedicated.values())
        if self.workload is None:
            self.workload = self.draw_workload(self.sessions)
        elif self.sessions is not None:
            self.workload = attrs.evolve(self.workload, sessions=tuple(self.sessions))
        self.driver = SessionDriver(self.loop, self.runtime.manager, self)

    # -- what a backend provides -----------------------------------------------------
    def build_instance(self, instance_id: str, model: str, kv_policy: KVClassPolicy) -> EngineInstance:
        raise NotImplementedError

    def build_cluster(self, extra: int) -> EngineCluster:
        """The run's instances. ``by_model`` lists, per model, the instances the
        router side may place calls on (with ``extra``, the last one of each
        model is the dedicated shadow instance); ``by_id`` holds every instance."""
        sc = self.scenario
        by_model = {
            m: [self.build_instance(f"{m}/{k}", m, self.policy.kv) for k in range(sc.instances_per_model + extra)]
            for m in sc.models
        }
        by_id = {i.instance_id: i for insts in by_model.values() for i in insts}
        return EngineCluster(self.loop, by_model, by_id)

    def attach_hook(self, inst: EngineInstance) -> EngineHook | None:
        """The engine hook of ``inst`` (None: the instance runs no shadow work)."""
        return self.runtime.attach(inst.instance_id, inst, inst.latency)

    def serving_instances(self) -> list[str]:
        """The instances normal traffic may arrive at (not the dedicated ones), in cluster order."""
        return [i for i in self.cluster.by_id if i not in self._dedicated]

    def draw_workload(self, sessions: Sequence[SessionPlan] | None = None) -> Workload:
        """The workload when none is given: :meth:`session_plans` (or
        ``sessions``, and then none are drawn) and :meth:`normal_traffic`."""
        return Workload(tuple(self.session_plans() if sessions is None else sessions), self.normal_traffic())

    def session_plans(self) -> list[SessionPlan]:
        """The drawn sessions (default: the scenario's Markov sessions)."""
        return draw_sessions(self.scenario)

    def normal_traffic(self) -> tuple[NormalRequest, ...]:
        """The drawn normal requests (default: the scenario's Poisson traffic,
        the k-th serving instance drawing from ``[seed, 2, k]``)."""
        sc = self.scenario
        return normal_requests((inst, draw_normal(sc, k)) for k, inst in enumerate(self.serving_instances()))

    # -- the run ---------------------------------------------------------------------
    @property
    def calls(self) -> list[CallRecord]:
        return self.driver.calls

    @property
    def rejected(self) -> list[str]:
        """Request ids longer than a whole KV pool: routed calls, then normal requests."""
        return [*self.driver.rejected, *self.rejected_normal]

    def run(self) -> ScenarioResult:
        assert self.workload is not None
        self.driver.schedule(self.workload, self.serving_instances())
        with _young_gc_relaxed():
            self.loop.run()
        self._records_in_finishing_order()
        return ScenarioResult(self.runtime.policy.name, tuple(self.calls), self.summary(), tuple(self.runtime.notices),
                              self.scenario.warmup_s)

    # -- the driver's serving port ---------------------------------------------------
    def input_token_ids(self, session_id: str, call_index: int, model: str, num_tokens: int) -> None:
        return None  # the in-memory engine looks prefixes up by block hashes of counts

    def start_call(self, request_id: str, placement: CallPlacement, history: SessionHistory,
                   num_output_tokens: int, on_tokens: OnTokens,
                   on_finish: Callable[[CallOutcome], None]) -> None:
        inst = self.cluster.by_id[placement.instance_id]
        req = EngineRequest(
            request_id, RequestKind.ROUTED, history, history.num_tokens, num_output_tokens, self.loop.now_s,
            self.scenario.slo.ttft_s, inst.tpot_slo_s, num_oracle_tokens=placement.num_oracle_prefix_tokens,
            on_token=lambda r, t, f=on_tokens: f(1, None),
            on_finish=lambda r, t, f=on_finish: f(_outcome(r)),
        )
        self._enqueue(inst, req)

    @property
    def feeds_normal(self) -> bool:
        """Normal requests go to the cluster up front (:meth:`feed_normal`) when an instance may be deferred
        (``EngineCluster.defer_instances``: a hook that plans nothing or none, or a skippable controller's while
        the cluster watches the jobs, deferred while no job is pending on it); otherwise, or when a subclass
        changes how one starts (``start_normal``, ``_enqueue``) or hooks ``_normal_done`` (which hears of every
        finish in the loop's order: a deferred instance finishes its requests in stretches), one by one
        through ``start_normal``."""
        cls = type(self)
        if (cls.start_normal is not ScenarioRun.start_normal or cls._enqueue is not ScenarioRun._enqueue
                or cls._normal_done is not ScenarioRun._normal_done or not self.cluster.defer_instances):
            return False
        watched = self.cluster.jobs_watched  # then a hook with no pending job plans nothing until one activates
        return any(i.hook is None or _fastpath.plans_nothing(i.hook)
                   or (watched and _fastpath.skippable(i.hook.slack) is not None) for i in self.cluster.by_id.values())

    def feed_normal(self, by_instance: dict[str, list[tuple[str, NormalRequest]]]) -> None:
        """Each instance takes its own arrivals (``EngineCluster.feed``)."""
        for instance_id, requests in by_instance.items():
            self.cluster.feed(self.cluster.by_id[instance_id], requests, self._fed_request)

    def _fed_request(self, inst: EngineInstance, request_id: str, r: NormalRequest, arrival_s: float) -> EngineRequest:
        return self._normal_request(request_id, inst, r.num_prompt_tokens, r.num_output_tokens, r.prefix, arrival_s)

    def start_normal(self, request_id: str, instance_id: str, num_prompt_tokens: int,
                     num_output_tokens: int, prefix: PromptPrefix | None = None) -> None:
        inst = self.cluster.by_id[instance_id]
        self._enqueue(inst, self._normal_request(request_id, inst, num_prompt_tokens, num_output_tokens, prefix,
                                                 self.loop.now_s))

    def _normal_request(self, request_id: str, inst: EngineInstance, num_prompt_tokens: int, num_output_tokens: int,
                        prefix: PromptPrefix | None, arrival_s: float) -> EngineRequest:
        if prefix is None:
            history = SessionHistory(request_id, num_tokens=num_prompt_tokens)  # = append(num_prompt_tokens) to ()
            if num_prompt_tokens < 0:
                history = SessionHistory(request_id)
                history.append(num_prompt_tokens)  # raises, as it did
        else:  # its leading blocks are named by the trace's hashes: shared with equal prefixes
            history = PrefixHistory.for_prompt(request_id, num_prompt_tokens, prefix)
        req = EngineRequest(request_id, RequestKind.NORMAL, history, num_prompt_tokens, num_output_tokens,
                            arrival_s, inst.tpot_slo_s * 40, inst.tpot_slo_s,
                            on_token=append_output_to_history, on_finish=self._normal_done,
                            private_kv=prefix is None and self.private_normal_kv)
        key = (id(inst.latency), inst.limits.token_budget, num_prompt_tokens)
        isolated = self._isolated_s.get(key)
        if isolated is None:
            isolated = self._isolated_s[key] = chunked_prefill_s(inst.latency, num_prompt_tokens,
                                                                 inst.limits.token_budget)
        req.ttft_slo_s = max(self.scenario.slo.ttft_s, 5 * isolated)
        return req

    def settle(self) -> None:
        self.cluster.kick_all()

    def _enqueue(self, inst: EngineInstance, req: EngineRequest) -> None:
        inst.enqueue(req)
        self.cluster.kick(inst)

    def _normal_done(self, req: EngineRequest, now_s: float) -> None:
        self._normal_finish_s.append(now_s)
        self.normal_tokens.append((req.arrival_s, req.num_prompt_tokens, req.num_cached_tokens or 0))
        if req.rejected:  # counted, and a miss: nothing is dropped silently
            self._rejected_finish_s.append(now_s)
            self.rejected_normal.append(req.request_id)
            self.normal.append((req.arrival_s, False))
            return
        ttft = req.first_token_s - req.arrival_s
        tpot = (now_s - req.first_token_s) / max(1, req.num_output_tokens - 1)
        self.normal.append((req.arrival_s, ttft <= req.ttft_slo_s and tpot <= req.tpot_slo_s))

    def _records_in_finishing_order(self) -> None:
        """The normal records by finishing time, stably: one instance's requests in the order it finished them
        (the loop's order), two instances' requests finishing at the same instant in no order beyond that."""
        for times, lists in ((self._normal_finish_s, (self.normal, self.normal_tokens)),
                             (self._rejected_finish_s, (self.rejected_normal,))):
            if all(map(operator.le, times, itertools.islice(times, 1, None))):
                continue  # in the loop's order already (no instance was deferred)
            at = np.frombuffer(times, dtype=np.float64)  # a view: released before times is written
            order = np.argsort(at, kind="stable")  # equal times keep their order, as sorted() would
            ordered = at[order].tobytes()
            del at
            for records in lists:
                if isinstance(records, Records):
                    records.reorder(order)
                else:
                    records[:] = [records[i] for i in order.tolist()]
            times[:] = array.array("d", ordered)

    # -- metrics ---------------------------------------------------------------------
    def summary(self) -> dict[str, float]:
        sc = self.scenario
        measured = [c for c in self.calls if c.arrival_s >= sc.warmup_s]
        switch = [c for c in measured if c.is_switch]
        normal = [met for arrival, met in self.normal if arrival >= sc.warmup_s]
        normal_prompt = sum(p for arrival, p, _ in self.normal_tokens if arrival >= sc.warmup_s)
        normal_cached = sum(c for arrival, _, c in self.normal_tokens if arrival >= sc.warmup_s)
        insts = list(self.cluster.by_id.values())
        shadow_tokens = sum(i.num_shadow_tokens for i in insts)
        used = sum(i.kv.num_shadow_blocks_used * i.kv.block_size for i in insts)
        return {
            "calls": float(len(measured)),
            "switch_calls": float(len(switch)),
            "call_latency_s": mean(c.latency_s for c in measured),
            "switch_latency_s": mean(c.latency_s for c in switch),
            "switch_ttft_s": mean(c.ttft_s for c in switch),
            "hit_rate": hit_rate(measured),
            "switch_hit_rate": hit_rate(switch),
            "normal_slo_attainment": mean(1.0 if m else 0.0 for m in normal),
            "normal_hit_rate": normal_cached / normal_prompt if normal_prompt else float("nan"),
            "shadow_tokens": float(shadow_tokens),
            "shadow_tokens_used": float(used),
            "rejected_requests": float(len(self.driver.rejected) + len(self.rejected_normal)),
            **{f"steps_{why}": float(n) for why, n in self.runtime.step_counts().items()},
        }


#: Allocations between young-generation collections while a run loop runs
#: (CPython's default is 700). The loop allocates many short-lived values and
#: few cycles, so at the default the collector runs every few iterations.
_RUN_GC_THRESHOLD0 = 50_000


@contextlib.contextmanager
def _young_gc_relaxed() -> Iterator[None]:
    """Collect the young generation less often inside the block, then restore
    the thresholds; only when the caller kept the default (a caller that tuned
    or disabled the collector is left alone). Results do not depend on when
    the collector runs."""
    before = gc.get_threshold()
    relax = gc.isenabled() and before[0] < _RUN_GC_THRESHOLD0
    if relax:
        gc.set_threshold(_RUN_GC_THRESHOLD0, *before[1:])
    try:
        yield
    finally:
        if relax:
            gc.set_threshold(*before)


def _outcome(req: EngineRequest) -> CallOutcome:
    return CallOutcome(req.rejected, req.arrival_s, req.first_token_s, req.finish_s, req.num_prompt_tokens,
                       req.num_cached_tokens)
