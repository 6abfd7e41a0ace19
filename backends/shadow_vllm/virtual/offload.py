"""The worker side of vLLM's ``OffloadingConnector`` on the virtual clock
(:class:`OffloadTransferWorker`): fake in its data movement only.

Invariants: it reports, as done, only the jobs the connector's metadata lists,
when the bandwidth says; every scheduling decision stays vLLM's and the
connector's.
"""

from __future__ import annotations

from typing import Any

import attrs


@attrs.define(eq=False)
class OffloadTransferWorker:
    """The worker side of vLLM's ``OffloadingConnector``, fake only in its data movement (no device,
    no host buffer): it runs the store and load jobs of each step's connector metadata on the
    virtual clock and reports them back as ``OffloadingConnectorWorker`` does, so every scheduling
    decision stays vLLM's and the connector's.

    Timing follows the real worker: a step's loads start when the step starts
    (``start_kv_transfers``); its stores are queued at its end (``prepare_store_kv``) and start
    when the next step starts; ``jobs_to_flush`` (a preempted request's or a reused block's stores)
    are started and waited for at the step's start (``handle_preemptions``; the step is longer by
    the wait). A job takes its blocks'
    bytes over ``bytes_per_s`` (None: no time), one job at a time per direction. A step reports
    (``KVConnectorOutput``: ``kv_connector_worker_meta.completed_jobs``, the loaded requests in
    ``finished_recving``, transfer stats) every job done by its end.
    """

    bytes_per_block: int
    bytes_per_s: float | None = None
    num_loaded_blocks: int = 0
    num_stored_blocks: int = 0
    #: Every job started: (job id, the loading request or None for a store, blocks, start s, done s).
    transfers: list[tuple[int, str | None, int, float, float]] = attrs.Factory(list)
    _unsubmitted: list[tuple[int, int]] = attrs.Factory(list)  # (job id, blocks): stores of the last step
    _inflight: list[tuple[float, int, str | None, int]] = attrs.Factory(list)  # (done s, job, load's request, blocks)
    _link_free_s: dict[bool, float] = attrs.Factory(lambda: {True: 0.0, False: 0.0})  # per direction (is_load)

    def transfer_s(self, num_blocks: int) -> float:
        """Seconds one job of ``num_blocks`` takes on the link (0.0 without a bandwidth)."""
        return 0.0 if self.bytes_per_s is None else num_blocks * self.bytes_per_block / self.bytes_per_s

    def _submit(self, job_id: int, num_blocks: int, request_id: str | None, now_s: float) -> float:
        is_load = request_id is not None
        duration = self.transfer_s(num_blocks)
        start = max(now_s, self._link_free_s[is_load])
        done = start + duration
        self._link_free_s[is_load] = done
        self.transfers.append((job_id, request_id, num_blocks, start, done))
        self._inflight.append((done, job_id, request_id, num_blocks))
        return done

    def begin_step(self, meta: Any, now_s: float) -> float:
        """What the worker does before the step's forward pass; the seconds it stalls the step
        (waiting for the jobs to flush)."""
        flush = set(meta.jobs_to_flush or ()) if meta is not None else set()
        if flush:
            for job_id in flush:
                job = meta.store_jobs.pop(job_id, None)
                if job is not None:
                    self._unsubmitted.append((job_id, len(job.src_spec.block_ids)))
        for job_id, num_blocks in self._unsubmitted:
            self._submit(job_id, num_blocks, None, now_s)
        self._unsubmitted.clear()
        stall_s = 0.0
        if flush:  # the worker waits for them before the forward pass
            stall_s = max((done - now_s for done, job_id, *_ in self._inflight if job_id in flush), default=0.0)
        if meta is not None:
            for job_id, job in meta.load_jobs.items():
                self._submit(job_id, len(job.dst_spec.block_ids), job.req_id, now_s)
        return max(0.0, stall_s)

    @property
    def has_queued_stores(self) -> bool:
        return bool(self._unsubmitted)

    def wait_s(self, now_s: float) -> float | None:
        """How long an engine with nothing to compute waits for the next job to finish (vLLM's
        engine core keeps stepping while the connector has work); None: no job in flight."""
        if not self._inflight:
            return None
        return max(0.0, min(done for done, *_ in self._inflight) - now_s)

    def end_step(self, meta: Any, now_s: float) -> Any:
        """What the worker reports after the step (``get_finished`` and the worker metadata)."""
        from shadow_vllm.vllm_internals import KVConnectorOutput, offloading

        _, OffloadingWorkerMetadata = offloading()

        if meta is not None:
            for job_id, job in meta.store_jobs.items():
                self._unsubmitted.append((job_id, len(job.src_spec.block_ids)))
        done = [t for t in self._inflight if t[0] <= now_s]
        if not done:
            return None
        self._inflight = [t for t in self._inflight if t[0] > now_s]
        worker_meta = OffloadingWorkerMetadata()
        finished_recving = set()
        for _, job_id, request_id, num_blocks in done:
            worker_meta.mark_completed(job_id)
            stats = worker_meta.transfer_stats.store if request_id is None else worker_meta.transfer_stats.load
            stats.record(num_blocks * self.bytes_per_block, self.transfer_s(num_blocks))
            if request_id is None:
                self.num_stored_blocks += num_blocks
            else:
                self.num_loaded_blocks += num_blocks
                finished_recving.add(request_id)
        return KVConnectorOutput(finished_sending=set(), finished_recving=finished_recving,
                                 kv_connector_worker_meta=worker_meta)

    @classmethod
    def for_scheduler(cls, scheduler: Any, bytes_per_s: float | None = None) -> OffloadTransferWorker | None:
        """The fake worker of ``scheduler``'s ``OffloadingConnector``; None without one."""
        from shadow_vllm.vllm_internals import offloading

        OffloadingConnector, _ = offloading()

        if not isinstance(getattr(scheduler, "connector", None), OffloadingConnector):
            return None
        (group,) = scheduler.kv_cache_config.kv_cache_groups
        return cls(group.kv_cache_spec.page_size_bytes * len(group.layer_names), bytes_per_s)
