"""P/D disaggregation in vLLM virtual time: prefill (P) and decode (D) vLLM
schedulers per model with the real ``NixlConnector`` scheduler side, a fake
transfer worker that moves no data (:class:`NixlTransferWorker`, each D's
inbound link at a given bandwidth), and the core's router side over the P
engines (:class:`PDVirtualRun`), the virtual twin of the simulator's
:class:`shadow_sim.disagg.PDRun`.

Every request prefills on a P engine with one output token and
``kv_transfer_params`` ``do_remote_decode`` (vLLM's protocol); at its end,
P's connector holds its blocks and returns the handle, and the request goes
on to a D engine (the session's sticky D for routed calls, the least loaded
D for normal requests) with that handle; D's connector loads what D's
prefix cache lacks. A shadow on a P engine that finishes with a handle is
offered to the session's sticky D of its target model (a tagged push offer,
:class:`shadow_vllm.pd.DecodeShadowScheduler`), as the gateway does.

The worker follows ``NixlConnector``'s: a read listed in a step's metadata
starts when the step starts and takes its blocks' bytes over the D link (one
read at a time per link, FIFO); D reports it in ``finished_recving`` at the
first step end after it is done; P learns of it (``finished_sending``, its
blocks freed) at P's first step end after that (the real engine core keeps
stepping while it holds delay-freed requests; a virtual P engine steps only
when it has work, so an idle P frees them at its next step). A notify-only
read (a full local hit, an offer that ended unread) releases the handle the
same way, without link time.

Invariants: every scheduling decision is vLLM's, its connector's and the
shadow schedulers'; a read of blocks P no longer holds for the handle is
counted (``num_stale_reads``; tests require none); no wall time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from shadow_vllm.virtual.clock import hashed_token
from shadow_vllm.virtual.cluster import VirtualCluster
from shadow_vllm.virtual.config import VirtualEngineConfig, build_scheduler
from shadow_vllm.virtual.engine import VirtualEngine, VirtualRequest
from shadow_vllm.virtual.replay import session_tokens
from shadowcore.engine.driver import CallOutcome, SessionDriver
from shadowcore.engine.workload import draw_workload
from shadowcore.events import EventLoop
from shadowcore.latency import LatencyModel
from shadowcore.pipeline import build_runtime
from shadowcore.wire import ShadowTag, TagKind, parse_tag


def nixl_config(role: str, engine_id: str) -> Any:
    """vLLM's ``KVTransferConfig`` of a P (``kv_producer``) or D (``kv_consumer``) engine with ``NixlConnector``."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector="NixlConnector", kv_role=role, engine_id=engine_id)


@attrs.define(eq=False)
class LinkRead:
    """One read on a D engine's inbound link."""

    decode_id: str
    request_id: str  # D's request
    remote_request_id: str  # P's request (the handle)
    num_blocks: int
    start_s: float
    end_s: float
    is_push: bool
    num_tokens: int  # the tokens it loads (the last block may be partial)


