"""Iteration-level shadow scheduling inside vLLM v1 engines.

:class:`ShadowScheduler` (vLLM's synchronous ``Scheduler``, the CPU engine's)
and :class:`AsyncShadowScheduler` (``AsyncScheduler``, the GPU default: a
subclass of only the synchronous one would silently turn async scheduling
off) are :class:`ShadowSchedulerMixin` over each base. Load one with
``--scheduler-cls shadow_vllm.scheduler.ShadowScheduler`` (or
``LLM(scheduler_cls=...)``); its policy comes from
``additional_config["shadowprefill"]`` (:mod:`shadow_vllm.engine_config`) and
is rebuilt here with the core's loaders, so a policy that ran in the
simulator runs here unchanged.

Per ``schedule()``: shadow requests (tagged ``shadowprefill_kind=shadow``,
:mod:`shadowcore.wire`) are kept out of vLLM's queues; vLLM schedules the
normal and routed work exactly as stock; a :class:`~shadowcore.types.StepSnapshot`
of that batch goes to the core's :class:`~shadowcore.hook.EngineHook`, and the
chunks of its plan are admitted after everything else, from the prefix cache.
``update_from_output()`` reports the step (:class:`~shadowcore.types.StepOutcome`).

Layout: this module holds the request lifecycle, the step (plan, admit,
report) and finishing shadows; :mod:`shadow_vllm.snapshot` translates a vLLM
step into the core's snapshot and batch report, :mod:`shadow_vllm.connector_loads`
handles KV connectors (metadata and loads), both mixed into
:class:`ShadowSchedulerMixin`; every vLLM internal used is listed in
:mod:`shadow_vllm.vllm_internals`.

Invariants (``tests/vllm/``):

* Shadow tokens come only from the hook's plan (none while a request waits or
  an admission was blocked, except under Eager) and are scheduled after all
  normal work, within the step's remaining token budget and sequence slots.
* Between steps a shadow request holds no KV blocks (it is released at the
  start of every ``schedule()``; its computed blocks stay cached as the
  shadow class), so normal work never waits for, or preempts past, a shadow:
  shadows are always preempted first. The one exception is a shadow whose
  asynchronous connector load (host tier) is in flight: it holds the
  blocks being loaded, outside vLLM's queues, until the load finishes.
* The core's KV classes hold in vLLM's block pool (:mod:`shadow_vllm.kvpool`):
  shadow cap, shadow-first eviction after never-used blocks, cold age,
  promotion on a normal hit.
* A shadow request finishes (``stop_reason`` :data:`STOP_PREFILLED`) once its
  full blocks are computed, or once what is missing of all shadows is below
  the policy's ``n_min`` (:data:`STOP_BELOW_N_MIN` with ``held=<tokens>``,
  the prefix the engine holds for it: the core never plans such a tail); it
  never decodes. A newer shadow of the same
  (session, target) finishes the older one (:data:`STOP_SUPERSEDED`).
* With no shadow request the subclass schedules exactly as stock vLLM, and
  nearly as cheaply: while the engine holds no shadow request and the hook
  can skip (``_fastpath.can_skip``, the engines' private fast path), ``schedule()`` takes the quiet path
  (one flag, kept where shadows come and go, and the observer list): no
  snapshot, no plan, no step record; the step goes to
  ``_fastpath.skip_step`` (same controller state as planning it), and
  vLLM's per-request ``_update_request_with_output`` runs unwrapped.
* A KV connector (offloading, P/D) sees shadow chunks like any request's: in
  a step that may admit them, vLLM's connector metadata is built once over
  the whole output, shadow chunks included, as vLLM builds it (before the
  step's tokens count as computed); a shadow admission asks the connector
  and tells it of the request as vLLM's admission of a waiting one does, and
  loads the connector's external hit as vLLM does (a host tier's blocks
  come back instead of being recomputed): a synchronous load (taken only in
  a step with no normal or routed work, since it runs inside the forward
  pass) puts the chunk's compute after the loaded tokens; an asynchronous
  one (``OffloadingConnector``) computes nothing that step and parks the
  shadow until the load finishes, when its blocks are cached and released
  like any chunk's. The job then adopts what the engine holds for the
  request (``job.refresh`` with its computed tokens, or the prefix cache's
  reading ``EnginePort.cached_prefix_tokens`` gives if longer), so the next
  plan starts where the prefix really ends. A shadow going on where its own
  last chunk ended is not asked about again (a running request's next chunk:
  vLLM asks no connector for those). A connector error or a "cannot tell
  yet" drops the chunk, nothing else.
* Under async scheduling a step is reported when the next one is scheduled
  (its outcome is not in yet): with the latency model's predicted duration,
  planned or skipped (``tests/vllm/test_virtual_async.py``).

Public attributes other modules use: ``shadow_clock`` (seconds; monotonic by
default; the virtual-time mode sets its virtual clock), ``shadow_hook``,
``shadow_bridge``, ``shadow_jobs``, ``shadow_stats``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import attrs
import numpy as np

from shadow_vllm import vllm_internals
from shadow_vllm.connector_loads import ConnectorLoads, _ShadowLoad
from shadow_vllm.engine_config import CONFIG_KEY, EngineShadowConfig
from shadow_vllm.kvpool import ShadowKVBridge
from shadow_vllm.metrics import EngineMetrics
from shadow_vllm.snapshot import SnapshotTranslation
from shadow_vllm.vllm_internals import (
    AsyncScheduler,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    NewRequestData,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerOutput,
)
from shadowcore.diagnostics import unreachable_grant
from shadowcore.engine import _fastpath
from shadowcore.engine_jobs import EngineJobs, ShadowEntry
from shadowcore.hook import EngineHook
from shadowcore.job import SessionHistory
from shadowcore.pipeline import build_runtime
from shadowcore.slack import NoShadowController
from shadowcore.types import ChunkResult, StepOutcome, StepPlan
from shadowcore.wire import ShadowEnd, ShadowStop, ShadowTag, TagKind, parse_stop, parse_tag

__all__ = [
    "CONFIG_KEY",
    "STOP_BELOW_N_MIN",
    "STOP_NO_SHADOW",
    "STOP_OVER_CAP",
    "STOP_PREFILLED",
    "STOP_SUPERSEDED",
    "AsyncShadowScheduler",
    "ShadowScheduler",
    "ShadowSchedulerMixin",
    "ShadowStats",
]

logger = logging.getLogger(__name__)
vllm_internals.check()  # one clear error when the installed vLLM lacks what this module overrides or calls

# A shadow's stop_reason is a shadowcore.wire.ShadowStop; ends that leave part
# of the prompt uncomputed add ``held=<tokens>`` (the job's held prefix).
STOP_PREFILLED = ShadowStop(ShadowEnd.PREFILLED).to_stop_reason()
STOP_SUPERSEDED = ShadowStop(ShadowEnd.SUPERSEDED).to_stop_reason()
STOP_OVER_CAP = ShadowStop(ShadowEnd.OVER_CAP).to_stop_reason()
STOP_BELOW_N_MIN = ShadowStop(ShadowEnd.BELOW_N_MIN).to_stop_reason()  # the rest is below the policy's n_min
STOP_NO_SHADOW = ShadowStop(ShadowEnd.NO_SHADOW).to_stop_reason()


@attrs.define
class ShadowStats:
    """Counters of one engine's shadow work (read by tests and benchmarks)."""

    num_shadow_tokens: int = 0
    num_chunks: int = 0
    num_dropped_chunks: int = 0  # granted but not admitted (KV room, seats, stale start)
    num_finished: int = 0
    num_superseded: int = 0
    num_rejected: int = 0
    max_shadow_blocks: int = 0  # most shadow-class blocks seen after a step was planned
    num_loads: int = 0  # chunks that loaded a KV connector's external hit (sync or async)
    num_loaded_tokens: int = 0  # tokens those loads brought in (not computed)
    num_planned_tokens: int = 0  # tokens the shadow plans granted
    num_ended: dict[str, int] = attrs.Factory(dict)  # shadow requests ended, by stop reason (ShadowEnd value)


