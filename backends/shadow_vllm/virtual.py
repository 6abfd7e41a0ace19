"""Virtual-time mode: vLLM's real scheduler and KV cache manager, driven one
iteration at a time with fake model outputs on a virtual clock.

No model runs. :func:`build_scheduler` builds any vLLM v1 scheduler class
(stock ``Scheduler``, ``AsyncScheduler``, or the shadow scheduler of
:mod:`shadow_vllm.scheduler`) from a ``VllmConfig`` whose model config is a
local ``config.json`` (no weights, ``skip_tokenizer_init``) and a
``KVCacheConfig`` with one ``FullAttentionSpec`` group; :class:`VirtualEngine`
adds requests at virtual arrival times, calls ``schedule()``, charges the
batch to a :class:`~shadowcore.latency.LatencyModel` (for example the
simulator's Vidur model of an H100) and feeds a ``ModelRunnerOutput`` with
fake sampled tokens to ``update_from_output()`` at the end of the iteration.
A policy can so be checked against vLLM's own scheduling semantics at GPU
speed without a GPU. With ``VirtualEngineConfig.kv_offloading_bytes`` the
scheduler gets vLLM's real ``OffloadingConnector`` (scheduler side, the host
tier) and :class:`OffloadTransferWorker` runs its store and load jobs in
place of the worker side the CPU build refuses.

On top: :class:`VirtualScenarioRun` plays the fake backend's scenario (same
sessions, normal traffic, request ids and event order) through virtual
engines with the core's router side; :class:`TaggedShadowFeeder` turns the
router side's jobs into tagged shadow requests, as a gateway does;
:class:`PlanRecorder` and :func:`compare_steps` match the planned steps of two
engines by their inputs and compare their decisions
(``tests/vllm/test_virtual_agreement.py``).

Invariants:

* Every scheduling decision is vLLM's (and its KV connector's): this module
  never reorders, admits, preempts or frees anything itself; it reports what
  the scheduler output says, and the fake transfer worker only reports the
  jobs the connector's metadata lists, as done, when the bandwidth says. An
  idle engine starts an iteration as soon as a request arrives; what arrives
  during an iteration waits for the next one.
* The clock is virtual and shared: ``Request.arrival_time`` is the virtual
  arrival, and a scheduler that reads a clock (the shadow scheduler's
  ``shadow_clock``) is given :class:`VirtualClock`; no decision here depends
  on wall time.
* An iteration's duration is ``latency.predict_s`` of exactly the scheduled
  batch (prefill chunks with their context, decodes with their length).
* Deterministic: same requests and same latency model, same steps. Fake
  sampled tokens come from :func:`hashed_token` (or the caller's sampler),
  never from an RNG; a partial prefill chunk samples nothing, as in vLLM's
  model runner.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from shadowcore._validators import non_negative, positive_int
from shadowcore.engine.driver import CallOutcome, SessionDriver
from shadowcore.engine.records import CallRecord
from shadowcore.engine.workload import draw_workload
from shadowcore.errors import ConfigError
from shadowcore.events import EventLoop
from shadowcore.latency import BatchShape, LatencyModel, PrefillChunk, chunked_prefill_s
from shadowcore.pipeline import build_runtime
from shadowcore.wire import ShadowTag, TagKind

#: Event kinds on the shared loop: an iteration ends (and frees its slots)
#: before work arriving at the same time is added; idle engines wake last.
STEP_END, ARRIVAL, WAKE = 0, 1, 2


@attrs.define(eq=False)
class VirtualClock:
    """Seconds on the virtual timeline; call it to read the time."""

    now_s: float = 0.0

    def __call__(self) -> float:
        return self.now_s


def hashed_token(request_id: str, index: int, vocab_size: int = 1024) -> int:
    """A fake sampled token: a pure function of the request and the position."""
    digest = hashlib.blake2b(f"{request_id}\x00{index}".encode(), digest_size=8).digest()
    return 3 + int.from_bytes(digest, "little") % (vocab_size - 3)  # skip the usual special ids


@attrs.frozen
class VirtualEngineConfig:
    """The vLLM limits of one virtual instance (``max_num_batched_tokens`` is
    the token budget of an iteration, ``num_blocks`` the KV pool)."""

    block_size: int = attrs.field(default=16, validator=positive_int)
    num_blocks: int = attrs.field(default=4096, validator=positive_int)
    max_num_batched_tokens: int = attrs.field(default=2048, validator=positive_int)
    max_num_seqs: int = attrs.field(default=256, validator=positive_int)
    max_model_len: int = attrs.field(default=32768, validator=positive_int)
    scheduling_policy: str = attrs.field(default="fcfs", validator=attrs.validators.in_(("fcfs", "priority")))
    vocab_size: int = attrs.field(default=1024, validator=positive_int)
    #: ``VllmConfig.additional_config`` (the shadow scheduler reads its policy here).
    additional_config: Mapping[str, Any] = attrs.field(factory=dict, converter=dict, hash=False)
    #: Host tier: vLLM's native CPU KV offloading (``OffloadingConnector``, as ``--kv-offloading-size``
    #: sets it up) with this many bytes of host memory; None: no connector.
    kv_offloading_bytes: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(positive_int))
    #: Tokens per offloaded chunk (the connector's ``block_size`` key; a multiple of ``block_size``);
    #: None: one device block.
    kv_offloading_block_size: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(positive_int))
    #: Bandwidth of the fake transfer worker, each direction (bytes/s); None: transfers are instant.
    kv_transfer_bytes_per_s: float | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.gt(0)))

    def __attrs_post_init__(self) -> None:
        chunk = self.kv_offloading_block_size
        if chunk is not None and chunk % self.block_size:
            raise ConfigError("kv_offloading_block_size", chunk, f"must be a multiple of block_size {self.block_size}")
        if self.kv_offloading_bytes is None and (chunk is not None or self.kv_transfer_bytes_per_s is not None):
            raise ConfigError("kv_offloading_bytes", None, "the host tier's other settings need its size")


def write_model_config(directory: str, vocab_size: int = 1024, max_position_embeddings: int = 32768) -> str:
    """A 2-layer Llama ``config.json`` in ``directory`` (no weights, no tokenizer):
    enough for vLLM's ``ModelConfig`` with ``skip_tokenizer_init=True``."""
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "vocab_size": vocab_size, "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
        "tie_word_embeddings": False,
    }
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return directory