@attrs.define(eq=False)
class NixlTransferWorker:
    """The worker side of ``NixlConnector`` on the virtual clock for one engine (fake only in its
    data movement); ``fabric`` joins the workers of all engines."""

    engine: Any  # PDVirtualEngine
    fabric: PDFabric
    bytes_per_block: int
    bytes_per_s: float | None = None  # this engine's inbound link (D)
    #: True: a read takes the bytes of the tokens it loads (the simulator's accounting); False: of
    #: whole blocks (``NixlConnector`` moves whole pages, the last partial block included).
    charge_tokens: bool = False
    _link_free_s: float = 0.0
    _inflight: list[LinkRead] = attrs.Factory(list)
    _sent: set[str] = attrs.Factory(set)  # P side: requests whose handle was released, to report
    has_queued_stores = False  # the OffloadTransferWorker face VirtualEngine reads

    def begin_step(self, meta: Any, now_s: float) -> float:
        if meta is None:
            return 0.0
        for rid, req in meta.reqs_to_recv.items():
            remote = req.remote
            num_blocks = len(req.local_block_ids[0]) if req.local_block_ids else 0
            is_push = rid in self.engine.scheduler._shadow_offer_key if hasattr(
                self.engine.scheduler, "_shadow_offer_key") else False
            if num_blocks == 0:  # notify-only (a full local hit, or an offer that ended)
                self.fabric.release(remote.engine_id, remote.request_id)
                continue
            start = max(now_s, self._link_free_s)
            self.fabric.check_held(remote.engine_id, remote.request_id, start)
            bs = self.engine.block_size
            held = (req.local_num_computed_blocks[0] if req.local_num_computed_blocks else 0) * bs
            num_tokens = min(num_blocks * bs, self.engine.scheduler.requests[rid].num_computed_tokens - held)
            units = num_tokens / bs if self.charge_tokens else num_blocks
            end = start + (0.0 if self.bytes_per_s is None else units * self.bytes_per_block / self.bytes_per_s)
            self._link_free_s = end
            read = LinkRead(self.engine.name, rid, remote.request_id, num_blocks, start, end, is_push, num_tokens)
            self._inflight.append(read)
            self.fabric.reads.append(read)
            self.fabric.release_at(remote.engine_id, remote.request_id, end)  # as the real worker: after the read
        return 0.0

    def wait_s(self, now_s: float) -> float | None:
        if not self._inflight:
            return None
        return max(0.0, min(r.end_s for r in self._inflight) - now_s)

    def end_step(self, meta: Any, now_s: float) -> Any:
        from shadow_vllm.vllm_internals import KVConnectorOutput

        done = [r for r in self._inflight if r.end_s <= now_s]
        self._inflight = [r for r in self._inflight if r.end_s > now_s]
        sending = {rid for rid in self.fabric.due_releases(self.engine.name, now_s)}
        if not done and not sending:
            return None
        return KVConnectorOutput(finished_sending=sending, finished_recving={r.request_id for r in done})


@attrs.define(eq=False)
class PDFabric:
    """The workers of all engines: handles by P engine, releases due to P engines, every read."""

    engines: dict[str, Any] = attrs.Factory(dict)  # engine id -> PDVirtualEngine
    reads: list[LinkRead] = attrs.Factory(list)
    num_stale_reads: int = 0
    _releases: dict[str, dict[str, float]] = attrs.Factory(dict)  # P engine -> request id -> due s

    def read_tokens(self, read: LinkRead) -> int:
        return read.num_tokens

    def release(self, engine_id: str, request_id: str) -> None:
        self.release_at(engine_id, request_id, self.engines[engine_id].loop.now_s)

    def release_at(self, engine_id: str, request_id: str, due_s: float) -> None:
        self._releases.setdefault(engine_id, {})[request_id] = due_s

    def due_releases(self, engine_id: str, now_s: float) -> list[str]:
        pending = self._releases.get(engine_id)
        if not pending:
            return []
        sched = self.engines[engine_id].scheduler
        due = [rid for rid, t in pending.items() if t <= now_s]
        for rid in due:
            del pending[rid]
        return [rid for rid in due if rid in sched.requests]  # vLLM asserts the request still exists

    def check_held(self, engine_id: str, request_id: str, now_s: float) -> None:
        """The handle's blocks are still P's to give (its finished request, delay-freed, not yet
        released by an earlier read or notification: P frees them as soon as it learns of that)."""
        request = self.engines[engine_id].scheduler.requests.get(request_id)
        due = self._releases.get(engine_id, {}).get(request_id)
        if request is None or not request.is_finished() or (due is not None and due <= now_s):
            self.num_stale_reads += 1


