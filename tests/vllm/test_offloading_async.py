"""Shadow loads from the host tier under async scheduling, in virtual time.

``tests/vllm/test_offloading_virtual.py`` checks the host tier (vLLM's real
``OffloadingConnector`` scheduler side, a fake transfer worker) on the
synchronous ``ShadowScheduler``. On GPUs vLLM's default is ``AsyncScheduler``:
the engine core's batch queue schedules a step while the previous one still
runs, so a load's completion (reported in the output of the step during which
it finished) reaches ``update_from_output`` after the next step was already
scheduled, and a shadow's chunk is released by the next ``schedule()`` before
its own output is in. Here the real ``AsyncShadowScheduler`` is driven that way
(:class:`PipelinedOffloadEngine`: two steps in flight, the device runs them in
order, the fake worker sees each step's connector metadata at the step's
start and reports at its end, as ``OffloadingConnectorWorker`` does), and the
assertions read what vLLM reports (scheduled batches, prefill stats, the
connector's load jobs, first tokens).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable

import pytest
from shadow_vllm import virtual
from shadow_vllm.engine_config import engine_args
from shadow_vllm.scheduler import AsyncShadowScheduler

from shadowcore.kv import KVClass
from shadowcore.latency import LinearLatencyModel
from shadowcore.wire import ShadowTag, TagKind

BLOCK = 16
BYTES_PER_BLOCK = 2 * 2 * 32 * 4 * BLOCK  # the virtual model's one layer group: (K, V) x 2 heads x 32 x fp32
IDLE_TICK_S = 0.001  # how far an idle engine's clock moves when it spins with nothing to wait for


class _Step:
    """One step in the batch queue: its output, batch, device times and (once it ran) connector output."""

    def __init__(self, out, batch: tuple[virtual.ScheduledRequest, ...], partial: dict[str, bool],
                 start_s: float, end_s: float) -> None:
        self.out, self.batch, self.partial = out, batch, partial
        self.start_s, self.end_s = start_s, end_s
        self.kv_output = None
        self.worker_done = False  # the fake worker's end_step ran for it
        self.num_scheduled_at_update = 0  # steps scheduled when its output reached update_from_output


class PipelinedOffloadEngine:
    """An ``AsyncShadowScheduler`` with an ``OffloadingConnector`` driven as vLLM's engine core
    drives it with a batch queue of two (``step_with_batch_queue``), on a virtual clock.

    The engine core schedules while the queue has room and requests remain, else waits for the
    oldest step and feeds its output to ``update_from_output``. The device runs the queued steps
    in order: a step starts at ``max(scheduled at, end of the previous step)``; the fake worker
    (:class:`shadow_vllm.virtual.OffloadTransferWorker`) starts a step's loads (and the stores of
    the previous one) at its start and reports the jobs done by its end in that step's
    ``kv_connector_output``. A step that computes nothing runs no forward pass (zero device time);
    when the engine spins twice at one instant with the device idle (vLLM's engine core keeps
    stepping while requests remain), the clock moves to the next transfer completion or arrival,
    or by :data:`IDLE_TICK_S`. Nothing here admits, frees or reorders anything: that is vLLM's
    and the scheduler's."""

    def __init__(self, scheduler, latency, bytes_per_s: float | None = None) -> None:
        self.scheduler = scheduler
        self.latency = latency
        self.clock = virtual.VirtualClock()
        scheduler.shadow_clock = self.clock
        self.hasher = virtual.block_hasher(scheduler.block_size)
        self.offload = virtual.OffloadTransferWorker.for_scheduler(scheduler, bytes_per_s)
        assert self.offload is not None
        self.inflight: deque[_Step] = deque()
        self.steps: list[_Step] = []
        self.requests: dict[str, virtual.VirtualRequest] = {}
        self._arrivals: list[tuple[float, int, Callable[[], None]]] = []  # (time, order added, action)
        self._arrival_seq = itertools.count()
        self._last_idle_spin_s: float | None = None
        self.num_overlapped = 0  # steps scheduled while an earlier computing step was still in the queue

    # -- requests -----------------------------------------------------------------------
    def add(self, request_id: str, prompt: list[int], max_tokens: int, extra_args: dict | None = None,
            **kwargs) -> virtual.VirtualRequest:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args)
        handle = virtual.VirtualRequest(request_id, tuple(prompt), self.clock.now_s, max_tokens, **kwargs)
        self.requests[request_id] = handle
        self.scheduler.add_request(Request(request_id, prompt, params, None, arrival_time=self.clock.now_s,
                                           block_hasher=self.hasher))
        return handle

    def at(self, time_s: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._arrivals, (time_s, next(self._arrival_seq), action))

    def cached_prefix_tokens(self, token_ids: list[int]) -> int:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        probe = Request("__probe__", [*token_ids, 0], SamplingParams(max_tokens=1), None, arrival_time=0.0,
                        block_hasher=self.hasher)
        return int(self.scheduler.kv_cache_manager.get_computed_blocks(probe)[1])

    # -- the batch queue ----------------------------------------------------------------
    def _schedule(self) -> _Step:
        out = self.scheduler.schedule()
        requests = self.scheduler.requests
        batch, partial = [], {}
        for rid, n in out.num_scheduled_tokens.items():
            request = requests[rid]
            context = request.num_computed_tokens - n  # schedule() already advanced it
            batch.append(virtual.ScheduledRequest(rid, n, context, context >= request.num_prompt_tokens))
            partial[rid] = request.is_prefill_chunk
        if self.inflight:
            self._run_worker_end(self.inflight[-1])  # the device ran it before this one starts
        start_s = max(self.clock.now_s, self.inflight[-1].end_s if self.inflight else 0.0)
        stall_s = self.offload.begin_step(out.kv_connector_metadata, start_s)
        computes = out.total_num_scheduled_tokens > 0
        duration_s = stall_s + (self.latency.predict_s(virtual.batch_shape(batch)) if computes else 0.0)
        step = _Step(out, tuple(batch), partial, start_s, start_s + duration_s)
        self.num_overlapped += computes and any(s.batch for s in self.inflight)
        self.inflight.append(step)
        self.steps.append(step)
        return step

    def _run_worker_end(self, step: _Step) -> None:
        if not step.worker_done:
            step.worker_done = True
            step.kv_output = self.offload.end_step(step.out.kv_connector_metadata, step.end_s)

    def _finish_oldest(self) -> None:
        from vllm.v1.outputs import ModelRunnerOutput

        step = self.inflight.popleft()
        self._run_worker_end(step)
        self.clock.now_s = max(self.clock.now_s, step.end_s)
        step.num_scheduled_at_update = len(self.steps)
        ids = [r.request_id for r in step.batch]
        sampled = [[] if step.partial[r.request_id] else [virtual.hashed_token(r.request_id, r.num_context_tokens)]
                   for r in step.batch]
        outputs = self.scheduler.update_from_output(step.out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled,
            kv_connector_output=step.kv_output))
        finished = []
        for eco in outputs.values():
            for out in eco.outputs:
                handle = self.requests.get(out.request_id)
                if handle is None:
                    continue
                if out.new_token_ids:
                    if handle.first_token_s is None:
                        handle.first_token_s = self.clock.now_s
                    handle.output_token_ids.extend(out.new_token_ids)
                if out.prefill_stats is not None and handle.prefill_stats is None:
                    handle.prefill_stats = out.prefill_stats
                    handle.num_cached_tokens = out.prefill_stats.num_cached_tokens
                if out.finish_reason is not None:
                    handle.finish_s, handle.finish_reason = self.clock.now_s, str(out.finish_reason)
                    finished.append(handle)
        for handle in finished:
            if handle.on_finish is not None:
                handle.on_finish(handle)

    def _idle_wait(self) -> None:
        """The device is idle and the engine spun twice at this instant: move to the next event."""
        now = self.clock.now_s
        candidates = [now + IDLE_TICK_S]
        wait_s = self.offload.wait_s(now)
        if wait_s is not None:
            candidates.append(now + wait_s)
        if self._arrivals:
            candidates.append(self._arrivals[0][0])
        self.clock.now_s = max(now, min(candidates))

    def run(self, limit: int = 50_000) -> None:
        for _ in range(limit):
            while self._arrivals and self._arrivals[0][0] <= self.clock.now_s:
                heapq.heappop(self._arrivals)[2]()
            if len(self.inflight) < 2 and self.scheduler.has_requests():
                step = self._schedule()
                if step.batch or any(s.batch for s in self.inflight):
                    continue
                while self.inflight:  # an empty step on an idle device: its output comes back at once
                    self._finish_oldest()
                if self._last_idle_spin_s == self.clock.now_s:
                    self._idle_wait()
                self._last_idle_spin_s = self.clock.now_s
                continue
            if self.inflight:
                self._finish_oldest()
                continue
            if not self._arrivals:
                return
            self.clock.now_s = max(self.clock.now_s, self._arrivals[0][0])
        raise RuntimeError("the pipelined engine did not drain")

    # -- reading the run ----------------------------------------------------------------
    def chunks(self, rid: str) -> list[tuple[int, int]]:
        """(scheduled tokens, context) of ``rid`` in every step vLLM scheduled it."""
        return [(r.num_scheduled_tokens, r.num_context_tokens) for s in self.steps for r in s.batch
                if r.request_id == rid]

    def steps_with(self, rid: str) -> list[_Step]:
        return [s for s in self.steps if any(r.request_id == rid for r in s.batch)]