_MODEL_DIRS: dict[tuple[int, int], str] = {}


def _model_dir(vocab_size: int, max_model_len: int) -> str:
    key = (vocab_size, max_model_len)
    if key not in _MODEL_DIRS:  # one config per process and shape (ModelConfig only reads it)
        directory = tempfile.mkdtemp(prefix="shadow-virtual-")
        atexit.register(shutil.rmtree, directory, True)
        _MODEL_DIRS[key] = write_model_config(directory, *key)
    return _MODEL_DIRS[key]


def build_scheduler(scheduler_cls: type | None = None, config: VirtualEngineConfig | None = None) -> Any:
    """A vLLM scheduler of ``scheduler_cls`` (default: stock ``Scheduler``)
    with a real KV cache manager of ``config.num_blocks`` blocks, built as
    vLLM's engine core builds it, minus the model."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    config = config or VirtualEngineConfig()
    cls = scheduler_cls or Scheduler
    model = ModelConfig(
        model=_model_dir(config.vocab_size, config.max_model_len), skip_tokenizer_init=True,
        max_model_len=config.max_model_len, dtype="float32",
    )
    sched = SchedulerConfig(
        max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
        max_model_len=config.max_model_len, enable_chunked_prefill=True, policy=config.scheduling_policy,
        is_encoder_decoder=False, async_scheduling=_is_async(cls),
    )
    cache = CacheConfig(block_size=config.block_size, enable_prefix_caching=True)
    vllm_config = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache,
                             kv_transfer_config=_offloading_config(config),
                             additional_config=dict(config.additional_config))
    vllm_config.cache_config.num_gpu_blocks = config.num_blocks
    spec = FullAttentionSpec(block_size=config.block_size, num_kv_heads=2, head_size=32, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(config.num_blocks, [], [KVCacheGroupSpec(["model.layers.0.self_attn"], spec)])
    return cls(
        vllm_config=vllm_config, kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config), block_size=config.block_size,
        log_stats=True,
    )


def _offloading_config(config: VirtualEngineConfig) -> Any:
    """The ``KVTransferConfig`` that ``--kv-offloading-size`` builds (native backend), or None.
    The scheduler creates the connector's scheduler side only (role SCHEDULER); no worker side."""
    if config.kv_offloading_bytes is None:
        return None
    from vllm.config import KVTransferConfig

    extra: dict[str, Any] = {"cpu_bytes_to_use": config.kv_offloading_bytes}
    if config.kv_offloading_block_size is not None:
        extra["block_size"] = config.kv_offloading_block_size
    return KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra)


