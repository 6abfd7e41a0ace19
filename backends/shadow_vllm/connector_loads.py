"""KV connectors (offloading, P/D) under the shadow scheduler: connector
metadata over shadow chunks, and shadows that load a connector's external hit.

:class:`ConnectorLoads` is mixed into
:class:`~shadow_vllm.scheduler.ShadowSchedulerMixin` (which admits a granted
chunk and calls in here where a connector is involved).

Invariants (``tests/vllm/test_connector.py``, ``test_offloading_*.py``):

* In a step that may admit shadow chunks, vLLM's connector metadata is built
  once, over the whole output with the shadow chunks, as vLLM builds it.
* The connector is asked for a shadow's external hit only at an admission, as
  vLLM's admission of a waiting request asks; an error or a "cannot tell yet"
  drops the chunk, nothing else.
* A synchronous load is taken only in a step with no normal or routed work;
  an asynchronous one computes nothing that step and parks the shadow, with
  its blocks, until vLLM reports the load finished.
* After a load the job adopts what the engine holds for the request, so the
  next plan starts where the prefix really ends; while an async load is in
  flight no plan grants the job.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from shadow_vllm.vllm_internals import Request, RequestStatus, SchedulerOutput
from shadowcore.engine_jobs import ShadowEntry

logger = logging.getLogger("shadow_vllm.scheduler")  # one logger for the scheduler's messages


class _ShadowLoad(NamedTuple):
    """A shadow's asynchronous connector load in flight."""

    entry: ShadowEntry
    prior_status: RequestStatus  # WAITING (never ran) or PREEMPTED (released before): restored when done
    iteration: int  # the step that started it


