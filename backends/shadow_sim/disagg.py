"""Prefill/decode disaggregation in the simulator (§3.5, Appendix C).

Each model has prefill (P) and decode (D) instances (default 3P:1D). The
router side (:class:`~shadowcore.manager.ShadowManager`) sees only P
instances: routed calls and normal requests prefill there and leave P at their
first token. Their KV then crosses the inbound link of a D instance (sticky per
session and model for routed calls; least loaded for normal requests), where
the request decodes. A D instance keeps each session's context in its prefix
cache (normal class), so a transfer sends only the tokens D lacks.

Shadow jobs run on the session's sticky P instance of the other model, under
the policy's ``prefill_slack`` (the paper's policies:
:class:`~shadowcore.slack.PrefillInstanceController`, iterations of at most
0.1 s, empty queue, TTFT slack). Whenever a D instance's link carries no
normal transfer, it asks the policy's ``push`` policy (the paper's:
:class:`~shadowcore.pd.ShadowPushPolicy`, at most 4K tokens, most likely
switch first) for the next push and inserts the pushed blocks into its shadow class,
which is reclaimed first. At the switch, P prefills only the tail and the
transfer sends only what D still lacks.

Invariants (tested in ``tests/sim/test_disagg.py``):

* One transfer at a time per link; normal transfers are FIFO and go before any
  push; a push starts only when no normal transfer is on the link or waiting,
  and is never preempted (a normal transfer waits at most one push).
* A transfer sends exactly the prompt tokens D holds neither on the device nor
  in its host tier when it starts (oracle prefixes are free).
* A push is whole blocks, at most ``push_tokens``, at most D's shadow room,
  starts where D's held prefix ends and never exceeds what P holds on device.
* A request decodes on D only after its transfer ended; D's shadow class never
  exceeds its cap (the KV class manager's rule).

Determinism: everything runs from the run's one event loop; link completions
use the ``STEP_END`` tie-break kind (a completion frees its resource before
work arriving at the same instant), then insertion order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import ClassVar

import attrs

from shadow_sim.simulator import PDConfig, SimRun
from shadowcore.engine.cluster import EngineCluster
from shadowcore.engine.instance import EngineInstance, EngineRequest
from shadowcore.engine.kinds import STEP_END
from shadowcore.engine.workload import NormalRequest, draw_normal, normal_requests
from shadowcore.events import EventLoop
from shadowcore.hook import EngineHook
from shadowcore.kv import KVClass, KVClassManager
from shadowcore.manager import ShadowManager
from shadowcore.pd import DecodeLinkView, PushCandidate, PushGrant, PushPolicy, backing_off
from shadowcore.types import RequestKind

__all__ = [
    "DecodeInstance", "KVFabric", "KVLink", "LinkRecord", "PDCluster", "PDConfig", "PDRun",
    "PrefillInstance", "TransferRecord",
]

#: Link completions share the step-end tie-break class.
LINK_END = STEP_END


def _held_blocks(kv: KVClassManager, hashes: Sequence[int], device_only: bool = False) -> int:
    """Length of the contiguous prefix of ``hashes`` the pool holds (device,
    or device and host tier in any interleaving)."""
    n = 0
    for h in hashes:
        if not (kv.is_cached(h) or (not device_only and kv.in_host(h))):
            break
        n += 1
    return n


# -- engines -------------------------------------------------------------------------


@attrs.define(eq=False)
class PrefillInstance(EngineInstance):
    """A prefill-only instance: every request it runs has exactly one output
    token (it leaves at its first token). After an iteration that computed
    shadow tokens it calls ``on_shadow`` (the fabric then offers pushes)."""

    on_shadow: Callable[[PrefillInstance], None] | None = None

    def enqueue(self, req: EngineRequest) -> None:
        if req.num_output_tokens != 1:
            raise ValueError(f"{self.instance_id}: prefill instance got {req.request_id} with "
                             f"{req.num_output_tokens} output tokens (must be 1)")
        super().enqueue(req)

    def end_step(self, now_s: float) -> None:
        before = self.num_shadow_tokens
        super().end_step(now_s)
        if self.num_shadow_tokens != before and self.on_shadow is not None:
            self.on_shadow(self)


@attrs.define(eq=False)
class DecodeInstance(EngineInstance):
    """A decode instance: requests arrive with their prompt's KV transferred.

    ``pins`` holds, per request whose transfer was pinned, the KV owner that
    keeps the prompt's full blocks resident from transfer start to admission,
    and the host-tier reload time that pin cost. At first admission the pin is
    released into the request's own blocks and the whole prompt counts as
    computed (the partial last block arrived with the transfer); a request
    without a pin, or re-admitted after preemption, recomputes what it misses.
    """

    pins: dict[str, tuple[str, float]] = attrs.Factory(dict)
    after_step: Callable[[DecodeInstance], None] | None = None

    def _admit(self, req: EngineRequest, now_s: float) -> bool:
        if not super()._admit(req, now_s):
            return False
        pin = self.pins.pop(req.request_id, None)
        if pin is not None:
            owner, reload_s = pin
            self.kv.release(owner, now_s)
            req.pending_reload_s += reload_s
            req.num_computed_tokens = req.num_tokens - 1
        return True

    def end_step(self, now_s: float) -> None:
        super().end_step(now_s)
        if self.after_step is not None:
            self.after_step(self)


# -- the KV fabric -------------------------------------------------------------------


@attrs.frozen
class LinkRecord:
    """One use of a link: a normal transfer (``request_id``) or a push (``job``)."""

    kind: str  # "normal" | "push"
    decode_id: str
    start_s: float
    end_s: float
    start_token: int  # D's held prefix when it started
    num_tokens: int
    num_bytes: float
    num_waiting_normal: int  # normal transfers queued when it started
    request_id: str | None = None
    job: object = None


@attrs.frozen
class TransferRecord:
    """The KV transfer of one request: ready at P's first token, on the link
    from ``start_s`` to ``end_s``."""

    request_id: str
    decode_id: str
    ready_s: float
    start_s: float
    end_s: float
    num_prompt_tokens: int
    num_tokens: int  # sent
    num_bytes: float
    pinned: bool


@attrs.define(eq=False)
class KVLink:
    """The inbound KV link of one decode instance (one transfer at a time)."""

    decode: DecodeInstance
    bytes_per_s: float
    queue: deque = attrs.Factory(deque)  # (request, ready_s), FIFO
    busy: str | None = None  # "normal" | "push" | None
    starved: bool = False  # pushable shadow KV waits for D room
    records: list[LinkRecord] = attrs.Factory(list)


@attrs.define(eq=False)
class KVFabric:
    """Moves KV from P to D instances: normal transfers and shadow pushes."""

    loop: EventLoop
    cluster: PDCluster
    manager: ShadowManager
    push_policy: PushPolicy
    links: dict[str, KVLink]  # decode instance id -> its inbound link
    sticky: dict[tuple[str, str], DecodeInstance] = attrs.Factory(dict)  # (session, model) -> D
    transfers: dict[str, TransferRecord] = attrs.Factory(dict)
    num_normal_bytes: float = 0.0
    num_shadow_bytes: float = 0.0
    num_pushed_tokens: int = 0  # inserted into D's shadow class
    num_dropped_push_tokens: int = 0  # arrived but could not be inserted
    num_unpinned: int = 0
    num_backoffs: int = 0  # candidates skipped: D lost their pushed KV recently
    _pushed: dict = attrs.Factory(dict)  # job -> (epoch, pushed up to token, end of last push)

    # -- placement ----------------------------------------------------------------
    def decode_for(self, req: EngineRequest, model: str) -> DecodeInstance:
        """Routed calls: the session's sticky D of ``model``; normal: least loaded."""
        if req.kind is RequestKind.ROUTED:
            return self.sticky_decode(req.history.session_id, model)
        return self._least_loaded(model)

    def sticky_decode(self, session_id: str, model: str) -> DecodeInstance:
        d = self.sticky.get((session_id, model))
        if d is None:
            d = self.sticky[(session_id, model)] = self._least_loaded(model)
        return d

    def _least_loaded(self, model: str) -> DecodeInstance:
        ds = self.cluster.decode[model]
        return min(ds, key=lambda d: (len(d.running) + len(d.waiting) + len(self.links[d.instance_id].queue),
                                      ds.index(d)))

    # -- normal transfers -----------------------------------------------------------
    def handoff(self, pre: EngineRequest, req: EngineRequest, model: str) -> None:
        """``pre`` finished on P (its first token): ``req`` continues on D after
        its KV crossed D's link. A rejected prefill rejects the request."""
        now = self.loop.now_s
        if pre.rejected:
            req.rejected, req.finish_s = True, now
            if req.on_finish is not None:
                req.on_finish(req, now)
            return
        req.first_token_s, req.num_generated, req.num_cached_tokens = pre.first_token_s, 1, pre.num_cached_tokens
        if req.num_generated >= req.num_output_tokens:  # nothing to decode: no transfer
            req.finish_s = now
            if req.on_finish is not None:
                req.on_finish(req, now)
            return
        link = self.links[self.decode_for(req, model).instance_id]
        link.queue.append((req, now))
        self.pump(link)

    def pump(self, link: KVLink) -> None:
        """Start the next use of an idle link: a queued normal transfer, else a push."""
        if link.busy is not None:
            return
        if link.queue:
            req, ready_s = link.queue.popleft()
            self._start_transfer(link, req, ready_s)
        else:
            self._try_push(link)

    def _start_transfer(self, link: KVLink, req: EngineRequest, ready_s: float) -> None:
        """Send the prompt tokens D lacks now; pin the prompt's blocks on D."""
        d, now = link.decode, self.loop.now_s
        bs, num_prompt = d.kv.block_size, req.num_tokens - 1
        hashes = req.history.block_hashes(bs, num_prompt // bs)
        if req.num_oracle_tokens:  # oracle: the prefix is on D for free
            _insert(d.kv, f"oracle-xfer:{req.request_id}", hashes[: req.num_oracle_tokens // bs],
                    KVClass.NORMAL, now)
        held = _held_blocks(d.kv, hashes) * bs
        num_tokens = num_prompt - held
        num_bytes = num_tokens * d.kv.kv_bytes_per_token
        pinned = self._pin(d, req, hashes, now)
        end = now + num_bytes / link.bytes_per_s
        link.busy = "normal"
        self.num_normal_bytes += num_bytes
        link.records.append(LinkRecord("normal", d.instance_id, now, end, held, num_tokens, num_bytes,
                                       len(link.queue), request_id=req.request_id))
        self.transfers[req.request_id] = TransferRecord(req.request_id, d.instance_id, ready_s, now, end,
                                                        num_prompt, num_tokens, num_bytes, pinned)
        self.loop.at(end, LINK_END, lambda t: self._end_transfer(link, req))

    def _pin(self, d: DecodeInstance, req: EngineRequest, hashes: list[int], now_s: float) -> bool:
        """Reserve the prompt's full blocks on D (held ones and arriving ones)."""
        bs = d.kv.block_size
        if -(-(req.num_tokens + 1) // bs) > d.kv.num_blocks:
            return False  # D will reject it: nothing to reserve
        owner = f"xfer:{req.request_id}"
        alloc = d.kv.allocate(owner, hashes, 0, KVClass.NORMAL, now_s)
        if alloc is None:
            self.num_unpinned += 1
            return False
        d.pins[req.request_id] = (owner, alloc.reload_s)
        return True

    def _end_transfer(self, link: KVLink, req: EngineRequest) -> None:
        link.busy = None
        d = link.decode
        d.enqueue(req)
        self.cluster.kick(d)
        self.pump(link)

    # -- shadow pushes ----------------------------------------------------------------
    def on_prefill_shadow(self, p: PrefillInstance) -> None:
        """P computed shadow tokens: offer pushes on its model's idle links."""
        for d in self.cluster.decode[p.model]:
            self.pump(self.links[d.instance_id])

    def on_decode_step(self, d: DecodeInstance) -> None:
        """D ran an iteration (memory may have freed): retry a starved link."""
        link = self.links[d.instance_id]
        if link.starved and link.busy is None:
            self.pump(link)

    def candidates(self, d: DecodeInstance) -> tuple[list[PushCandidate], dict]:
        """Jobs whose sticky D is ``d`` and whose P holds (on device) more of
        the history than ``d`` holds; with each job's block hashes."""
        bs = d.kv.block_size
        out, hashes_by_job = [], {}
        for job in self.manager.jobs():
            if job.key.target_model != d.model or self.sticky_decode(job.key.session_id, d.model) is not d:
                continue
            hashes = job.history.block_hashes(bs)
            d_held = _held_blocks(d.kv, hashes)
            if self._backing_off(job.key, job.history.epoch, d_held * bs, d):
                continue
            p_held = _held_blocks(self.cluster.by_id[job.instance_id].kv, hashes, device_only=True)
            if p_held > d_held:
                out.append(PushCandidate(job.key, p_held * bs, d_held * bs, job.switch_probability))
                hashes_by_job[job.key] = (hashes, job.history.epoch)
        return out, hashes_by_job

    def _backing_off(self, job: object, epoch: int, d_held: int, d: DecodeInstance) -> bool:
        """Anti-churn: D lacks KV pushed for ``job`` (lost, or dropped on
        arrival: its prefix ends below the pushed end) and the last push ended
        less than ``cold_age_s`` ago. D
        reclaims shadow blocks first, so under memory pressure an immediate
        re-push would be lost again; this is the cold-age rule of shadow
        allocations applied to pushes."""
        if not backing_off(self._pushed.get(job), epoch, d_held, self.loop.now_s, d.kv.policy.cold_age_s):
            return False
        self.num_backoffs += 1
        return True

    def _try_push(self, link: KVLink) -> None:
        """Ask the push policy for the next push onto an idle link."""
        d, now = link.decode, self.loop.now_s
        cands, hashes_by_job = self.candidates(d)
        if not cands:
            link.starved = False
            return
        view = DecodeLinkView(d.instance_id, bool(link.queue), d.kv.shadow_room_blocks(now) * d.kv.block_size)
        grant = self.push_policy.pull(view, cands)
        link.starved = grant is None and any(c.num_pushable_tokens >= d.kv.block_size for c in cands)
        if grant is not None:
            self._start_push(link, grant, *hashes_by_job[grant.job])

    def _start_push(self, link: KVLink, grant: PushGrant, hashes: list[int], epoch: int) -> None:
        d, now, bs = link.decode, self.loop.now_s, link.decode.kv.block_size
        num_bytes = grant.num_tokens * d.kv.kv_bytes_per_token
        end = now + num_bytes / link.bytes_per_s
        link.busy = "push"
        self.num_shadow_bytes += num_bytes
        link.records.append(LinkRecord("push", d.instance_id, now, end, grant.start_token, grant.num_tokens,
                                       num_bytes, len(link.queue), job=grant.job))
        first, last = grant.start_token // bs, (grant.start_token + grant.num_tokens) // bs
        self.loop.at(end, LINK_END, lambda t: self._end_push(link, grant, hashes[:last], first, epoch))

    def _end_push(self, link: KVLink, grant: PushGrant, hashes: list[int], first: int, epoch: int) -> None:
        """Insert the pushed blocks into D's shadow class if they still extend
        D's held prefix (else, or without room, they are dropped)."""
        link.busy = None
        d, now = link.decode, self.loop.now_s
        sid = grant.job.session_id
        fresh = sid in self.manager and self.manager.history(sid).epoch == epoch
        owner = f"push:{grant.job.session_id}:{grant.job.target_model}:{grant.start_token}"
        if fresh and _held_blocks(d.kv, hashes[:first]) == first and _insert(
                d.kv, owner, hashes[first:], KVClass.SHADOW, now):
            self.num_pushed_tokens += grant.num_tokens
        else:
            self.num_dropped_push_tokens += grant.num_tokens
        self._pushed[grant.job] = (epoch, grant.start_token + grant.num_tokens, now)  # lost or dropped: back off
        self.pump(link)


def _insert(kv: KVClassManager, owner: str, hashes: Sequence[int], kv_class: KVClass, now_s: float) -> bool:
    """Cache ``hashes`` in ``kv_class`` (idle, evictable); False without room."""
    if not hashes:
        return True
    if kv.allocate(owner, hashes, 0, kv_class, now_s) is None:
        return False
    kv.release(owner, now_s)
    return True


# -- the run -------------------------------------------------------------------------


@attrs.define(eq=False)
class PDCluster(EngineCluster):
    """``by_model`` (what the router side sees) lists prefill instances only;
    ``decode`` the decode instances per model; ``by_id`` every instance."""

    decode: dict[str, list[DecodeInstance]] = attrs.Factory(dict)


@attrs.define(eq=False)
class PDRun(SimRun):
    """A :class:`~shadow_sim.simulator.SimScenario` with ``pd`` set.

    Normal traffic: ``normal_rate_per_s`` stays a per-instance rate of the
    cluster, so each model's ``num_prefill + num_decode`` instances receive the
    same total as a colocated cluster of that size, spread over its P
    instances. ``instances_per_model`` is not used.
    """

    fabric: KVFabric | None = attrs.field(init=False, default=None)
    #: The decode instance's pin names a request's prompt blocks (``KVFabric._pin``): not private.
    private_normal_kv: ClassVar[bool] = False

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        pd: PDConfig = self.scenario.pd
        links = {d.instance_id: KVLink(d, pd.link_bytes_per_s * d.num_gpus)
                 for ds in self.cluster.decode.values() for d in ds}
        policy = self.runtime.push_policy(pd.push_tokens, self.scenario.block_size)
        self.fabric = KVFabric(self.loop, self.cluster, self.runtime.manager, policy, links)
        for inst in self.cluster.by_id.values():
            if isinstance(inst, PrefillInstance):
                inst.on_shadow = self.fabric.on_prefill_shadow
            elif isinstance(inst, DecodeInstance):
                inst.after_step = self.fabric.on_decode_step

    def build_cluster(self, extra: int) -> PDCluster:
        sc, pd = self.scenario, self.scenario.pd
        kv = self.policy.kv
        prefill = {m: [self.build_instance(f"{m}/p{k}", m, kv, PrefillInstance) for k in range(pd.num_prefill + extra)]
                   for m in sc.models}
        decode = {m: [self.build_instance(f"{m}/d{k}", m, kv, DecodeInstance) for k in range(pd.num_decode)]
                  for m in sc.models}
        by_id = {i.instance_id: i for insts in (*prefill.values(), *decode.values()) for i in insts}
        return PDCluster(self.loop, prefill, by_id, window_tokens=self.placement_window_tokens(), decode=decode)

    def attach_hook(self, inst: EngineInstance) -> EngineHook | None:
        """P instances: the policy's hook with its ``prefill_slack``. D instances: no shadow work."""
        if not isinstance(inst, PrefillInstance):
            return None
        return self.runtime.attach(inst.instance_id, inst, inst.latency,
                                   prefill_iteration_s=self.scenario.pd.max_iteration_s)

    def serving_instances(self) -> list[str]:
        """The P instances (not the dedicated ones): the router side sees only them."""
        return [i.instance_id for insts in self.cluster.by_model.values() for i in insts
                if i.instance_id not in self._dedicated]

    def normal_traffic(self) -> tuple[NormalRequest, ...]:
        pd = self.scenario.pd
        rate = self.scenario.normal_rate_per_s * (pd.num_prefill + pd.num_decode) / pd.num_prefill
        return normal_requests((inst, draw_normal(self.scenario, k, rate))
                               for k, inst in enumerate(self.serving_instances()))

    def _enqueue(self, inst: EngineInstance, req: EngineRequest) -> None:
        """``req`` prefills on P as a one-token request, then moves to D."""
        pre = EngineRequest(
            req.request_id, req.kind, req.history, req.num_prompt_tokens, 1, req.arrival_s, req.ttft_slo_s,
            req.tpot_slo_s, num_oracle_tokens=req.num_oracle_tokens, on_token=req.on_token,
            on_finish=lambda r, t, d=req, m=inst.model: self.fabric.handoff(r, d, m),
        )
        super()._enqueue(inst, pre)

    def summary(self) -> dict[str, float]:
        out = super().summary()
        f, insts = self.fabric, self.cluster.by_id.values()
        bs = self.scenario.block_size
        out["shadow_tokens_used"] = float(sum(i.kv.num_shadow_blocks_used * bs for i in insts
                                              if isinstance(i, PrefillInstance)))
        out["kv_bytes_normal"] = f.num_normal_bytes
        out["kv_bytes_shadow"] = f.num_shadow_bytes
        out["pushed_tokens"] = float(f.num_pushed_tokens)
        out["pushed_tokens_dropped"] = float(f.num_dropped_push_tokens)
        out["pushed_tokens_used"] = float(sum(i.kv.num_shadow_blocks_used * bs for i in insts
                                              if isinstance(i, DecodeInstance)))
        out["unpinned_transfers"] = float(f.num_unpinned)
        out.update(self._transfer_means())
        return out

    def _transfer_means(self) -> dict[str, float]:
        """Per measured call: bytes sent and time from P's first token to D."""
        warm = [c for c in self.calls if c.arrival_s >= self.scenario.warmup_s]
        out = {}
        for name, calls in (("call", warm), ("switch", [c for c in warm if c.is_switch])):
            recs = [self.fabric.transfers.get(f"{c.session_id}#{c.call_index}") for c in calls]
            recs = [r for r in recs if r is not None]
            out[f"{name}_transfer_bytes"] = _mean([r.num_bytes for r in recs])
            out[f"{name}_transfer_wait_s"] = _mean([r.end_s - r.ready_s for r in recs])
        return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
