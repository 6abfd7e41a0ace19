"""Shadow submission: turns the ShadowManager's pending jobs into requests to
the instances of the models the router did not choose.

One lane (an asyncio task) per instance wakes whenever a session's history
grows or a submission ends, and hands out that instance's pending jobs in the
manager's order (non-increasing switch probability). How a job reaches the
instance depends on what the instance runs:

* ``scheduler: shadow`` (the shadow scheduler of ``shadow_vllm``): a request
  tagged with :class:`shadowcore.wire.ShadowTag` whose prompt is the session
  context as token ids (whole blocks) with ``max_tokens`` 1; the engine runs
  it only in slack. Up to ``max_inflight_per_instance`` jobs in flight.
* ``scheduler: stock`` (stock vLLM): the request-level mode of Appendix D.1,
  run by :class:`shadow_gateway.request_level.RequestLevelShadower` with this
  module's HTTP submit: after a session's routed call completes, its context
  goes to each stock instance that holds one of the session's jobs, at the
  lowest priority with one output token, at most one in flight per instance,
  only while the destination's waiting queue (its ``/metrics``) is empty;
  a newer call supersedes a pending shadow.

Invariants:

* Shadow requests use their own connection pool and timeouts; a failure (dead
  or hung instance, 5xx, timeout) commits zero tokens to the job, counts an
  error and keeps the instance from shadow work for ``backoff_s``; it never
  raises into a routed call, and no routed call waits on a lane.
* At most one request per job is in flight; a job's held prefix advances only
  by what the instance says it holds when the request ended: the whole
  submitted prefix for a completed request, the ``held=`` count of its
  :class:`shadowcore.wire.ShadowStop` when the shadow scheduler ended it
  early (a tail below its ``n_min``, a policy that runs no shadows).
* A job the instance ended early is not sent again until its context grows
  (or a new epoch starts): resending the same prefix would end the same way.
* Unhealthy and ejected instances get no shadow work (dropped first).
* A lane fills at most once per ``fill_interval_s``, and wakes are coalesced
  per event-loop turn: per-token growth of a streaming call costs the routed
  path one scheduled callback, not a pass over every lane's jobs.
* Requests go through an aiohttp session (C-accelerated parsing); the
  routed path's session is a different one.
* P/D models: shadow jobs run on prefill instances only (decode instances
  get no lane); a shadow request to a P instance carries
  ``kv_transfer_params`` with ``do_remote_decode`` (P keeps the KV for D), and
  every shadow prefix P finished is offered to :class:`shadow_gateway.pd.Pusher`,
  which moves it toward the session's sticky D.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
import attrs

from shadow_gateway.cluster import GatewayCluster, InstanceState
from shadow_gateway.config import InstanceRole, PDConfig, SchedulerKind, ShadowSubmitConfig
from shadow_gateway.metrics import GatewayMetrics
from shadow_gateway.offload import Offloader, encode
from shadow_gateway.pd import Push, Pusher
from shadowcore.job import ShadowJob, token_array
from shadowcore.manager import ShadowManager
from shadowcore.types import JobKey
from shadowcore.wire import PREFILL_KV_PARAMS, ShadowEnd, ShadowTag, TagKind, parse_stop

log = logging.getLogger("shadow_gateway.shadow")
JSON_HEADERS = {"content-type": "application/json"}


@attrs.define(eq=False)
class Lane:
    instance: InstanceState
    wake: asyncio.Event = attrs.Factory(asyncio.Event)
    inflight: dict[JobKey, asyncio.Task] = attrs.Factory(dict)
    task: asyncio.Task | None = None
    last_fill_s: float = float("-inf")
    declined: dict[JobKey, tuple[int, int]] = attrs.Factory(dict)  # (epoch, target tokens) the instance ended early


@attrs.define(eq=False)
class ShadowDispatcher:
    manager: ShadowManager
    cluster: GatewayCluster
    config: ShadowSubmitConfig
    metrics: GatewayMetrics
    offload: Offloader | None = None  # large shadow bodies encoded off the event loop
    #: Body fields every shadow of a session carries (the gateway's per-tenant ``cache_salt``).
    session_fields: Any = lambda _session_id: {}
    pd: PDConfig = attrs.Factory(PDConfig)
    client: aiohttp.ClientSession = attrs.field(init=False)
    pusher: Pusher = attrs.field(init=False)
    lanes: dict[str, Lane] = attrs.field(init=False, factory=dict)
    request_level: Any = attrs.field(init=False, default=None)  # RequestLevelShadower when stock instances exist
    _num_waiting: dict[str, int] = attrs.field(init=False, factory=dict)
    _rl_tasks: set[asyncio.Task] = attrs.field(init=False, factory=set)
    _rl_context: dict[tuple[str, str], list[int]] = attrs.field(init=False, factory=dict)
    _rl_pump_scheduled: bool = attrs.field(init=False, default=False)
    _closed: bool = attrs.field(init=False, default=False)
    _wake_scheduled: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        self.pusher = Pusher(self.cluster, self.pd, self.metrics, is_live=self.is_live)

    def is_live(self, session_id: str) -> bool:
        """Whether the session has not ended: a shadow or a push that finishes
        after its session ended records nothing (no prefix known, no sticky D),
        so an ended session keeps no entry whatever was in flight."""
        return session_id in self.manager

    def start(self) -> None:
        c = self.config
        self.client = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=c.timeout_s, sock_connect=c.connect_timeout_s),
            connector=aiohttp.TCPConnector(limit=max(8, 2 * c.max_inflight_per_instance * len(self.cluster.by_id))),
            skip_auto_headers=("User-Agent",),
        )
        self.pusher.client = self.client
        stock = [i for i in self.cluster.by_id.values() if i.scheduler is SchedulerKind.STOCK]
        if stock:
            from shadow_gateway.request_level import RequestLevelShadower

            self.request_level = RequestLevelShadower(self._rl_submit, lambda i: self._num_waiting.get(i, 1))
        for inst in self.cluster.by_id.values():
            if inst.scheduler is SchedulerKind.STOCK or inst.role is InstanceRole.DECODE:
                continue
            lane = Lane(inst)
            lane.task = asyncio.create_task(self._run(lane), name=f"shadow-lane-{inst.id}")
            self.lanes[inst.id] = lane

    async def close(self) -> None:
        self._closed = True
        tasks = [t for lane in self.lanes.values() for t in (lane.task, *lane.inflight.values()) if t]
        tasks += list(self._rl_tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.pusher.close()
        await self.client.close()

    def wake_all(self) -> None:
        """Wake every lane once, after the caller's callback returns: many
        wakes within one event-loop turn (every chunk of every stream) cost
        one pass over the lanes, and the routed call never runs a lane's code."""
        if self._wake_scheduled or not self.lanes:
            return
        self._wake_scheduled = True
        asyncio.get_running_loop().call_soon(self._wake_lanes)

    def _wake_lanes(self) -> None:
        self._wake_scheduled = False
        for lane in self.lanes.values():
            lane.wake.set()

    def wake_later(self, lane: Lane, delay_s: float) -> None:
        asyncio.get_running_loop().call_later(delay_s, lane.wake.set)

    # -- the lane -------------------------------------------------------------------------
    async def _run(self, lane: Lane) -> None:
        while not self._closed:
            await lane.wake.wait()
            wait_s = lane.last_fill_s + self.config.fill_interval_s - time.monotonic()
            if wait_s > 0:
                await asyncio.sleep(wait_s)  # wakes meanwhile are served by this fill
            lane.wake.clear()
            lane.last_fill_s = time.monotonic()
            try:
                await self._fill(lane)
            except asyncio.CancelledError:
                raise
            except Exception:  # a lane must never die: log, count, carry on
                log.exception("shadow lane %s failed", lane.instance.id)
                self.metrics.errors.labels("shadow", lane.instance.id).inc()

    async def _fill(self, lane: Lane) -> None:
        inst = lane.instance
        if not inst.healthy:
            return  # the health checker wakes every lane when it comes back
        now = time.monotonic()
        if inst.ejected:
            self.wake_later(lane, inst.ejected_until_s - now)
            return
        if now < inst.shadow_blocked_until_s:
            self.wake_later(lane, inst.shadow_blocked_until_s - now)
            return
        pending = self.manager.pending_jobs(inst.id)
        if lane.declined:  # forget declines of jobs that grew, moved on to a new epoch or ended
            lane.declined = {j.key: mark for j in pending if (mark := lane.declined.get(j.key))
                             == (j.history.epoch, j.num_target_tokens)}
        for job in pending:
            if len(lane.inflight) >= self.config.max_inflight_per_instance:
                return
            if job.key not in lane.inflight and job.key not in lane.declined:
                self._submit(lane, job)

    def _submit(self, lane: Lane, job: ShadowJob) -> None:
        inst = lane.instance
        history = job.history
        job.refresh(self.cluster.cached_prefix_tokens(inst.id, history), 0)
        num_missing = job.num_missing_tokens
        if num_missing <= 0 or history.token_ids is None:
            return
        ids, target, epoch = history.token_ids, job.num_target_tokens, history.epoch
        start = job.reserve(num_missing)
        tag = ShadowTag(TagKind.SHADOW, job.key.session_id, job.key.target_model, epoch, job.switch_probability)
        body = {"model": inst.model.upstream_name, "prompt": ids[:target], "max_tokens": 1,
                "vllm_xargs": tag.to_extra_args(), **self.session_fields(job.key.session_id)}
        if inst.role is InstanceRole.PREFILL:
            body["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
        task = asyncio.create_task(self._send(lane, job, body, ids, target, epoch, start, num_missing))
        lane.inflight[job.key] = task

    async def _send(self, lane: Lane, job: ShadowJob, body: dict, ids: Sequence[int], target: int, epoch: int,
                    start: int, num_missing: int) -> None:
        inst = lane.instance
        try:
            outcome, num_held, kv_params = await self._post(inst, body, target)
        except asyncio.CancelledError:
            job.commit(epoch, start, num_missing, 0)
            raise
        finally:
            lane.inflight.pop(job.key, None)
        num_computed = max(0, min(num_held, target) - start)
        job.commit(epoch, start, num_missing, num_computed)
        if outcome == "partial":
            lane.declined[job.key] = (epoch, target)
        self._account(inst, "tagged", outcome, job.key.session_id, ids, num_held, num_computed)
        self._offer_push(inst, outcome, job.key.session_id, ids, num_held, kv_params)
        lane.wake.set()

    def _offer_push(self, inst: InstanceState, outcome: str, session_id: str, ids: Sequence[int], num_held: int,
                    kv_params: dict | None) -> None:
        """A shadow prefix a P instance finished goes toward the session's sticky D (P/D models)."""
        if inst.role is not InstanceRole.PREFILL or outcome not in ("completed", "partial") or num_held <= 0:
            return
        try:
            job = self.manager.job(JobKey(session_id, inst.model.name))
            self.pusher.offer(Push(session_id, inst.model.name, ids, num_held, kv_params,
                                   self.session_fields(session_id),
                                   job.switch_probability if job is not None else 1.0,
                                   job.history.epoch if job is not None else 0))
        except Exception:  # a push must never break a lane
            log.exception("push offer for %s failed", inst.id)
            self.metrics.errors.labels("push", inst.id).inc()

    async def _post(self, inst: InstanceState, body: dict, num_prompt_tokens: int) -> tuple[str, int, dict | None]:
        """POST one shadow request of ``num_prompt_tokens``; returns the outcome
        (``completed``, ``partial``: ended early by the shadow scheduler,
        ``aborted``, or a failure), the prompt tokens the instance holds for it,
        and the ``kv_transfer_params`` it answered (P instances of P/D models)."""
        mode = "request-level" if inst.scheduler is SchedulerKind.STOCK else "tagged"
        num_held, kv_params = 0, None
        try:
            data = await self.offload.encode(body) if self.offload is not None else encode(body)
            async with self.client.post(f"{inst.url}/v1/completions", data=data,
                                        headers={**JSON_HEADERS, **inst.config.auth_headers}) as r:
                if r.status != 200:
                    outcome = f"http-{r.status // 100}xx"
                else:
                    data = json.loads(await r.read())
                    choice = (data.get("choices") or [{}])[0]
                    outcome, num_held = _shadow_outcome(choice, num_prompt_tokens)
                    kv_params = data.get("kv_transfer_params") if isinstance(data.get("kv_transfer_params"),
                                                                              dict) else None
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError, AttributeError) as e:
            outcome = "timeout" if isinstance(e, TimeoutError) else "failed"
            if isinstance(e, ValueError):
                log.warning("shadow request to %s: %s", inst.id, e)
        self.metrics.shadow_requests.labels(inst.model.name, mode, outcome).inc()
        return outcome, num_held, kv_params

    def _account(self, inst: InstanceState, mode: str, outcome: str, session_id: str, ids: Sequence[int],
                 num_context: int, num_tokens: int) -> None:
        if outcome in ("completed", "partial"):
            if self.is_live(session_id):
                self.cluster.record_shadow(inst.id, session_id, ids, num_context)
            self.metrics.shadow_tokens_submitted.labels(inst.model.name, mode).inc(num_tokens)
        else:
            self.metrics.errors.labels("shadow", inst.id).inc()
            inst.shadow_blocked_until_s = time.monotonic() + self.config.backoff_s

    def forget_session(self, session_id: str) -> None:
        """Drop everything kept for the session (it ended): its request-level
        context and pending request-level shadows, its lanes' declines."""
        for inst in self.cluster.by_id.values():
            if self._rl_context.pop((inst.id, session_id), None) is not None and self.request_level is not None:
                self.request_level.on_call_arrival(session_id, inst.id)  # drops a pending shadow there
        for lane in self.lanes.values():
            if lane.declined:
                for model in self.manager.models:
                    lane.declined.pop(JobKey(session_id, model), None)
        self.pusher.forget_session(session_id)

    def num_session_entries(self) -> int:
        """Per-session entries kept (request-level contexts, declines, pending pushes): 0 once every session ended."""
        return (len(self._rl_context) + sum(len(lane.declined) for lane in self.lanes.values())
                + self.pusher.num_session_entries())

    # -- request-level mode (stock instances) ------------------------------------------------
    def on_call_arrival(self, session_id: str, instance_id: str) -> None:
        if self.request_level is not None:
            self.request_level.on_call_arrival(session_id, instance_id)

    def on_call_complete(self, session_id: str) -> None:
        """Queue the session's context for the stock instances that hold its jobs."""
        if self.request_level is None or session_id not in self.manager:
            return
        from shadow_gateway.request_level import Destination

        history = self.manager.history(session_id)
        if history.token_ids is None or not history.num_tokens:
            return
        dests = []
        for model in self.manager.models:
            job = self.manager.job(JobKey(session_id, model))
            inst = self.cluster.by_id.get(job.instance_id) if job is not None else None
            if inst is None or inst.scheduler is not SchedulerKind.STOCK or not inst.available:
                continue
            if time.monotonic() < inst.shadow_blocked_until_s:
                self.metrics.fallbacks.labels("shadow-dropped-backoff").inc()
                continue
            dests.append(Destination(inst.id, model))
            self._rl_context[(inst.id, session_id)] = history.token_ids
        if dests:
            self.request_level.on_call_complete(session_id, history.token_ids[: history.num_tokens], (), dests)
            self._schedule_rl_pump()

    def _schedule_rl_pump(self, delay_s: float = 0.0) -> None:
        if self._rl_pump_scheduled or self._closed:
            return
        self._rl_pump_scheduled = True

        async def pump() -> None:
            if delay_s:
                await asyncio.sleep(delay_s)
            self._rl_pump_scheduled = False
            await self._rl_pump()

        t = asyncio.create_task(pump())
        self._rl_tasks.add(t)
        t.add_done_callback(self._rl_tasks.discard)

    async def _rl_pump(self) -> None:
        """Read the waiting queue of each stock instance with a pending shadow
        and no shadow in flight, then let the shadower admit what may go."""
        rl = self.request_level
        ready = [i for i, inst in self.cluster.by_id.items() if inst.scheduler is SchedulerKind.STOCK
                 and rl.pending(i) and rl.inflight(i) is None]
        for instance_id in ready:
            self._num_waiting[instance_id] = await self._read_waiting(self.cluster.by_id[instance_id])
        deferred_before = rl.stats.num_deferred
        rl.pump()
        if rl.stats.num_deferred > deferred_before:
            self._schedule_rl_pump(self.config.poll_interval_s)

    async def _read_waiting(self, inst: InstanceState) -> int:
        from shadow_gateway.request_level import parse_num_waiting

        if not inst.healthy:
            return 1  # nothing goes to an unhealthy instance
        try:
            async with self.client.get(f"{inst.url}/metrics", headers=inst.config.auth_headers,
                                       timeout=aiohttp.ClientTimeout(total=self.config.connect_timeout_s)) as r:
                r.raise_for_status()
                return parse_num_waiting(await r.text(), f"{inst.url}/metrics")
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
            self.metrics.errors.labels("shadow", inst.id).inc()
            return 1

    def _rl_submit(self, shadow: Any) -> None:
        """The shadower's submit: POST in the background, report the end."""
        from shadow_gateway.request_level import completions_body

        inst = self.cluster.by_id[shadow.destination.instance_id]
        body = completions_body(shadow, inst.model.upstream_name)
        body["priority"] = self.config.request_level_priority
        body.update(self.session_fields(shadow.session_id))
        if inst.role is InstanceRole.PREFILL:
            body["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
        ids = self._rl_context.get((inst.id, shadow.session_id))

        async def send() -> None:
            num_prompt = len(shadow.prompt_token_ids)
            outcome, num_held, kv_params = await self._post(inst, body, num_prompt)
            if ids is not None and ids[:num_prompt] == token_array(shadow.prompt_token_ids):
                self._account(inst, "request-level", outcome, shadow.session_id, ids, num_held, num_held)
                self._offer_push(inst, outcome, shadow.session_id, ids, num_held, kv_params)
            self.request_level.on_shadow_finished(shadow.submission_id, outcome == "completed")
            self._schedule_rl_pump()

        t = asyncio.create_task(send())
        self._rl_tasks.add(t)
        t.add_done_callback(self._rl_tasks.discard)


def _shadow_outcome(choice: dict, num_prompt_tokens: int) -> tuple[str, int]:
    """Outcome and prompt tokens held, from one completion choice of a shadow
    request. A stock instance ends it after one token (``completed``, the
    whole prompt held); the shadow scheduler says how it ended in
    ``stop_reason`` (:func:`shadowcore.wire.parse_stop`; a malformed one
    raises ``ValueError``, counted as a failure)."""
    if choice.get("finish_reason") == "abort":
        return "aborted", 0
    stop = parse_stop(choice.get("stop_reason"))
    if stop is None or stop.end is ShadowEnd.PREFILLED:
        return "completed", num_prompt_tokens
    return "partial", min(stop.num_held_tokens or 0, num_prompt_tokens)