class ConnectorLoads:
    """Connector metadata and loads for shadow chunks (a mixin of the shadow scheduler)."""

    # vLLM builds a step's connector metadata near the end of schedule(), before
    # the step's requests count their scheduled tokens as computed; shadow chunks
    # are admitted after schedule(). In a step that may admit them, the build is
    # deferred (vLLM's own _build_kv_connector_meta seam) and done once over the
    # whole output, shadow chunks included, with every scheduled request's
    # num_computed_tokens as vLLM's build sees it: a connector (an
    # OffloadingConnector storing blocks to host memory) sees the shadow's
    # blocks like any request's.
    #
    # Loads. A shadow admission asks the connector for its hit beyond the local
    # one and tells it of the allocation, as vLLM's admission of a waiting
    # request does (get_num_new_matched_tokens, allocate_slots with
    # num_external_computed_tokens, update_state_after_alloc), and nowhere else:
    # the question has side effects in some connectors (the OffloadingConnector
    # resets the request's block list and hit counts), so the port never asks
    # it. Hence the core plans from the device prefix cache only
    # (EnginePort.cached_prefix_tokens reads vLLM's get_computed_blocks): a
    # grant starts at the local hit, and what the connector adds is learnt at
    # the admission. After a load the job adopts what the engine holds for the
    # request (job.refresh with its computed tokens, or the port's prefix-cache
    # reading if longer): at the close of the step for a sync load (vLLM cached
    # the loaded and computed blocks at allocation), when vLLM reports the load
    # finished for an async one. So the next plan
    # starts where the prefix really ends and no step is lost to a "cache
    # changed under the plan" drop; ChunkResult keeps reporting only computed
    # tokens (loaded ones cost the step nothing). While an async load is in
    # flight all the job misses counts as in flight, so no plan grants it.
    # A connector that reports invalid blocks for a shadow's async load is not
    # handled (vLLM scans its own queues for those; the OffloadingConnector
    # reports none).
    def _build_kv_connector_meta(self, connector: Any, scheduler_output: SchedulerOutput) -> Any:
        if not self._shadow_defer_meta:
            return super()._build_kv_connector_meta(connector, scheduler_output)
        self._shadow_deferred_meta = (connector, getattr(scheduler_output, "kv_connector_block_state", None))
        return None

    def _shadow_build_connector_meta(self, out: SchedulerOutput) -> None:
        connector, block_state = self._shadow_deferred_meta
        self._shadow_deferred_meta = None
        requests, scheduled = self.requests, out.num_scheduled_tokens
        if block_state is not None:
            block_state.req_ids.update(scheduled)
            out.kv_connector_block_state = block_state
        for rid, n in scheduled.items():  # as at vLLM's build: before _update_after_schedule
            requests[rid].num_computed_tokens -= n
        try:
            out.kv_connector_metadata = super()._build_kv_connector_meta(connector, out)
        finally:
            for rid, n in scheduled.items():
                requests[rid].num_computed_tokens += n
            if block_state is not None:
                out.kv_connector_block_state = None  # connector-only state is not sent to workers (as vLLM)

    def _shadow_external_hit(self, connector: Any, request: Request, num_hit: int,
                             batch_busy: bool) -> tuple[int, bool] | None:
        """(tokens, asynchronous) the connector holds beyond ``num_hit``, asked as vLLM's admission asks
        (the call has side effects in some connectors: only here, at an admission); None drops the
        chunk: the connector cannot tell yet, failed, or answered out of range. A synchronous hit in a
        step with normal or routed work is not taken (the load would run inside their forward pass):
        the shadow computes on the device as without a connector."""
        try:
            num_external, load_async = connector.get_num_new_matched_tokens(request, num_hit)
        except Exception:
            logger.exception("shadow %s: the KV connector failed; chunk dropped", request.request_id)
            return None
        if num_external is None:
            return None
        if request.skip_reading_prefix_cache or num_external == 0:
            return 0, False
        if not 0 < num_external < request.num_tokens - num_hit:
            logger.error("shadow %s: the KV connector reported %r tokens beyond %d of %d; chunk dropped",
                         request.request_id, num_external, num_hit, request.num_tokens)
            return None
        if not load_async and batch_busy:
            return 0, False
        return int(num_external), bool(load_async)

    def _shadow_tokens_after_load(self, entry: ShadowEntry, grant: Any, num_computed: int) -> int:
        """A chunk's compute after a sync load brought the prefix to ``num_computed``: the grant's
        size, capped at the full-block tokens the job still misses, and at least one token (a load
        rides on a forward pass of the request)."""
        missing = entry.job.num_target_tokens - num_computed
        return max(1, min(grant.num_tokens, missing, entry.request.num_tokens - num_computed))

    def _shadow_start_load(self, out: SchedulerOutput, entry: ShadowEntry, blocks: Any, num_hit: int,
                           num_external: int, now_s: float) -> None:
        """Start an asynchronous load as vLLM's admission does (blocks allocated now, cached only
        when the load finishes, no compute this step); the shadow stays parked, holding them."""
        request, connector = entry.request, self.connector
        rid = request.request_id
        with self.shadow_bridge.shadow_allocation(now_s, (b for group in blocks.blocks for b in group)):
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, 0, num_new_computed_tokens=num_hit, new_computed_blocks=blocks,
                num_external_computed_tokens=num_external, delay_cache_blocks=True,
                skip_zeroing_group_ids=connector.get_loaded_kv_cache_group_ids(request),
            )
        if new_blocks is None:
            return
        connector.update_state_after_alloc(request, self.kv_cache_manager.get_blocks(rid), num_external)
        self.shadow_loading[rid] = _ShadowLoad(entry, request.status, self._shadow_iteration - 1)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_computed_tokens = num_hit + num_external  # as vLLM: what the load will have made computed
        zero = self._get_new_block_ids_to_zero()
        if zero:
            out.new_block_ids_to_zero = (out.new_block_ids_to_zero or []) + zero
        self.shadow_stats.num_loads += 1
        self.shadow_stats.num_loaded_tokens += num_external

    def _shadow_load_began(self, entry: ShadowEntry) -> bool:
        """Whether ``entry``'s chunk started an asynchronous load in the step being planned."""
        load = self.shadow_loading.get(entry.request_id)
        return load is not None and load.iteration == self._shadow_iteration - 1

    def _shadow_adopt_loads(self) -> None:
        """After a step's outcome is committed (``end_step``): a job whose chunk loaded synchronously
        adopts what the engine holds now (loaded and computed blocks: vLLM cached them at
        allocation); a job whose asynchronous load is in flight stays out of plans (all it misses
        counts as in flight) until the load finishes."""
        loaded, self._shadow_sync_loaded = self._shadow_sync_loaded, []
        for entry in loaded:
            if entry.request_id in self.shadow_jobs:
                self._shadow_adopt(entry)
        for load in self.shadow_loading.values():
            job = load.entry.job
            job.num_inflight_tokens = max(job.num_inflight_tokens, job.num_target_tokens - job.num_held_tokens)

    def _shadow_finish_loads(self) -> None:
        """Shadows whose asynchronous load finished (vLLM's ``finished_recving_kv_req_ids``, after
        ``update_from_output``): the loaded blocks are cached by vLLM's own
        ``_update_waiting_for_remote_kv`` (a failed load caches its valid prefix only) and released
        like any chunk's; the job adopts what the load brought."""
        for rid, load in list(self.shadow_loading.items()):
            request = load.entry.request
            if request.is_finished():  # ended during its load: vLLM frees the blocks when the load ends
                del self.shadow_loading[rid]
                continue
            if rid not in self.finished_recving_kv_req_ids:
                continue
            del self.shadow_loading[rid]
            self._update_waiting_for_remote_kv(request)
            self._shadow_chunk_end[rid] = request.num_computed_tokens  # the next chunk goes on from here
            load.entry.job.num_inflight_tokens = 0
            self._shadow_adopt(load.entry)
            self._free_request_blocks(request)
            request.num_computed_tokens = 0
            request.status = load.prior_status

    def _shadow_adopt(self, entry: ShadowEntry) -> None:
        """The job's held prefix after a load: what the engine holds for the request (its computed
        tokens; the prefix cache's reading when that is longer), block-aligned by ``job.refresh``."""
        request = entry.request
        held = max(self.shadow_cached_tokens(request), request.num_computed_tokens)
        entry.job.refresh(held, self.shadow_bridge.eviction_count)