def _is_async(cls: type) -> bool:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    return issubclass(cls, AsyncScheduler)


def block_hasher(block_size: int) -> Callable:
    """vLLM's request block hasher (the engine core's, with its hash seed)."""
    from vllm.config import CacheConfig
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name(CacheConfig().prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(block_size, hash_fn)


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
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
        from vllm.v1.outputs import KVConnectorOutput

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
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

        if not isinstance(getattr(scheduler, "connector", None), OffloadingConnector):
            return None
        (group,) = scheduler.kv_cache_config.kv_cache_groups
        return cls(group.kv_cache_spec.page_size_bytes * len(group.layer_names), bytes_per_s)


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
        from vllm.v1.request import Request

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
        from vllm.v1.request import RequestStatus

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
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

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
        from vllm.v1.outputs import ModelRunnerOutput

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
        from vllm.v1.request import Request

        if not token_ids:
            return 0
        probe = Request("__probe__", [*token_ids, 0], SamplingParams(max_tokens=1), None, arrival_time=0.0,
                        block_hasher=self._hasher)
        return int(self.scheduler.kv_cache_manager.get_computed_blocks(probe)[1])


@attrs.define(eq=False)
class VirtualCluster:
    """Virtual engines on one timeline, by instance id and model: the
    router side's :class:`~shadowcore.manager.ClusterPort` (histories must
    carry token ids; prefix lookups go through each vLLM KV cache manager)."""

    loop: EventLoop
    by_model: dict[str, list[VirtualEngine]]

    @property
    def by_id(self) -> dict[str, VirtualEngine]:
        return {e.name: e for engines in self.by_model.values() for e in engines}

    def instances(self, model: str) -> list[str]:
        return [e.name for e in self.by_model[model]]

    def block_size(self, instance_id: str) -> int:
        return self.by_id[instance_id].block_size

    def cached_prefix_tokens(self, instance_id: str, history: Any) -> int:
        if history.token_ids is None:
            raise ValueError(f"session {history.session_id}: a vLLM prefix lookup needs token ids")
        return self.by_id[instance_id].cached_prefix_tokens(history.token_ids)

    def estimated_prefill_completion_s(self, instance_id: str, num_uncached_tokens: int) -> float:
        engine = self.by_id[instance_id]
        sched = engine.scheduler
        queued = sum(max(0, r.num_tokens - r.num_computed_tokens - 1) for r in [*sched.waiting, *sched.running])
        budget = sched.max_num_scheduled_tokens
        return self.loop.now_s + chunked_prefill_s(engine.latency, queued + num_uncached_tokens, budget)

    def kick_all(self) -> None:
        for engine in self.by_id.values():
            engine.wake()


def session_tokens(session_id: str, index: int, num_tokens: int, vocab_size: int = 1024) -> list[int]:
    """The new input tokens of call ``index`` of a session (deterministic)."""
    return [hashed_token(f"{session_id}#{index}", i, vocab_size) for i in range(num_tokens)]


@attrs.define(eq=False)
class VirtualScenarioRun:
    """Agent sessions and normal traffic (the fake backend's scenario, same
    draws) through vLLM schedulers in virtual time, with the core's router
    side (:class:`~shadowcore.manager.ShadowManager`) placing calls.

    The router side is the simulator's own
    (:class:`~shadowcore.engine.driver.SessionDriver`, same request ids,
    arrival times, tool gaps, outputs), so the two runs can be compared step
    by step; this run is the driver's serving port for vLLM engines. Histories carry real token
    ids (new input from :func:`session_tokens`, output as vLLM samples it).
    ``latency`` maps each model to its latency model; ``engine_config`` gives
    the vLLM limits; ``shadow_feeder`` (optional) is called after every
    router-side event to turn the manager's jobs into shadow requests.
    """

    scenario: Any  # a ScenarioSpec: models, instances_per_model, SLOs, the synthetic workload's fields
    shadow: Any  # ShadowConfig
    latency: Mapping[str, LatencyModel]
    engine_config: Mapping[str, VirtualEngineConfig]  # per model
    scheduler_cls: type | None = None
    sessions: Sequence[Any] | None = None  # scripted SessionPlans in place of the workload's
    shadow_feeder: Callable[[VirtualScenarioRun], None] | None = None
    observers: tuple = ()
    workload: Any = None  # a Workload; None: drawn from the scenario (the fake backend's draws)
    loop: EventLoop = attrs.field(init=False, factory=EventLoop)
    clock: VirtualClock = attrs.field(init=False, factory=VirtualClock)
    cluster: VirtualCluster = attrs.field(init=False)
    runtime: Any = attrs.field(init=False)
    driver: SessionDriver = attrs.field(init=False)
    normal: list[VirtualRequest] = attrs.field(init=False, factory=list)

    def __attrs_post_init__(self) -> None:
        sc = self.scenario
        by_model = {
            m: [
                VirtualEngine(build_scheduler(self.scheduler_cls, self._config(m, f"{m}/{k}")), self.latency[m],
                              self.loop, self.clock, name=f"{m}/{k}",
                              transfer_bytes_per_s=self.engine_config[m].kv_transfer_bytes_per_s)
                for k in range(sc.instances_per_model)
            ]
            for m in sc.models
        }
        self.cluster = VirtualCluster(self.loop, by_model)
        self.runtime = build_runtime(self.shadow, self.cluster, sc.models)
        for obs in self.observers:
            self.runtime.observers.add(obs)
        workload = self.workload if self.workload is not None else draw_workload(sc, list(self.cluster.by_id))
        if self.sessions is not None:
            workload = attrs.evolve(workload, sessions=tuple(self.sessions))
        self.workload = workload
        self.driver = SessionDriver(self.loop, self.runtime.manager, self)

    def _config(self, model: str, instance_id: str) -> VirtualEngineConfig:
        """The model's engine config; a shadow scheduler section gets this instance's id."""
        config = self.engine_config[model]
        extra = dict(config.additional_config)
        if "shadowprefill" in extra:
            extra["shadowprefill"] = {**extra["shadowprefill"], "instance_id": instance_id}
        return attrs.evolve(config, additional_config=extra)

    @property
    def calls(self) -> list[CallRecord]:
        return self.driver.calls

    def run(self) -> VirtualScenarioRun:
        self.driver.schedule(self.workload, list(self.cluster.by_id))
        self.loop.run()
        return self

    # -- the driver's serving port ---------------------------------------------------
    def input_token_ids(self, session_id: str, call_index: int, model: str, num_tokens: int) -> tuple[int, ...]:
        vocab = self.cluster.by_model[model][0].scheduler.vllm_config.model_config.get_vocab_size()
        return tuple(session_tokens(session_id, call_index, num_tokens, vocab))

    def start_call(self, request_id: str, placement: Any, history: Any, num_output_tokens: int,
                   on_tokens: Callable, on_finish: Callable[[CallOutcome], None]) -> None:
        engine = self.cluster.by_id[placement.instance_id]
        if self.shadow_feeder is not None:  # jobs closed by this call go before the call starts
            self.shadow_feeder(self)
        engine.add_request(
            request_id, list(history.token_ids), num_output_tokens,
            extra_args=ShadowTag(TagKind.ROUTED, history.session_id).to_extra_args(),
            on_token=lambda r, tok, f=on_tokens: self._token(f, tok),
            on_finish=lambda r, f=on_finish: f(CallOutcome(
                False, r.arrival_s, r.first_token_s, r.finish_s, len(r.prompt_token_ids), r.num_cached_tokens or 0)),
        )

    def start_normal(self, request_id: str, instance_id: str, num_prompt_tokens: int,
                     num_output_tokens: int) -> None:
        engine = self.cluster.by_id[instance_id]
        vocab = engine.scheduler.vllm_config.model_config.get_vocab_size()
        prompt = [hashed_token(request_id, i, vocab) for i in range(num_prompt_tokens)]
        self.normal.append(engine.add_request(request_id, prompt, num_output_tokens))

    def settle(self) -> None:
        if self.shadow_feeder is not None:
            self.shadow_feeder(self)
        self.cluster.kick_all()

    def _token(self, on_tokens: Callable, token: int) -> None:
        """Streamed output extends the session (and so every job on other models)."""
        on_tokens(1, [token])
        if self.shadow_feeder is not None:
            self.shadow_feeder(self)


@attrs.define(eq=False)
class TaggedShadowFeeder:
    """The router side's jobs as tagged shadow requests (``shadowcore.wire``),
    as a gateway sends them to engines that run the shadow scheduler, but
    streamed: a job whose block-aligned target grew is sent again (the newer
    request supersedes the older one in the engine), and a job the router
    side closed (its session's call arrived on that model, or the session
    ended) has its request aborted. The prompt is the whole session history,
    so vLLM's ``num_tokens - 1`` prefix-hit limit never hides a full block."""

    #: Start an idle engine's iteration when a shadow arrives. False (default)
    #: mirrors the simulator, where a job that grows does not wake an idle
    #: instance: it is planned at the instance's next kick (a routed call's
    #: arrival or end anywhere, as ``kick_all`` does).
    wake: bool = False
    #: job key -> (instance, request id, target tokens, epoch, switch probability) of its live request
    submitted: dict[Any, tuple[str, str, int, int, float]] = attrs.Factory(dict)
    num_submitted: int = 0
    num_aborted: int = 0

    def __call__(self, run: VirtualScenarioRun) -> None:
        live = {job.key: job for job in run.runtime.manager.jobs()}
        for key, (instance, rid, *_) in list(self.submitted.items()):
            job = live.get(key)
            if job is None or job.instance_id != instance:
                run.cluster.by_id[instance].abort([rid])
                del self.submitted[key]
                self.num_aborted += 1
        for key, job in live.items():
            state = (job.num_target_tokens, job.history.epoch, job.switch_probability)
            prev = self.submitted.get(key)
            if state[0] == 0 or (prev is not None and prev[2:] == state):
                continue
            tag = ShadowTag(TagKind.SHADOW, key.session_id, key.target_model, state[1], state[2])
            rid = f"shadow:{key.session_id}:{key.target_model}:{self.num_submitted}"
            self.num_submitted += 1
            self.submitted[key] = (job.instance_id, rid, *state)
            run.cluster.by_id[job.instance_id].add_request(rid, list(job.history.token_ids), 1,
                                                           extra_args=tag.to_extra_args(), kick=self.wake)


@attrs.frozen
class PlannedStep:
    """What one hook saw and decided in one iteration, in engine-neutral terms.

    ``batch`` is the scheduled normal and routed work as (request id, phase,
    tokens, context) sorted by id (engines order their batches differently;
    the slack controller does not depend on the order); ``jobs`` the pending
    shadow jobs before the plan, in the order the hook takes them
    (non-increasing switch probability, then the job source's sequence), as
    (session, target, epoch, next token, target tokens, switch probability);
    ``grants`` the plan in batch order.
    """

    instance_id: str
    now_s: float
    batch: tuple[tuple[str, str, int, int], ...]
    num_waiting: int
    admission_blocked: bool
    num_free_token_budget: int
    num_shadow_room_tokens: int
    jobs: tuple[tuple[str, str, int, int, int, float], ...]
    budget_reason: str
    grants: tuple[tuple[str, str, int, int], ...]

    @property
    def batch_inputs(self) -> tuple:
        """The iteration as the engine built it (time, batch, queue)."""
        return (round(self.now_s, 9), self.batch, self.num_waiting, self.admission_blocked)

    @property
    def inputs(self) -> tuple:
        """Everything the decision depends on (besides the controller's credit)."""
        return (*self.batch_inputs, self.num_free_token_budget, self.num_shadow_room_tokens, self.jobs)

    def plannable_inputs(self, n_min: int) -> tuple:
        """:attr:`inputs` with the jobs dropped when all they miss together is
        below ``n_min``: no plan can grant any of them (the hook's chunk is at
        most their sum and at least ``n_min``), so such sets decide alike."""
        missing = sum(target - next_token for _, _, _, next_token, target, _ in self.jobs)
        jobs = self.jobs if missing >= n_min else ()
        return (*self.batch_inputs, self.num_free_token_budget, self.num_shadow_room_tokens, jobs)

    @property
    def decision(self) -> tuple:
        return (self.budget_reason, self.grants)


@attrs.define(eq=False)
class PlanRecorder:
    """An observer (``on_plan``) recording :class:`PlannedStep` per instance;
    ``jobs_of(instance_id)`` lists the job source's jobs (any state)."""

    jobs_of: Callable[[str], Sequence[Any]]
    steps: dict[str, list[PlannedStep]] = attrs.Factory(dict)

    def on_plan(self, snapshot: Any, plan: Any) -> None:
        granted: dict[Any, int] = {}
        for g in plan.grants:
            granted[g.job] = granted.get(g.job, 0) + g.num_tokens
        jobs = []
        ordered = sorted(self.jobs_of(snapshot.instance_id), key=lambda j: (-j.switch_probability, j.sequence))
        for job in ordered:
            next_token = job.num_held_tokens + job.num_inflight_tokens - granted.get(job.key, 0)
            stale = job.epoch != job.history.epoch
            if stale or job.num_target_tokens > next_token:  # pending before this plan
                jobs.append((job.key.session_id, job.key.target_model, job.history.epoch,
                             0 if stale else next_token, job.num_target_tokens, round(job.switch_probability, 12)))
        batch = tuple(sorted((v.request_id, v.phase.value, v.num_scheduled_tokens, v.num_context_tokens)
                             for v in snapshot.batch))
        grants = tuple((g.job.session_id, g.job.target_model, g.start_token, g.num_tokens) for g in plan.grants)
        self.steps.setdefault(snapshot.instance_id, []).append(PlannedStep(
            snapshot.instance_id, snapshot.now_s, batch, snapshot.num_waiting, snapshot.admission_blocked,
            snapshot.num_free_token_budget, snapshot.num_shadow_room_tokens, tuple(jobs),
            plan.budget.reason.value, grants))


@attrs.frozen
class Agreement:
    """Two engines' planned steps on one instance, matched by their inputs."""

    instance_id: str
    num_steps: tuple[int, int]  # non-idle planned steps (reference, other)
    num_lockstep: int  # leading steps identical in inputs and decision
    num_same_batch: int  # steps (time, batch, queue) present in both
    num_compared: int  # ... whose pending jobs were identical too
    num_compared_with_grants: int
    num_compared_multi_job: int  # ... that granted two or more jobs (their order was checked)
    mismatches: tuple[tuple[PlannedStep, PlannedStep], ...]  # same inputs, different decision
    first_divergence: tuple[PlannedStep | None, PlannedStep | None]


def _active(steps: Sequence[PlannedStep]) -> list[PlannedStep]:
    return [s for s in steps if s.batch or s.grants or s.jobs]


def compare_steps(instance_id: str, reference: Sequence[PlannedStep], other: Sequence[PlannedStep],
                  n_min: int = 0) -> Agreement:
    """Match steps with identical inputs (:meth:`PlannedStep.plannable_inputs`)
    and compare the decisions."""
    a, b = _active(reference), _active(other)
    lockstep = 0
    for x, y in zip(a, b, strict=False):
        if x.plannable_inputs(n_min) != y.plannable_inputs(n_min) or x.decision != y.decision:
            break
        lockstep += 1
    divergence = (a[lockstep] if lockstep < len(a) else None, b[lockstep] if lockstep < len(b) else None)
    by_batch = {s.batch_inputs: s for s in b}
    same = [(x, by_batch[x.batch_inputs]) for x in a if x.batch_inputs in by_batch]
    compared = [(x, y) for x, y in same if x.plannable_inputs(n_min) == y.plannable_inputs(n_min)]
    return Agreement(
        instance_id, (len(a), len(b)), lockstep, len(same), len(compared),
        sum(1 for x, y in compared if x.grants or y.grants),
        sum(1 for x, y in compared if len(x.grants) > 1 or len(y.grants) > 1),
        tuple((x, y) for x, y in compared if x.decision != y.decision), divergence,
    )


@attrs.frozen
class LatencyScale:
    """A latency model times a constant (a slower or faster device)."""

    base: LatencyModel
    factor: float = attrs.field(default=1.0, validator=non_negative)

    def predict_s(self, batch: BatchShape) -> float:
        return self.factor * self.base.predict_s(batch)


def check_scheduler_cls(value: Any, field: str = "scheduler_cls") -> type:
    """``value`` as a vLLM scheduler class: a class, or ``package.module.Class``."""
    if isinstance(value, str):
        import importlib

        module, _, name = value.rpartition(".")
        try:
            value = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as e:
            raise ConfigError(field, value, f"cannot import: {e}") from None
    if not isinstance(value, type) or not hasattr(value, "schedule"):
        raise ConfigError(field, value, "is not a vLLM scheduler class")
    return value


__all__ = [
    "Agreement",
    "LatencyScale",
    "OffloadTransferWorker",
    "PlanRecorder",
    "PlannedStep",
    "ScheduledRequest",
    "StepRecord",
    "TaggedShadowFeeder",
    "VirtualClock",
    "VirtualCluster",
    "VirtualEngine",
    "VirtualEngineConfig",
    "VirtualRequest",
    "VirtualScenarioRun",
    "batch_shape",
    "block_hasher",
    "build_scheduler",
    "check_scheduler_cls",
    "compare_steps",
    "hashed_token",
    "session_tokens",
    "write_model_config",
]
