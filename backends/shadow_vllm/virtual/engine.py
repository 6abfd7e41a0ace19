"""One vLLM scheduler on the shared virtual timeline (:class:`VirtualEngine`):
requests are added at virtual arrival times, ``schedule()`` runs at an
iteration's start, the batch is charged to a
:class:`~shadowcore.latency.LatencyModel`, and a ``ModelRunnerOutput`` with
fake sampled tokens goes to ``update_from_output()`` at its end.

Invariants:

* Every scheduling decision is vLLM's (and its KV connector's): this module
  never reorders, admits, preempts or frees anything itself; it reports what
  the scheduler output says. An idle engine starts an iteration as soon as a
  request arrives; what arrives during an iteration waits for the next one.
* ``Request.arrival_time`` is the virtual arrival.
* An iteration's duration is ``latency.predict_s`` of exactly the scheduled
  batch (prefill chunks with their context, decodes with their length), plus
  any wait for KV transfers to flush.
* Deterministic: same requests and same latency model, same steps. A partial
  prefill chunk samples nothing, as in vLLM's model runner.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from shadow_vllm.virtual.clock import ARRIVAL, STEP_END, WAKE, VirtualClock, hashed_token
from shadow_vllm.virtual.config import block_hasher
from shadow_vllm.virtual.offload import OffloadTransferWorker
from shadowcore._validators import non_negative
from shadowcore.events import EventLoop
from shadowcore.latency import BatchShape, LatencyModel, PrefillChunk


@attrs.frozen
class ScheduledRequest:
    """One request in an iteration, in vLLM's batch order."""

    request_id: str
    num_scheduled_tokens: int
    num_context_tokens: int  # computed before this iteration (cached prefix or earlier chunks)
    is_decode: bool


@attrs.frozen
class StepRecord:
    """What one virtual iteration ran and how long the latency model says it took."""

    iteration: int
    start_s: float
    duration_s: float
    batch: tuple[ScheduledRequest, ...]
    num_waiting: int  # waiting requests left after schedule()
    preempted: tuple[str, ...]

    @property
    def shape(self) -> BatchShape:
        return batch_shape(self.batch)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.batch)


def batch_shape(batch: Sequence[ScheduledRequest]) -> BatchShape:
    prefills = tuple(PrefillChunk(r.num_scheduled_tokens, r.num_context_tokens) for r in batch if not r.is_decode)
    decodes = tuple(r.num_context_tokens for r in batch if r.is_decode)
    return BatchShape(prefills, decodes)


@attrs.define(eq=False)
class VirtualRequest:
    """A request's life on the virtual timeline (what a client would see)."""

    request_id: str
    prompt_token_ids: tuple[int, ...] = attrs.field(repr=False)
    arrival_s: float
    max_tokens: int
    output_token_ids: list[int] = attrs.field(factory=list, repr=False)
    first_token_s: float | None = None
    finish_s: float | None = None
    finish_reason: str | None = None
    num_cached_tokens: int | None = None
    prefill_stats: Any = None  # vLLM's PrefillStats of its first scheduled prefill (local and external hits)
    on_finish: Callable[[VirtualRequest], None] | None = None
    on_token: Callable[[VirtualRequest, int], None] | None = None  # each sampled token, as it arrives

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s