class _OpenStep(NamedTuple):
    """A step between ``schedule()`` and ``update_from_output()`` (a tuple: built every step)."""

    output: Any  # the SchedulerOutput of the step
    iteration: int
    end_of_schedule_s: float
    predicted_s: float  # a skipped step's only under async scheduling (else measured)
    results: tuple[ChunkResult, ...]
    skipped: tuple[bool, bool] | None  # None: planned by the hook; else skipped (_fastpath.can_skip): (decode_only, routed)


class _Port:
    """The hook's :class:`~shadowcore.hook.EnginePort` on a vLLM scheduler."""

    def __init__(self, scheduler: ShadowSchedulerMixin) -> None:
        self._scheduler = scheduler
        self.block_size = scheduler.block_size

    def cached_prefix_tokens(self, history: SessionHistory) -> int:
        entry = self._scheduler.shadow_jobs.entry_for_history(history)
        return 0 if entry is None else self._scheduler.shadow_cached_tokens(entry.request)

    def eviction_count(self) -> int:
        return self._scheduler.shadow_bridge.eviction_count


class _NoCluster:
    """The router side lives in the gateway; the engine builds no placements."""

    def instances(self, model: str) -> list[str]:
        return []


class ShadowSchedulerMixin(SnapshotTranslation, ConnectorLoads):
    """Shadow prefill glue for a vLLM v1 ``Scheduler`` subclass (put it first)."""

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        vllm_internals.check_scheduler(self)
        config = EngineShadowConfig.from_vllm(vllm_config)
        runtime = build_runtime(config.shadow, _NoCluster(), ())
        #: Prefix caching off: a shadow's KV could never be reused, so this engine runs as vLLM's own
        #: scheduler with no shadow work (shadow requests end at once, ``no-shadow``; docs/vllm.md).
        self._shadow_no_cache = not self.cache_config.enable_prefix_caching
        if self._shadow_no_cache:
            logger.warning("prefix caching is off (--no-enable-prefix-caching): the shadow scheduler schedules "
                           "as vLLM's own and plans no shadow work; policy %r is not applied and shadow "
                           "requests end at once (stop reason %s)", runtime.policy.name, STOP_NO_SHADOW)
        self.shadow_config = config
        self.shadow_clock: Callable[[], float] = time.monotonic
        self.shadow_bridge = ShadowKVBridge(self.kv_cache_manager.block_pool, runtime.policy.kv,
                                            lambda: self.shadow_clock(), lazy=True)  # attached by the first shadow
        self.shadow_jobs = EngineJobs(config.instance_id, self.block_size)
        self._shadow_by_request = self.shadow_jobs.by_request  # truthy while a shadow request exists
        slack = self._shadow_build_slack(runtime, config, np.random.default_rng(runtime.rng.integers(2**63)))
        if self._shadow_no_cache:
            slack = NoShadowController()
        self.shadow_hook = EngineHook(config.instance_id, self.shadow_jobs, slack, config.build_latency(),
                                      _Port(self), runtime.observers)
        why = unreachable_grant(slack, self.shadow_hook.latency, self.block_size, config.slo.tpot_s)
        if why is not None:  # the policy would silently do nothing here: say so, with the numbers
            logger.warning("policy %r on %s: %s", runtime.policy.name, config.instance_id, why)
        #: The online latency refit (config ``refit``), an observer of the hook: every step is planned and measured.
        self.shadow_refit = None if self._shadow_no_cache else config.attach_refit(
            self.shadow_hook, isinstance(self, AsyncScheduler))
        self.shadow_stats = ShadowStats()
        self.shadow_metrics = EngineMetrics.from_env(config.instance_id, self.block_size)  # vLLM's /metrics
        self.shadow_parked: dict[str, Request] = {}  # shadow requests outside vLLM's queues
        self.shadow_to_finish: dict[str, tuple[RequestStatus, str]] = {}
        #: A KV connector's ``kv_transfer_params`` of shadows this step ends (P/D: the handle a decode
        #: engine reads the shadow's KV with), put in their outputs.
        self.shadow_kv_params: dict[str, dict] = {}
        self.shadow_routed: set[str] = set()
        self.shadow_running: set[str] = set()  # shadow requests admitted in the current step
        self.shadow_arrival_s: dict[str, float] = {}
        self.shadow_first_token_s: dict[str, float] = {}
        self._shadow_awaiting_first: set[str] = set()  # normal and routed requests without a token yet
        self._shadow_iteration = 0
        self._shadow_step: _OpenStep | None = None
        #: A step of the quiet path (below) not yet reported: (output, end of schedule, predicted s, decode-only)
        self._shadow_skipped: tuple[Any, float, float, tuple[bool, bool]] | None = None
        self._shadow_defer_meta = False  # during super().schedule() of a step that may admit shadow chunks
        self._shadow_deferred_meta: tuple[Any, Any] | None = None  # (connector, its block state) until built
        self._shadow_observers = self.shadow_hook.observers.observers  # the list can_skip reads (may grow)
        self._shadow_quiet = self._shadow_quiet_now()
        self._shadow_never_runs = isinstance(slack, NoShadowController)
        self._shadow_async = isinstance(self, AsyncScheduler)
        self._shadow_prefill_flag = True  # vLLM's Request.is_prefill_chunk exists (checked on first use)
        #: Shadows whose asynchronous connector load is in flight (parked, holding its blocks).
        self.shadow_loading: dict[str, _ShadowLoad] = {}
        self._shadow_sync_loaded: list[ShadowEntry] = []  # sync loads of the open step (adopted at its close)
        self._shadow_chunk_end: dict[str, int] = {}  # with a connector: where each shadow's last chunk ended
        if runtime.policy.kv.host is not None and self.connector is None:
            logger.warning("policy %r has a host tier, which on vLLM needs a KV offloading connector "
                           "(--kv-offloading-size, OffloadingConnector); this engine has none, so shadows "
                           "use the device tier only (see docs/vllm.md: host tier)", runtime.policy.name)

    def _shadow_build_slack(self, runtime: Any, config: EngineShadowConfig, rng: np.random.Generator) -> Any:
        """This engine's slack controller: the policy's ``slack`` (a P/D prefill engine,
        :class:`shadow_vllm.pd.PrefillShadowScheduler`, builds its ``prefill_slack``)."""
        return runtime.policy.slack.build(rng)

    # -- requests ----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        super().add_request(request)
        rid = request.request_id
        if self.requests.get(rid) is not request:
            return  # a streaming update of a request it already has
        self.shadow_arrival_s[rid] = self.shadow_clock()
        params = request.sampling_params
        try:
            tag = parse_tag(params.extra_args if params is not None else None)
        except ValueError as e:
            logger.error("request %s: bad shadowprefill tag: %s", rid, e)
            self._shadow_park(request)
            self.shadow_to_finish[rid] = (RequestStatus.FINISHED_ERROR, f"shadowprefill: {e}")
            self.shadow_stats.num_rejected += 1
            self._shadow_quiet = False
            return
        if tag is None or tag.kind is TagKind.ROUTED:
            if tag is not None:
                self.shadow_routed.add(rid)
                self.shadow_jobs.forget_session(tag.session_id)
            self._shadow_awaiting_first.add(rid)
            return
        self._shadow_quiet = False
        self._shadow_open(request, tag)

    def _shadow_open(self, request: Request, tag: ShadowTag) -> None:
        if self._shadow_no_cache:  # answered at the next step, never scheduled
            self._shadow_park(request)
            self.shadow_to_finish[request.request_id] = (RequestStatus.FINISHED_STOPPED, STOP_NO_SHADOW)
            return
        self.shadow_bridge.attach()  # the KV classes matter from the first shadow on (vLLM's own pool until then)
        self._shadow_park(request)
        rid = request.request_id
        if not self.kv_cache_manager.prefix_cache_lookup_enabled(request):
            reason = ShadowStop(ShadowEnd.REJECTED, None, "a shadow request must read the prefix cache "
                                                          "(no prompt logprobs)").to_stop_reason()
            self.shadow_to_finish[rid] = (RequestStatus.FINISHED_ERROR, reason)
            self.shadow_stats.num_rejected += 1
            return
        num_blocks = request.num_prompt_tokens // self.block_size
        if num_blocks > self.shadow_bridge.cap_blocks:
            reason = ShadowStop(ShadowEnd.OVER_CAP, None,
                                f"{num_blocks} blocks > cap {self.shadow_bridge.cap_blocks}").to_stop_reason()
            self.shadow_to_finish[rid] = (RequestStatus.FINISHED_ABORTED, reason)
            self.shadow_stats.num_rejected += 1
            return
        entry, old = self.shadow_jobs.open(request, tag)
        if old is not None:
            self.shadow_to_finish[old.request_id] = (RequestStatus.FINISHED_ABORTED, STOP_SUPERSEDED)
            self.shadow_stats.num_superseded += 1
        entry.job.refresh(self.shadow_cached_tokens(request), self.shadow_bridge.eviction_count)

    def _shadow_park(self, request: Request) -> None:
        """Take ``request`` out of vLLM's queues (it is scheduled only by the plan)."""
        self.waiting.remove_requests((request,))
        self.kv_holding_waiting.remove_requests((request,))
        self.deferred_waiting.discard(request)
        self.shadow_parked[request.request_id] = request

    def shadow_cached_tokens(self, request: Request) -> int:
        """Prefix of ``request`` in the prefix cache now, as vLLM's admission sees it."""
        return int(self.kv_cache_manager.get_computed_blocks(request)[1])

    def get_num_unfinished_requests(self) -> int:
        return super().get_num_unfinished_requests() + len(self.shadow_parked)

    def _free_request(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        rid = request.request_id
        was_shadow = rid in self.shadow_jobs
        self.shadow_jobs.close(rid)
        self.shadow_parked.pop(rid, None)
        self.shadow_to_finish.pop(rid, None)
        self.shadow_routed.discard(rid)
        self.shadow_running.discard(rid)
        self.shadow_arrival_s.pop(rid, None)
        self.shadow_first_token_s.pop(rid, None)
        self._shadow_awaiting_first.discard(rid)
        self._shadow_chunk_end.pop(rid, None)
        freed = super()._free_request(request, *args, **kwargs)
        if was_shadow and isinstance(freed, tuple) and freed and freed[0] is not None:
            self.shadow_kv_params[rid] = freed[0]  # a P/D connector's handle, for the shadow's output
        if not self._shadow_quiet:
            self._shadow_quiet = self._shadow_quiet_now()
        return freed

    # -- one step ----------------------------------------------------------------------
    # Quiet path: while the engine holds no shadow request (none parked, running or
    # to finish), no planned step is open and the hook can skip with no job
    # (_fastpath.can_skip: no observer, a skippable controller), begin_step would
    # plan nothing and change nothing but what skip_step does. ``_shadow_quiet``
    # says so (kept up to date where shadows come and go and where a planned step
    # ends; the observer list is read every step, as observers may be added any
    # time); such a step costs one test, the decode-only test (the controller's
    # credit), two clock reads and skip_step: no snapshot, no plan, no step record.
    def _shadow_quiet_now(self) -> bool:
        return not (self._shadow_by_request or self.shadow_parked or self.shadow_to_finish or self.shadow_running
                    or self._shadow_step is not None) and _fastpath.can_skip(self.shadow_hook)

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        if self._shadow_quiet and not self._shadow_observers:
            if self._shadow_skipped is not None:  # async scheduling: the previous step is still running
                self._shadow_close_skipped(measured=False)
            out = super().schedule(*args, **kwargs)
            self._shadow_iteration += 1
            _fastpath.count_skipped(self.shadow_hook)
            predicted_s, skipped = self._shadow_skip_shape(out)
            self._shadow_skipped = (out, self.shadow_clock(), predicted_s, skipped)
            return out
        return self._shadow_schedule(*args, **kwargs)

    def _shadow_schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        """``schedule()`` while shadows exist (or may: a step is planned whenever the hook cannot skip)."""
        if self._shadow_skipped is not None:
            self._shadow_close_skipped(measured=False)
        if self._shadow_step is not None:  # async scheduling: the previous step is still running
            self._shadow_close_step(measured=False)
        now_s = self.shadow_clock()
        if self.shadow_running:
            self._shadow_release_running()
        self._shadow_defer_meta = self.connector is not None
        try:
            out = super().schedule(*args, **kwargs)
        finally:
            self._shadow_defer_meta = False
        try:
            return self._shadow_plan_step(out, now_s)
        finally:
            if self._shadow_deferred_meta is not None:
                self._shadow_build_connector_meta(out)

    def _shadow_skip_shape(self, out: SchedulerOutput) -> tuple[float, tuple[bool, bool]]:
        """(predicted duration, (decode-only, routed)) of a step the hook skips. Under async
        scheduling the step is reported at the next ``schedule()``, when its
        requests have moved on, so its duration is predicted from its batch now;
        otherwise it is measured (0.0 here) and only the decode-only test is needed
        (and, for a decode-only step, whether it carries a routed call: the credit's)."""
        if self._shadow_async:
            shape = self._shadow_batch_shape(out)
            predicted_s, decode_only = self.shadow_hook.latency.predict_s(shape), shape.is_decode_only
        else:
            predicted_s, decode_only = 0.0, self._shadow_decode_only(out)
        scheduled = out.num_scheduled_tokens
        return predicted_s, (decode_only, decode_only and any(rid in scheduled for rid in self.shadow_routed))

    def _shadow_plan_step(self, out: SchedulerOutput, now_s: float) -> SchedulerOutput:
        """Plan (or skip) the step vLLM has scheduled as ``out`` and admit the plan's chunks into it."""
        iteration = self._shadow_iteration
        self._shadow_iteration = iteration + 1
        if not self._shadow_by_request and _fastpath.can_skip(self.shadow_hook):
            _fastpath.count_skipped(self.shadow_hook)
            predicted_s, skipped = self._shadow_skip_shape(out)
            self._shadow_step = _OpenStep(out, iteration, self.shadow_clock(), predicted_s, (), skipped)
            return out
        snapshot = self._shadow_snapshot(out, now_s, iteration)
        plan = self.shadow_hook.begin_step(snapshot)
        results = self._shadow_admit(out, plan, now_s) if plan.grants else ()
        stats = self.shadow_stats
        stats.max_shadow_blocks = max(stats.max_shadow_blocks, self.shadow_bridge.num_shadow_blocks)
        stats.num_planned_tokens += sum(g.num_tokens for g in plan.grants)
        self._shadow_step = _OpenStep(out, iteration, self.shadow_clock(), plan.predicted_s, results, None)
        if self._shadow_observers:  # the backend contract's on_batch
            self.shadow_hook.observers.emit("on_batch", self._shadow_batch_report(out, iteration))
        return out

    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output: Any) -> Any:
        skipped = self._shadow_skipped
        if skipped is not None and skipped[0] is scheduler_output:  # _shadow_close_skipped(measured=True), inline
            self._shadow_skipped = None
            _fastpath.skip_step(self.shadow_hook, max(0.0, self.shadow_clock() - skipped[1]), *skipped[3])
        else:
            step = self._shadow_step
            if step is not None and step.output is scheduler_output:
                self._shadow_close_step(measured=True)
        if self._shadow_by_request:  # a shadow's prefill may end in this step: it must not decode
            self._update_request_with_output = self._shadow_update_request_with_output
            try:
                outputs = super().update_from_output(scheduler_output, model_runner_output)
            finally:
                del self._update_request_with_output  # back to vLLM's method (no per-request cost)
        else:
            outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self.shadow_loading:
            self._shadow_finish_loads()
        if self._shadow_awaiting_first:
            self._shadow_record_first_tokens(scheduler_output.num_scheduled_tokens)
        if self._shadow_by_request or self.shadow_to_finish:
            self._shadow_finish(outputs)
        if self.shadow_kv_params:  # those vLLM's own path finished carry them in vLLM's outputs
            self.shadow_kv_params.clear()
        if not self._shadow_quiet:
            self._shadow_quiet = self._shadow_quiet_now()
        if self.shadow_metrics is not None:
            self.shadow_metrics.sync(self.shadow_stats, self.shadow_bridge)
        return outputs

    def _shadow_update_request_with_output(self, request: Request, new_token_ids: list[int], *args: Any,
                                           **kwargs: Any) -> tuple[list[int], bool]:
        """vLLM's ``_update_request_with_output`` while shadow requests exist
        (an instance attribute during ``update_from_output``): a shadow whose
        prefill is done stops (:data:`STOP_PREFILLED`); it never decodes."""
        new_token_ids, stopped = super()._update_request_with_output(request, new_token_ids, *args, **kwargs)
        if request.request_id in self.shadow_jobs:
            if not stopped:
                request.status = RequestStatus.FINISHED_STOPPED
                stopped = True
            if request.stop_reason is None:
                request.stop_reason = STOP_PREFILLED
            end, ended = _end_name(request.stop_reason), self.shadow_stats.num_ended
            ended[end] = ended.get(end, 0) + 1
        return new_token_ids, stopped

    def _shadow_record_first_tokens(self, scheduled: dict[str, int]) -> None:
        """f_r of Eq. 1: the clock after the update that gave a request (one
        scheduled in the step) its first token."""
        awaiting, requests = self._shadow_awaiting_first, self.requests
        candidates = [rid for rid in awaiting if rid in scheduled] if len(awaiting) < len(scheduled) else \
            [rid for rid in scheduled if rid in awaiting]
        now_s = None
        for rid in candidates:
            request = requests.get(rid)
            if request is not None and request.num_output_tokens > 0:
                if now_s is None:
                    now_s = self.shadow_clock()
                self.shadow_first_token_s[rid] = now_s
                awaiting.discard(rid)

    def _shadow_close_skipped(self, measured: bool) -> None:
        """Report the quiet path's open step (``skip_step``), measured or predicted as ``_shadow_close_step``."""
        _, end_of_schedule_s, predicted_s, skipped = self._shadow_skipped
        self._shadow_skipped = None
        duration_s = self.shadow_clock() - end_of_schedule_s if measured else predicted_s
        _fastpath.skip_step(self.shadow_hook, max(0.0, duration_s), *skipped)

    def _shadow_close_step(self, measured: bool) -> None:
        step = self._shadow_step
        assert step is not None
        self._shadow_step = None
        duration_s = self.shadow_clock() - step.end_of_schedule_s if measured else step.predicted_s
        if step.skipped is not None:
            _fastpath.skip_step(self.shadow_hook, max(0.0, duration_s), *step.skipped)
            return
        self.shadow_hook.end_step(StepOutcome(self.shadow_config.instance_id, step.iteration,
                                              max(0.0, duration_s), step.results))
        if self._shadow_sync_loaded or self.shadow_loading:
            self._shadow_adopt_loads()

    def _shadow_release_running(self) -> None:
        """Every shadow in ``running`` goes back to the parking (blocks freed, cached)."""
        if not self.shadow_running:
            return
        ids, self.shadow_running = self.shadow_running, set()
        shadows = [r for r in self.running if r.request_id in ids]
        self.running = [r for r in self.running if r.request_id not in ids]
        timestamp = time.monotonic()
        for request in shadows:
            self._preempt_request(request, timestamp)
            request.num_preemptions -= 1  # a chunk boundary, not a preemption of vLLM's
            if request.events and request.events[-1].type == EngineCoreEventType.PREEMPTED:
                request.events.pop()
            self._shadow_park(request)

    # -- admitting the plan ------------------------------------------------------------
    def _shadow_admit(self, out: SchedulerOutput, plan: StepPlan, now_s: float) -> tuple[ChunkResult, ...]:
        results = []
        admitted: dict[str, int] = {}
        for grant in plan.grants:
            entry = self.shadow_jobs.entry_for_key(grant.job)
            n = 0 if entry is None else self._shadow_admit_one(out, entry, grant, now_s)
            results.append(ChunkResult(grant, n))
            if n:
                admitted[entry.request_id] = n
            elif entry is None or not self._shadow_load_began(entry):
                self.shadow_stats.num_dropped_chunks += 1
        if admitted:
            out.num_scheduled_tokens.update(admitted)
            out.total_num_scheduled_tokens += sum(admitted.values())
            if not self.use_v2_model_runner:
                self.prev_step_scheduled_req_ids.update(admitted)
            zero = self._get_new_block_ids_to_zero()
            if zero:
                out.new_block_ids_to_zero = (out.new_block_ids_to_zero or []) + zero
            self._update_after_schedule(dataclasses.replace(out, num_scheduled_tokens=admitted))
            self.shadow_stats.num_chunks += len(admitted)
            self.shadow_stats.num_shadow_tokens += sum(admitted.values())
        return tuple(results)

    def _shadow_admit_one(self, out: SchedulerOutput, entry: ShadowEntry, grant: Any, now_s: float) -> int:
        """Admit one granted chunk from the prefix cache and a connector's external hit; the tokens it
        computes this step, or 0 (dropped, or an asynchronous load started)."""
        request = entry.request
        rid = request.request_id
        if rid in self.shadow_to_finish or rid not in self.shadow_parked or rid in self.shadow_loading:
            return 0
        if len(self.running) >= self.max_num_running_reqs:
            return 0
        blocks, num_hit, _ = self.kv_cache_manager.get_computed_blocks(request)
        if num_hit != grant.start_token:  # the cache changed under the plan: re-read it next step
            entry.job.validated_at = None
            return 0
        num_external, load_async = 0, False
        connector = self.connector
        # Asked as vLLM's admission of a waiting request (block-aligned local hit), unless the shadow
        # goes on where its own last chunk ended: that is a running request's next chunk, for which
        # vLLM asks no connector (and the OffloadingConnector would answer "not yet" while the last
        # chunk's stores are in flight).
        asked = connector is not None and self._shadow_chunk_end.get(rid) != num_hit
        if asked:
            hit = self._shadow_external_hit(connector, request, num_hit, bool(out.num_scheduled_tokens))
            if hit is None:
                return 0
            num_external, load_async = hit
        if load_async:
            self._shadow_start_load(out, entry, blocks, num_hit, num_external, now_s)
            return 0
        num_computed = num_hit + num_external
        num_tokens = self._shadow_tokens_after_load(entry, grant, num_computed) if num_external else grant.num_tokens
        with self.shadow_bridge.shadow_allocation(now_s, (b for group in blocks.blocks for b in group)):
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_tokens, num_new_computed_tokens=num_hit, new_computed_blocks=blocks,
                num_lookahead_tokens=self.num_lookahead_tokens, num_external_computed_tokens=num_external,
            )
        if new_blocks is None:
            return 0
        if asked:
            connector.update_state_after_alloc(request, self.kv_cache_manager.get_blocks(rid), num_external)
        if num_external:  # a sync load: the worker loads it in this step's forward pass, before the chunk
            self._shadow_sync_loaded.append(entry)
            self.shadow_stats.num_loads += 1
            self.shadow_stats.num_loaded_tokens += num_external
        resumed = request.status == RequestStatus.PREEMPTED
        del self.shadow_parked[rid]
        self.shadow_running.add(rid)
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed
        if connector is not None:
            self._shadow_chunk_end[rid] = num_computed + num_tokens
        all_blocks = self.kv_cache_manager.get_blocks(rid)
        if self.use_v2_model_runner or not resumed:
            prefill = request._all_token_ids if self.use_v2_model_runner else None
            out.scheduled_new_reqs.append(NewRequestData.from_request(
                request, all_blocks.get_block_ids(), prefill, uses_mrope=self.model_uses_mrope))
        else:
            cached = self._make_cached_request_data([], [request], {rid: num_tokens}, {}, {rid: all_blocks})
            _extend_dataclass(out.scheduled_cached_reqs, cached)
        return num_tokens

    # -- finishing shadows -------------------------------------------------------------
    def _shadow_finish(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        """Finish shadows whose prefill is done, superseded ones and rejected ones."""
        idle = [e for e in self.shadow_jobs.entries() if e.job.num_inflight_tokens == 0]
        # Tails below n_min are never planned (the core defers them); with nothing
        # else pending no plan can ever take them, so such shadows are done too
        # (unless configured to keep them pending, as the simulator does).
        stuck = not self.shadow_config.keep_tails_below_n_min and \
            sum(e.job.num_missing_tokens for e in idle) < self.shadow_hook.slack.n_min
        for entry in idle:
            missing = entry.job.num_missing_tokens
            if missing == 0 or stuck or self._shadow_never_runs:
                reason = STOP_PREFILLED if missing == 0 else ShadowStop(
                    ShadowEnd.BELOW_N_MIN if stuck else ShadowEnd.NO_SHADOW, entry.job.num_held_tokens,
                ).to_stop_reason()
                self.shadow_to_finish.setdefault(entry.request_id, (RequestStatus.FINISHED_STOPPED, reason))
        if not self.shadow_to_finish:
            return
        todo, self.shadow_to_finish = self.shadow_to_finish, {}
        self.shadow_stats.num_finished += finish_shadows(self, todo, outputs, self.shadow_stats.num_ended,
                                                         self.shadow_kv_params)


def finish_shadows(scheduler: Any, todo: dict[str, tuple[RequestStatus, str]],
                   outputs: dict[int, EngineCoreOutputs], num_ended: dict[str, int],
                   kv_params: dict[str, dict] | None = None) -> int:
    """Finish the shadow requests of ``todo`` (request id -> (status, stop reason)) through vLLM's
    ``finish_requests``, each with an empty output carrying its stop reason (and its connector handle
    from ``kv_params``, popped) in ``outputs``; count each by its end in ``num_ended``. Requests gone or
    already finished are skipped. Returns how many finished with ``FINISHED_STOPPED``. The one finish
    path of both the shadow scheduler and the P/D decode side (:mod:`shadow_vllm.pd`)."""
    stopped = 0
    for rid, (status, reason) in todo.items():
        request = scheduler.requests.get(rid)
        if request is None or request.is_finished():
            continue
        request.stop_reason = reason
        end = _end_name(reason)
        num_ended[end] = num_ended.get(end, 0) + 1
        for finished in scheduler.finish_requests(rid, status):
            if status == RequestStatus.FINISHED_STOPPED:
                stopped += 1
            eco = outputs.setdefault(finished.client_index, EngineCoreOutputs(outputs=[]))
            eco.outputs.append(EngineCoreOutput(
                request_id=rid, new_token_ids=[], finish_reason=finished.get_finished_reason(),
                stop_reason=reason, events=finished.take_events(), trace_headers=finished.trace_headers,
                kv_transfer_params=None if kv_params is None else kv_params.pop(rid, None),
            ))
    return stopped


def _end_name(stop_reason: str) -> str:
    """The ``ShadowEnd`` value of a shadow's stop reason (``bad-tag`` for a malformed tag's error)."""
    try:
        stop = parse_stop(stop_reason)
    except ValueError:
        stop = None
    return stop.end.value if stop is not None else "bad-tag"


def _extend_dataclass(target: Any, extra: Any) -> None:
    """Append ``extra``'s list, dict and set fields to ``target``'s (same dataclass)."""
    for f in dataclasses.fields(target):
        mine, theirs = getattr(target, f.name), getattr(extra, f.name)
        if isinstance(mine, list):
            mine.extend(theirs)
        elif isinstance(mine, (dict, set)):
            mine.update(theirs)
        elif mine != theirs:
            raise TypeError(f"cannot merge field {f.name} of {type(target).__name__}")


class ShadowScheduler(ShadowSchedulerMixin, Scheduler):
    """Shadow prefill on vLLM's synchronous ``Scheduler``."""


class AsyncShadowScheduler(ShadowSchedulerMixin, AsyncScheduler):
    """Shadow prefill on vLLM's ``AsyncScheduler`` (keeps async scheduling on)."""