@attrs.define(eq=False)
class PDVirtualEngine(VirtualEngine):
    """A virtual engine that keeps each finished request's ``kv_transfer_params`` and extra args."""

    kv_params: dict[str, dict] = attrs.Factory(dict)
    extra: dict[str, dict] = attrs.Factory(dict)
    on_handle: Callable[[PDVirtualEngine, str, dict], None] | None = None
    model_name: str = ""

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], max_tokens: int = 1, **kwargs: Any
                    ) -> VirtualRequest:
        if kwargs.get("extra_args"):
            self.extra[request_id] = dict(kwargs["extra_args"])
        return super().add_request(request_id, prompt_token_ids, max_tokens, **kwargs)

    def _deliver(self, out: Any, now: float) -> list[VirtualRequest]:
        params = getattr(out, "kv_transfer_params", None)
        if params is not None and out.finish_reason is not None:
            self.kv_params[out.request_id] = params
            if self.on_handle is not None:
                self.on_handle(self, out.request_id, params)
        return super()._deliver(out, now)


def pd_engine(role: str, name: str, model: str, latency: LatencyModel, config: VirtualEngineConfig,
              fabric: PDFabric, loop: EventLoop, clock: Any, scheduler_cls: type | None = None,
              link_bytes_per_s: float | None = None, max_iteration_s: float = 0.1, push_tokens: int = 4096,
              kv_bytes_per_block: int | None = None, on_handle: Callable | None = None,
              charge_tokens: bool = False) -> PDVirtualEngine:
    """One P (``role="prefill"``) or D engine on ``fabric``: ``scheduler_cls`` with ``NixlConnector``
    (``kv_producer`` / ``kv_consumer``), the shadow section's ``pd`` set to this role and
    deployment, and a :class:`NixlTransferWorker` (a D's inbound link at ``link_bytes_per_s``)."""
    extra = dict(config.additional_config)
    if "shadowprefill" in extra:
        extra["shadowprefill"] = {**extra["shadowprefill"], "instance_id": name,
                                  "pd": {"role": role, "max_iteration_s": max_iteration_s, "push_tokens": push_tokens}}
    config = attrs.evolve(config, additional_config=extra)
    kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
    sched = build_scheduler(scheduler_cls, config, nixl_config(kv_role, name))
    engine = PDVirtualEngine(sched, latency, loop, clock, name=name, on_handle=on_handle, model_name=model)
    (group,) = sched.kv_cache_config.kv_cache_groups
    per_block = kv_bytes_per_block or group.kv_cache_spec.page_size_bytes * len(group.layer_names)
    engine.offload = NixlTransferWorker(engine, fabric, per_block, link_bytes_per_s if role == "decode" else None,
                                        charge_tokens)
    fabric.engines[name] = engine
    return engine