def _engine(policy: str = "eager", bytes_per_s: float | None = None) -> PipelinedOffloadEngine:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    extra = engine_args(policy, asynchronous=True, slo={"ttft_s": 1.0, "tpot_s": 0.05})["additional_config"]
    config = virtual.VirtualEngineConfig(
        block_size=BLOCK, num_blocks=128, max_num_batched_tokens=256, additional_config=extra,
        kv_offloading_bytes=256 * BYTES_PER_BLOCK, kv_transfer_bytes_per_s=bytes_per_s)
    scheduler = virtual.build_scheduler(AsyncShadowScheduler, config)
    assert isinstance(scheduler, AsyncScheduler)
    assert type(scheduler.connector).__name__ == "OffloadingConnector"
    return PipelinedOffloadEngine(scheduler, LinearLatencyModel(), bytes_per_s)


def _tokens(n: int, salt: int) -> list[int]:
    return [7 + (i * 13 + salt * 101) % 997 for i in range(n)]


def _shadow_args(session: str) -> dict:
    return ShadowTag(TagKind.SHADOW, session, "m", 0, 0.9).to_extra_args()


def _prefill_then_evict(eng: PipelinedOffloadEngine, prompt: list[int], rid: str, session: str,
                        reset: bool = False) -> None:
    """A shadow prefills ``prompt`` on the device (its blocks stored to the host tier), then normal
    traffic evicts them from the device pool (or, with ``reset``, vLLM's prefix cache reset drops them)."""
    shadow = eng.add(rid, prompt, 1, _shadow_args(session))
    eng.run()
    assert eng.scheduler.requests.get(rid) is None and shadow.finish_reason is not None
    assert eng.chunks(rid) == [(256, 0), (len(prompt) - 256, 256)]  # computed on the device, two chunks
    assert eng.cached_prefix_tokens(prompt) == len(prompt)
    assert eng.offload.num_stored_blocks >= len(prompt) // BLOCK  # the connector stored them; the worker ran it
    if reset:  # every device block is free and hash-less: the later load allocates without evicting
        assert eng.scheduler.reset_prefix_cache()
        assert eng.cached_prefix_tokens(prompt) == 0
        return
    for k in range(14):  # 14 x 10 blocks of other prompts through a 127-block pool
        eng.add(f"n{session}{k}", _tokens(150, 50 + k), 2)
    eng.run()
    assert eng.cached_prefix_tokens(prompt) == 0  # gone from the device
    assert eng.scheduler.shadow_bridge.num_evicted_blocks[KVClass.SHADOW] >= len(prompt) // BLOCK