@attrs.define(eq=False)
class VirtualEngine:
    """One vLLM scheduler on the shared virtual timeline of ``loop``.

    ``add_request`` may be called at any time (between or during iterations,
    as the engine core's input queue allows); an idle engine starts an
    iteration at once. Each iteration runs ``schedule()`` at its start time
    and ``update_from_output()`` at its end time. With an ``OffloadingConnector``
    (``VirtualEngineConfig.kv_offloading_bytes``) :attr:`offload` runs its
    transfers; a step in which nothing is computed but a transfer is in flight
    lasts until the next transfer ends (vLLM's engine core keeps stepping while
    the connector has work) and is recorded with an empty batch.
    """

    scheduler: Any
    latency: LatencyModel
    loop: EventLoop = attrs.Factory(EventLoop)
    clock: VirtualClock = attrs.Factory(VirtualClock)
    sampler: Callable[[str, int], int] = hashed_token
    name: str = "engine"
    steps: list[StepRecord] = attrs.Factory(list)
    requests: dict[str, VirtualRequest] = attrs.Factory(dict)
    busy: bool = False
    #: The fake transfer worker's bandwidth (``VirtualEngineConfig.kv_transfer_bytes_per_s``).
    transfer_bytes_per_s: float | None = None
    offload: OffloadTransferWorker | None = attrs.field(init=False, default=None)
    _hasher: Callable = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._hasher = block_hasher(self.scheduler.block_size)
        self.offload = OffloadTransferWorker.for_scheduler(self.scheduler, self.transfer_bytes_per_s)
        if hasattr(self.scheduler, "shadow_clock"):  # the shadow scheduler reads "now" here
            self.scheduler.shadow_clock = self.clock

    @property
    def block_size(self) -> int:
        return int(self.scheduler.block_size)

    # -- requests -------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int = 1,
        *,
        priority: int = 0,
        extra_args: Mapping[str, Any] | None = None,
        on_finish: Callable[[VirtualRequest], None] | None = None,
        on_token: Callable[[VirtualRequest, int], None] | None = None,
        kick: bool = True,
    ) -> VirtualRequest:
        """Add a request now (the loop's time is its ``arrival_time``); with
        ``kick``, an idle engine starts an iteration at once."""
        from vllm import SamplingParams

        from shadow_vllm.vllm_internals import Request

        if request_id in self.requests:
            raise ValueError(f"request_id = {request_id!r}: already added to {self.name}")
        if not prompt_token_ids:
            raise ValueError(f"request {request_id}: prompt_token_ids is empty")
        now = self._sync_clock()
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                extra_args=dict(extra_args) if extra_args else None)
        req = Request(request_id, list(prompt_token_ids), params, None, arrival_time=now, priority=priority,
                      block_hasher=self._hasher)
        handle = VirtualRequest(request_id, tuple(prompt_token_ids), now, max_tokens, on_finish=on_finish,
                                on_token=on_token)
        self.requests[request_id] = handle
        self.scheduler.add_request(req)
        if kick:
            self.kick()
        return handle

    def add_request_at(self, arrival_s: float, request_id: str, prompt_token_ids: Sequence[int],
                       max_tokens: int = 1, **kwargs: Any) -> None:
        """Schedule :meth:`add_request` at a later virtual time."""
        self.loop.at(arrival_s, ARRIVAL,
                     lambda t: self.add_request(request_id, prompt_token_ids, max_tokens, **kwargs))

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests as the engine core does for a client (no output follows)."""
        from shadow_vllm.vllm_internals import RequestStatus

        now = self._sync_clock()
        for request in self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED):
            handle = self.requests.get(request.request_id)
            if handle is not None and handle.finish_s is None:
                handle.finish_s, handle.finish_reason = now, "abort"

    # -- iterations -----------------------------------------------------------------
    def kick(self) -> None:
        """Start an iteration now unless one is running (as the simulator's
        engine does: work that arrives while an iteration runs waits for the next)."""
        if not self.busy:
            self._start()

    def wake(self) -> None:
        """Kick after the other events at the current time (an idle engine's wake-up)."""
        self.loop.at(self.loop.now_s, WAKE, lambda t: self.kick())

    def _sync_clock(self) -> float:
        self.clock.now_s = self.loop.now_s
        return self.loop.now_s

    def _start(self) -> None:
        if self.busy or not self.scheduler.has_requests():
            return
        now = self._sync_clock()
        output = self.scheduler.schedule()
        stall_s = 0.0 if self.offload is None else self.offload.begin_step(output.kv_connector_metadata, now)
        if output.total_num_scheduled_tokens == 0:  # nothing ran (e.g. only finished ids to flush)
            wait_s = None if self.offload is None else self.offload.wait_s(now)
            if wait_s is None:
                self._flush(output)
                return
            batch, duration = (), max(stall_s, wait_s)  # waiting for a transfer
        else:
            batch = self._batch(output)
            duration = stall_s + self.latency.predict_s(batch_shape(batch))
        record = StepRecord(len(self.steps), now, duration, batch, len(self.scheduler.waiting),
                            tuple(sorted(output.preempted_req_ids or ())))
        self.steps.append(record)
        self.busy = True
        self.loop.at(now + duration, STEP_END, lambda t: self._end(output))

    def _flush(self, output: Any) -> None:
        """An empty iteration: the engine core still passes it through
        ``update_from_output``; no time passes and nothing restarts it
        (the next arrival or iteration end does)."""
        from shadow_vllm.vllm_internals import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

        runner_output = EMPTY_MODEL_RUNNER_OUTPUT
        if self.offload is not None:
            kv_output = self.offload.end_step(output.kv_connector_metadata, self.loop.now_s)
            if kv_output is not None:
                runner_output = ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=kv_output)
        self._dispatch(self.scheduler.update_from_output(output, runner_output), self.loop.now_s)
        if self.offload is not None and self.offload.has_queued_stores:
            self.kick()  # stores queued by this step start with the next one (the engine core keeps stepping)

    def _batch(self, output: Any) -> tuple[ScheduledRequest, ...]:
        out = []
        for rid, n in output.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            context = req.num_computed_tokens - n  # schedule() already advanced it
            out.append(ScheduledRequest(rid, n, context, context >= req.num_prompt_tokens))
        return tuple(out)

    def _end(self, output: Any) -> None:
        from shadow_vllm.vllm_internals import ModelRunnerOutput

        now = self._sync_clock()
        ids = list(output.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = self.scheduler.requests.get(rid)
            partial = req is None or req.is_finished() or req.is_prefill_chunk
            sampled.append([] if partial else [self.sampler(rid, req.num_output_tokens)])
        kv_output = None if self.offload is None else self.offload.end_step(output.kv_connector_metadata, now)
        runner_output = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                          sampled_token_ids=sampled, kv_connector_output=kv_output)
        engine_outputs = self.scheduler.update_from_output(output, runner_output)
        self.busy = False
        self._dispatch(engine_outputs, now)
        self.kick()

    def _dispatch(self, engine_outputs: Mapping[int, Any], now: float) -> None:
        """Hand every output to its request; finish callbacks after all tokens."""
        finished = []
        for outputs in engine_outputs.values():
            for out in outputs.outputs:
                finished.extend(self._deliver(out, now))
        for handle in finished:
            if handle.on_finish is not None:
                handle.on_finish(handle)

    def _deliver(self, out: Any, now: float) -> list[VirtualRequest]:
        handle = self.requests.get(out.request_id)
        if handle is None:
            return []
        if out.new_token_ids:
            if handle.first_token_s is None:
                handle.first_token_s = now
            handle.output_token_ids.extend(out.new_token_ids)
            if handle.on_token is not None:
                for token in out.new_token_ids:
                    handle.on_token(handle, token)
        if out.prefill_stats is not None and handle.num_cached_tokens is None:
            handle.num_cached_tokens = out.prefill_stats.num_cached_tokens
            handle.prefill_stats = out.prefill_stats
        if out.finish_reason is None:
            return []
        handle.finish_s = now
        handle.finish_reason = str(out.finish_reason)
        return [handle]

    # -- queries --------------------------------------------------------------------
    def cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens of ``token_ids`` in vLLM's prefix cache now: the whole blocks
        whose chained hashes the block pool holds, read with vLLM's own
        ``get_computed_blocks`` (one extra token appended, so that its
        ``num_tokens - 1`` limit does not hide the last full block)."""
        from vllm import SamplingParams

        from shadow_vllm.vllm_internals import Request

        if not token_ids:
            return 0
        probe = Request("__probe__", [*token_ids, 0], SamplingParams(max_tokens=1), None, arrival_time=0.0,
                        block_hasher=self._hasher)
        return int(self.scheduler.kv_cache_manager.get_computed_blocks(probe)[1])


@attrs.frozen
class LatencyScale:
    """A latency model times a constant (a slower or faster device)."""

    base: LatencyModel
    factor: float = attrs.field(default=1.0, validator=non_negative)

    def predict_s(self, batch: BatchShape) -> float:
        return self.factor * self.base.predict_s(batch)