@attrs.define(eq=False)
class PDVirtualRun:
    """The fake backend's scenario (same draws as the simulator's P/D run) on P and D vLLM
    schedulers in virtual time. ``pd`` is the simulator's ``PDConfig`` (P and D engines per model,
    link bandwidth per D, push size, P iteration cap); ``engine_config`` gives each model's vLLM
    limits (its ``additional_config`` holds the shadow policy; the P/D role is added here);
    ``shadow_feeder`` turns the manager's jobs into shadow requests on P engines."""

    scenario: Any
    shadow: Any  # ShadowConfig
    pd: Any  # shadow_sim.simulator.PDConfig (or anything with its fields)
    latency: Mapping[str, LatencyModel]
    engine_config: Mapping[str, VirtualEngineConfig]
    prefill_cls: type | None = None
    decode_cls: type | None = None
    shadow_feeder: Callable[[PDVirtualRun], None] | None = None
    workload: Any = None
    #: The link's bytes per block, per model (default: the virtual model's), and whether a read is
    #: charged by its tokens (the simulator's accounting) rather than its whole blocks.
    kv_bytes_per_block: Mapping[str, int] | None = None
    charge_tokens: bool = False
    decode_latency: LatencyModel | None = None  # every D engine's (default: its model's in ``latency``)
    loop: EventLoop = attrs.field(init=False, factory=EventLoop)
    clock: Any = attrs.field(init=False)
    fabric: PDFabric = attrs.field(init=False, factory=PDFabric)
    cluster: VirtualCluster = attrs.field(init=False)
    decode: dict[str, list[PDVirtualEngine]] = attrs.field(init=False)
    runtime: Any = attrs.field(init=False)
    driver: SessionDriver = attrs.field(init=False)
    sticky: dict[tuple[str, str], PDVirtualEngine] = attrs.field(init=False, factory=dict)
    offers: dict[tuple[str, str], tuple[str, str, int]] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        from shadow_vllm.virtual.clock import VirtualClock

        self.clock = VirtualClock()
        sc = self.scenario
        prefill = {m: [self._engine(m, f"{m}/p{k}", "prefill") for k in range(self.pd.num_prefill)]
                   for m in sc.models}
        self.decode = {m: [self._engine(m, f"{m}/d{k}", "decode") for k in range(self.pd.num_decode)]
                       for m in sc.models}
        self.cluster = VirtualCluster(self.loop, prefill)
        self.runtime = build_runtime(self.shadow, self.cluster, sc.models)
        if self.workload is None:
            self.workload = draw_workload(sc, list(self.cluster.by_id))
        self.driver = SessionDriver(self.loop, self.runtime.manager, self)

    def _engine(self, model: str, name: str, role: str) -> PDVirtualEngine:
        latency = self.decode_latency if role == "decode" and self.decode_latency is not None else self.latency[model]
        return pd_engine(role, name, model, latency, self.engine_config[model], self.fabric, self.loop,
                         self.clock, self.prefill_cls if role == "prefill" else self.decode_cls,
                         self.pd.link_bytes_per_s, self.pd.max_iteration_s, self.pd.push_tokens,
                         (self.kv_bytes_per_block or {}).get(model), self._on_handle, self.charge_tokens)

    @property
    def by_id(self) -> dict[str, PDVirtualEngine]:
        return dict(self.fabric.engines)

    @property
    def calls(self) -> list:
        return self.driver.calls

    def run(self) -> PDVirtualRun:
        self.driver.schedule(self.workload, list(self.cluster.by_id))
        self.loop.run()
        return self

    # -- placement ------------------------------------------------------------------------
    def sticky_decode(self, session_id: str, model: str) -> PDVirtualEngine:
        d = self.sticky.get((session_id, model))
        if d is None:
            d = self.sticky[(session_id, model)] = self._least_loaded(model)
        return d

    def _least_loaded(self, model: str) -> PDVirtualEngine:
        ds = self.decode[model]
        return min(ds, key=lambda d: (len(d.scheduler.running) + len(d.scheduler.waiting), ds.index(d)))

    # -- the driver's serving port --------------------------------------------------------------
    def input_token_ids(self, session_id: str, call_index: int, model: str, num_tokens: int) -> tuple[int, ...]:
        vocab = self.cluster.by_model[model][0].scheduler.vllm_config.model_config.get_vocab_size()
        return tuple(session_tokens(session_id, call_index, num_tokens, vocab))

    def start_call(self, request_id: str, placement: Any, history: Any, num_output_tokens: int,
                   on_tokens: Callable, on_finish: Callable[[CallOutcome], None]) -> None:
        from shadow_vllm.pd import PREFILL_KV_PARAMS

        if self.shadow_feeder is not None:
            self.shadow_feeder(self)
        p = self.cluster.by_id[placement.instance_id]
        tag = ShadowTag(TagKind.ROUTED, history.session_id).to_extra_args()
        prompt = list(history.token_ids)

        def handoff(pre: VirtualRequest) -> None:
            if num_output_tokens <= 1 or pre.finish_reason == "abort":
                on_finish(CallOutcome(False, pre.arrival_s, pre.first_token_s, pre.finish_s, len(prompt),
                                      pre.num_cached_tokens or 0))
                return
            d = self.sticky_decode(history.session_id, p.model_name)
            d.add_request(f"{request_id}@d", prompt, num_output_tokens - 1,
                          extra_args={**tag, "kv_transfer_params": p.kv_params.get(request_id)},
                          on_token=lambda r, tok: self._token(on_tokens, tok),
                          on_finish=lambda r: on_finish(CallOutcome(
                              False, pre.arrival_s, pre.first_token_s, r.finish_s, len(prompt),
                              pre.num_cached_tokens or 0)))

        p.add_request(request_id, prompt, 1, extra_args={**tag, "kv_transfer_params": dict(PREFILL_KV_PARAMS)},
                      on_token=lambda r, tok: self._token(on_tokens, tok), on_finish=handoff)

    def start_normal(self, request_id: str, instance_id: str, num_prompt_tokens: int, num_output_tokens: int,
                     prefix: Any = None) -> None:
        from shadow_vllm.pd import PREFILL_KV_PARAMS

        p = self.cluster.by_id[instance_id]
        vocab = p.scheduler.vllm_config.model_config.get_vocab_size()
        shared = [] if prefix is None else prefix.token_ids(num_prompt_tokens, vocab)  # as VirtualScenarioRun
        prompt = shared + [hashed_token(request_id, i, vocab) for i in range(len(shared), num_prompt_tokens)]

        def handoff(pre: VirtualRequest) -> None:
            if num_output_tokens > 1 and pre.finish_reason != "abort":
                self._least_loaded(p.model_name).add_request(
                    f"{request_id}@d", prompt, num_output_tokens - 1,
                    extra_args={"kv_transfer_params": p.kv_params.get(request_id)})

        p.add_request(request_id, prompt, 1, extra_args={"kv_transfer_params": dict(PREFILL_KV_PARAMS)},
                      on_finish=handoff)

    def settle(self) -> None:
        if self.shadow_feeder is not None:
            self.shadow_feeder(self)
        self._end_stale_offers()
        self.cluster.kick_all()

    def _token(self, on_tokens: Callable, token: int) -> None:
        on_tokens(1, [token])
        if self.shadow_feeder is not None:
            self.shadow_feeder(self)
        self._end_stale_offers()

    # -- push offers -----------------------------------------------------------------------
    def _on_handle(self, engine: PDVirtualEngine, request_id: str, params: dict) -> None:
        """A shadow finished on P with a handle: offer it to the session's sticky D of its target."""
        tag = parse_tag(engine.extra.get(request_id))
        if tag is None or not tag.is_shadow or not params.get("remote_block_ids") \
                or not any(params["remote_block_ids"]):
            return
        d = self.sticky_decode(tag.session_id, tag.target_model)
        key = (tag.session_id, tag.target_model)
        prev = self.offers.pop(key, None)
        if prev is not None and prev[0] != d.name:
            self.fabric.engines[prev[0]].abort([prev[1]])
        rid = f"push:{request_id}"
        self.offers[key] = (d.name, rid, tag.epoch)
        d.add_request(rid, list(engine.requests[request_id].prompt_token_ids), 1,
                      extra_args={**tag.to_extra_args(), "kv_transfer_params": params}, kick=False)
        d.wake()

    def _end_stale_offers(self) -> None:
        """An offer whose job is gone (or moved to a new epoch) ends on D, as the gateway ends it."""
        if not self.offers:
            return
        live = {(j.key.session_id, j.key.target_model): j for j in self.runtime.manager.jobs()}
        for key, (d_name, rid, epoch) in list(self.offers.items()):
            job = live.get(key)
            d = self.fabric.engines[d_name]
            if job is None or job.history.epoch != epoch or d.requests[rid].finish_s is not None:
                del self.offers[key]
                if d.requests[rid].finish_s is None:
                    d.abort([rid])