def test_the_pipelined_driver_overlaps_steps_and_runs_the_connectors_jobs() -> None:
    eng = _engine()
    _prefill_then_evict(eng, _tokens(320, 1), "sh1", "s")
    computing = [s for s in eng.steps if s.batch]
    assert eng.num_overlapped > len(computing) // 2  # most steps were scheduled while another ran
    assert all(a.end_s <= b.start_s for a, b in zip(eng.steps, eng.steps[1:], strict=False))  # in order
    assert eng.offload.transfers and not eng.scheduler.has_requests()


@pytest.mark.parametrize("bytes_per_s", [None, 1e7], ids=["instant", "16ms-load"])
def test_async_a_switch_call_loads_the_shadows_blocks_from_the_host_tier(bytes_per_s: float | None) -> None:
    eng = _engine(bytes_per_s=bytes_per_s)
    prompt = _tokens(320, 1)  # 20 blocks
    _prefill_then_evict(eng, prompt, "sh1", "s")
    loaded_before = eng.offload.num_loaded_blocks

    switch = eng.add("switch", [*prompt, *_tokens(40, 2)], 2, ShadowTag(TagKind.ROUTED, "s").to_extra_args())
    eng.run()
    stats = switch.prefill_stats  # vLLM's own breakdown of the call's prefill
    assert (stats.num_local_cached_tokens, stats.num_external_cached_tokens, stats.num_computed_tokens) == (0, 320, 40)
    assert switch.num_cached_tokens == 320
    assert eng.chunks("switch") == [(40, 320), (1, 360)]  # only the 40-token tail, after the load; one decode
    assert eng.offload.num_loaded_blocks - loaded_before == 20
    assert len(switch.output_token_ids) == 2 and switch.finish_reason == "length"
    if bytes_per_s is not None:  # its prefill came only after its load
        load = next(t for t in eng.offload.transfers if t[1] == "switch")
        assert eng.steps_with("switch")[0].start_s >= load[4]


def _resume(bytes_per_s: float, with_shadow: bool, routed_delay_s: float, reset: bool = False):
    """A shadow prefilled and evicted; six seconds later a normal request arrives with (or without)
    the session's shadow job resent with a longer context, and a routed call of another session
    arrives ``routed_delay_s`` later."""
    eng = _engine(bytes_per_s=bytes_per_s)
    first = _tokens(320, 3)
    _prefill_then_evict(eng, first, "q1", "t", reset)
    sched = eng.scheduler
    before = (sched.shadow_stats.num_chunks, sched.shadow_stats.num_dropped_chunks, len(eng.offload.transfers),
              len(eng.steps), sched.shadow_bridge.eviction_count)
    longer = [*first, *_tokens(160, 4)]
    held_at_finish: list[int] = []
    start_s = eng.clock.now_s + 6.0

    def arrive() -> None:
        eng.add("d", _tokens(40, 5), 12)
        if with_shadow:
            eng.add("q2", longer, 1, _shadow_args("t"),
                    on_finish=lambda r: held_at_finish.append(eng.cached_prefix_tokens(longer)))

    eng.at(start_s, arrive)
    eng.at(start_s + routed_delay_s, lambda: eng.add("r", _tokens(96, 6), 4,
                                                     ShadowTag(TagKind.ROUTED, "u").to_extra_args()))
    eng.run()
    return eng, before, held_at_finish


BYTES_PER_S = 1e7  # the 20-block load takes 16.4 ms of virtual time: several decode steps


@pytest.mark.parametrize("reset", [False, True], ids=["evicted", "cache-reset"])
def test_async_a_resumed_shadow_loads_its_host_prefix_and_computes_only_the_rest(reset: bool) -> None:
    eng, (num_chunks, num_dropped, num_transfers, _, evictions), held_at_finish = \
        _resume(BYTES_PER_S, True, 0.005, reset)
    sched, shadow = eng.scheduler, eng.requests["q2"]

    # One load job (vLLM's connector metadata) brought the shadow's 20 stored blocks back ...
    loads = [t for t in eng.offload.transfers[num_transfers:] if t[1] is not None]
    ((_, rid, num_blocks, load_start_s, load_done_s),) = loads
    assert (rid, num_blocks) == ("q2", 20)
    assert load_done_s - load_start_s == pytest.approx(20 * BYTES_PER_BLOCK / BYTES_PER_S)
    # ... and the shadow computed only the rest, after the load: one chunk from token 320.
    assert eng.chunks("q2") == [(160, 320)]
    (chunk_step,) = eng.steps_with("q2")
    assert chunk_step.start_s >= load_done_s
    stats = sched.shadow_stats
    assert (stats.num_loads, stats.num_loaded_tokens) == (1, 320)
    # The job learnt what the load brought: no chunk dropped, the next plan started at 320.
    assert (stats.num_chunks - num_chunks, stats.num_dropped_chunks - num_dropped) == (1, 0)
    assert shadow.finish_reason is not None
    assert not sched.shadow_loading and not sched.shadow_parked and not sched.shadow_running
    assert held_at_finish == [480]  # loaded and computed blocks stay cached on the device
    # The async ordering under test: the load ran across several pipelined steps of other work, and
    # the step that reported it finished had a later step scheduled before its output came back.
    assert len([s for s in eng.steps if s.batch and load_start_s <= s.start_s < load_done_s]) >= 3
    (reporting,) = [i for i, s in enumerate(eng.steps)
                    if s.kv_output is not None and "q2" in (s.kv_output.finished_recving or ())]
    assert eng.steps[reporting].num_scheduled_at_update > reporting + 1
    # No step lost to it: the chunk is in the first step scheduled after that output came back.
    assert eng.steps.index(chunk_step) == eng.steps[reporting].num_scheduled_at_update
    if reset:  # nothing was evicted meanwhile: the job learnt the load's prefix from the load itself
        assert sched.shadow_bridge.eviction_count == evictions


def test_async_a_shadows_load_delays_no_normal_or_routed_request() -> None:
    """Same arrivals with and without the shadow: until the shadow's own chunk (after its load)
    the normal request decodes and the routed call prefills in exactly the steps, at exactly the
    times, they have without it, and both get their first token at the same time."""
    eng, before, _ = _resume(BYTES_PER_S, True, 0.005)
    base, base_before, _ = _resume(BYTES_PER_S, False, 0.005)
    (_, _, num_transfers, num_steps, _), (_, _, _, base_num_steps, _) = before, base_before
    (*_, load_start_s, load_done_s) = next(t for t in eng.offload.transfers[num_transfers:] if t[1] == "q2")

    chunk_step = eng.steps_with("q2")[0]  # the shadow's first compute
    assert chunk_step.start_s >= load_done_s

    def timeline(e, first_step, rid):  # (start, tokens, context) of rid's steps before the shadow's chunk
        return [(round(s.start_s, 12), r.num_scheduled_tokens, r.num_context_tokens)
                for s in e.steps[first_step:] if s.start_s < chunk_step.start_s
                for r in s.batch if r.request_id == rid]

    for rid in ("d", "r"):
        assert len(timeline(eng, num_steps, rid)) >= 2
        assert timeline(eng, num_steps, rid) == timeline(base, base_num_steps, rid)
        assert eng.requests[rid].first_token_s == base.requests[rid].first_token_s
        assert eng.requests[rid].first_token_s < chunk_step.start_s
    # The routed call arrived while the load was in flight and was scheduled in the next step.
    r_first = eng.steps_with("r")[0]
    assert load_start_s < r_first.start_s < load_done_s
    assert all(any(r.request_id == "d" for r in s.batch) for s in eng.steps
               if s.batch and load_start_s <= s.start_s < load_done_s)
