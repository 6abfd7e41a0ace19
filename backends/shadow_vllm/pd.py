"""P/D disaggregation on vLLM (paper §3.5): the prefill-role and decode-role
shadow schedulers, driven by the same P/D policy objects as the simulator
(:mod:`shadow_sim.disagg`).

Load them as any scheduler, with the KV connector vLLM is configured with
(``--kv-transfer-config``; docs/vllm.md, "P/D engines")::

    P: --scheduler-cls shadow_vllm.pd.PrefillShadowScheduler
       --kv-transfer-config '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}'
    D: --scheduler-cls shadow_vllm.pd.DecodeShadowScheduler
       --kv-transfer-config '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}'

both with ``--additional-config '{"shadowprefill": {..., "pd": {"role": ...}}}'``
(:class:`~shadow_vllm.engine_config.PDEngineConfig`; the role defaults to the
class's).

**P side** (:class:`PrefillShadowScheduler`): the shadow scheduler of
:mod:`shadow_vllm.scheduler` whose slack controller is the policy's
``prefill_slack`` built with ``pd.max_iteration_s`` (the paper's policies:
:class:`~shadowcore.slack.PrefillInstanceController`: empty queue, TTFT
slack, iterations of at most 0.1 s), exactly as
:meth:`shadowcore.pipeline.ShadowRuntime.attach` builds it for a simulated P
instance. A shadow request without ``kv_transfer_params`` gets
:data:`PREFILL_KV_PARAMS` (``do_remote_decode``), so its KV goes through the
engine's KV connector like any P/D prefill's: the connector's
``request_finished`` sees the blocks of its last chunk (the whole computed
prefix) and, for ``NixlConnector``, holds them for a decode engine to read
and returns the handle (``kv_transfer_params``) in the request's output.

**D side** (:class:`DecodeShadowScheduler`): normal and routed requests
(their remote prefill included) are vLLM's, untouched: vLLM's connector loads
only the tokens beyond D's local prefix hit, so a switch call's transfer sends
only what D lacks. A shadow-tagged request is a *push offer*: a shadow prefix
that a P engine holds, with P's ``kv_transfer_params``. It is kept out of
vLLM's queues; after vLLM has scheduled each step, while no push is in flight,
the core's :class:`~shadowcore.pd.PushPolicy` (the policy's ``push`` recipe,
``pd.push_tokens``) is asked for the next push, with the link busy while a
normal transfer is in flight or waits (a non-push request in
``WAITING_FOR_REMOTE_KVS``, or waiting with ``do_remote_prefill``), D's
shadow room as its free memory, and one candidate per offer (P's prefix, D's
prefix-cache hit, the tag's switch probability). A grant is an asynchronous
connector load of exactly its tokens into blocks allocated as a shadow
allocation of the KV bridge (:mod:`shadow_vllm.kvpool`): the reclaim-first
class (shadow-first eviction, cap, cold age, promotion on a normal hit).
When vLLM reports the load finished the blocks are cached and released, idle
in that class. An offer ends (``shadowprefill:prefilled``) once D holds all of
it, after its one push when a read spends its handle (``pushed``, below), or
when superseded by a newer offer of its (session, target).

Invariants (``tests/vllm/test_pd.py``, ``tests/vllm/test_pd_agreement.py``):

* P: the controller is the policy's ``prefill_slack`` with the engine's
  ``max_iteration_s`` (the policy's ``slack`` where it has none); every other
  rule is the shadow scheduler's.
* D: at most one push in flight; no push starts while a normal transfer is in
  flight or waits; a push is whole blocks, at most ``push_tokens``, at most
  D's shadow room, starts at D's prefix-cache hit and never goes beyond P's
  prefix (the push policy's rules, checked here again on the grant); pushed
  blocks are shadow-class blocks; normal and routed work is scheduled
  exactly as stock vLLM schedules it (pushes are admitted after it, and take
  only what the shadow room allows).
* D: the anti-churn rule of the simulator's fabric: an offer whose pushed KV D
  no longer holds is not pushed again until ``cold_age_s`` after that push
  ended.

* D, handles: with a connector whose read spends the handle
  (``NixlConnector``: P frees a finished request's blocks once D read them,
  :func:`shadow_vllm.vllm_internals.releases_on_read`) an offer serves one
  push, then ends (``shadowprefill:pushed held=<tokens>``; what is left needs
  a new offer, with a new handle); with any other asynchronous connector an
  offer is read again for each push until D holds all of it. An offer that
  ends unread gives its handle back through the connector (re-armed, so
  ``NixlConnector`` sends its notify-only read and P frees the blocks).

Not here: a synchronous connector load on D (``ExampleConnector``) is not
used for pushes (no push starts; the connector still serves normal
transfers).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import attrs
import numpy as np

from shadow_vllm import vllm_internals
from shadow_vllm.connector_loads import ConnectorLoads
from shadow_vllm.engine_config import EngineShadowConfig, PDEngineConfig
from shadow_vllm.kvpool import ShadowKVBridge
from shadow_vllm.scheduler import ShadowSchedulerMixin, _NoCluster, finish_shadows
from shadow_vllm.vllm_internals import (
    AsyncScheduler,
    EngineCoreOutputs,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerOutput,
)
from shadowcore.errors import ConfigError
from shadowcore.pd import DecodeLinkView, PushCandidate, PushDecision, PushGrant, backing_off
from shadowcore.pipeline import build_runtime
from shadowcore.types import JobKey
from shadowcore.wire import PREFILL_KV_PARAMS, ShadowEnd, ShadowStop, ShadowTag, TagKind, parse_tag

__all__ = [
    "PREFILL_KV_PARAMS", "AsyncDecodeShadowScheduler", "AsyncPrefillShadowScheduler", "DecodePushMixin",
    "DecodeShadowScheduler", "PrefillShadowMixin", "PrefillShadowScheduler", "PushStats",
]

logger = logging.getLogger("shadow_vllm.scheduler")



def _pd_config(config: EngineShadowConfig, role: str) -> PDEngineConfig:
    pd = config.pd or PDEngineConfig(role)
    if pd.role != role:
        raise ConfigError("additional_config.shadowprefill.pd.role", pd.role,
                          f"this scheduler is the {role} engine's (use the {pd.role} scheduler of shadow_vllm.pd)")
    return pd


def _check_connector(vllm_config: Any, role: str) -> None:
    kv = getattr(vllm_config, "kv_transfer_config", None)
    want = "is_kv_producer" if role == "prefill" else "is_kv_consumer"
    if kv is None or not getattr(kv, want, False):
        raise ConfigError("kv_transfer_config", None if kv is None else kv.kv_role,
                          f"a {role}-role shadow scheduler needs a KV connector with kv_role "
                          f"{'kv_producer' if role == 'prefill' else 'kv_consumer'} (or kv_both)")


# -- P side ------------------------------------------------------------------------------


class PrefillShadowMixin(ShadowSchedulerMixin):
    """The shadow scheduler of a prefill-role engine (put it first)."""

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        _check_connector(vllm_config, "prefill")
        self.shadow_pd = _pd_config(EngineShadowConfig.from_vllm(vllm_config), "prefill")
        super().__init__(vllm_config, *args, **kwargs)

    def _shadow_build_slack(self, runtime: Any, config: EngineShadowConfig, rng: np.random.Generator) -> Any:
        """The policy's ``prefill_slack`` with this engine's ``max_iteration_s`` (as
        ``ShadowRuntime.attach(..., prefill_iteration_s=...)``), else its ``slack``."""
        recipe = runtime.policy.prefill_slack
        if recipe is None:
            return runtime.policy.slack.build(rng)
        return recipe.build(rng, max_iteration_s=self.shadow_pd.max_iteration_s)

    def _shadow_open(self, request: Request, tag: ShadowTag) -> None:
        if request.kv_transfer_params is None:  # saved for a decode engine like any P/D prefill
            request.kv_transfer_params = dict(PREFILL_KV_PARAMS)
        super()._shadow_open(request, tag)


class PrefillShadowScheduler(PrefillShadowMixin, Scheduler):
    """Shadow prefill on a P/D prefill engine, vLLM's synchronous ``Scheduler``."""


class AsyncPrefillShadowScheduler(PrefillShadowMixin, AsyncScheduler):
    """Shadow prefill on a P/D prefill engine, vLLM's ``AsyncScheduler``."""


# -- D side ------------------------------------------------------------------------------


@attrs.define
class PushStats:
    """Counters of one D engine's pushes."""

    num_offers: int = 0
    num_pushes: int = 0
    num_pushed_tokens: int = 0  # loaded into the shadow class
    num_dropped_push_tokens: int = 0  # granted, but the load did not start or failed
    num_backoffs: int = 0
    num_ended: dict[str, int] = attrs.Factory(dict)


class _Offer(NamedTuple):
    request: Request
    tag: ShadowTag
    params: dict[str, Any]  # P's kv_transfer_params as offered (re-armed before each push)
    num_prefill_tokens: int  # P's prefix, whole blocks


class _Push(NamedTuple):
    request_id: str
    grant: PushGrant
    epoch: int


class DecodePushMixin(ConnectorLoads):
    """Shadow pushes on a decode-role engine (put it first)."""

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        _check_connector(vllm_config, "decode")
        config = EngineShadowConfig.from_vllm(vllm_config)
        self.shadow_pd = _pd_config(config, "decode")
        super().__init__(vllm_config, *args, **kwargs)
        runtime = build_runtime(config.shadow, _NoCluster(), ())
        self.shadow_config = config
        self.shadow_clock: Callable[[], float] = time.monotonic
        self.shadow_bridge = ShadowKVBridge(self.kv_cache_manager.block_pool, runtime.policy.kv,
                                            lambda: self.shadow_clock(), lazy=True)
        self.shadow_push_policy = runtime.push_policy(self.shadow_pd.push_tokens, self.block_size)
        self.shadow_push_stats = PushStats()
        self.shadow_push_decisions: list[PushDecision] = []
        self.shadow_offers: dict[JobKey, _Offer] = {}
        self._shadow_offer_key: dict[str, JobKey] = {}  # request id -> its offer's key (until freed)
        self._shadow_offer_params: dict[str, dict[str, Any]] = {}  # request id -> P's handle as offered
        self.shadow_push_inflight: _Push | None = None
        self.shadow_to_finish: dict[str, tuple[RequestStatus, str]] = {}
        self._shadow_pushed: dict[JobKey, tuple[int, int, float]] = {}  # (epoch, pushed up to, end s)
        self._shadow_defer_meta = False
        self._shadow_deferred_meta: tuple[Any, Any] | None = None
        self._shadow_last_inputs: tuple | None = None
        self._shadow_policy_warned = False
        #: One read spends a handle (NixlConnector: P frees the blocks once D read them): an offer
        #: then serves one push; else one offer serves pushes until D holds all of it.
        self.shadow_one_read = self.connector is not None and vllm_internals.releases_on_read(self.connector)
        vllm_internals.check_scheduler(self)

    # -- offers ------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        super().add_request(request)
        if self.requests.get(request.request_id) is not request:
            return
        params = request.sampling_params
        try:
            tag = parse_tag(params.extra_args if params is not None else None)
        except ValueError as e:
            self._shadow_reject(request, f"bad shadowprefill tag: {e}")
            return
        if tag is None or tag.kind is not TagKind.SHADOW:
            return
        self._shadow_park(request)
        offer = request.kv_transfer_params
        if not offer or not (offer.get("do_remote_prefill") or offer.get("remote_block_ids")):
            self._shadow_reject(request, "a push offer needs the prefill engine's kv_transfer_params")
            return
        key = JobKey(tag.session_id, tag.target_model)
        old = self.shadow_offers.get(key)
        if old is not None:  # ends saying what D holds of it (the gateway records that)
            held = int(self.kv_cache_manager.get_computed_blocks(old.request)[1])
            self._shadow_end(old.request.request_id, RequestStatus.FINISHED_ABORTED,
                             ShadowStop(ShadowEnd.SUPERSEDED, held).to_stop_reason())
        remote = offer.get("remote_num_tokens") or request.num_prompt_tokens
        num_prefill = min(int(remote), request.num_prompt_tokens) // self.block_size * self.block_size
        self.shadow_offers[key] = _Offer(request, tag, dict(offer), num_prefill)
        self._shadow_offer_key[request.request_id] = key
        self._shadow_offer_params[request.request_id] = dict(offer)
        self.shadow_push_stats.num_offers += 1
        self.shadow_bridge.attach()

    def _shadow_park(self, request: Request) -> None:
        self.waiting.remove_requests((request,))
        self.kv_holding_waiting.remove_requests((request,))
        self.deferred_waiting.discard(request)

    def _shadow_reject(self, request: Request, why: str) -> None:
        self._shadow_park(request)
        logger.error("request %s: %s", request.request_id, why)
        self.shadow_to_finish[request.request_id] = (
            RequestStatus.FINISHED_ERROR, ShadowStop(ShadowEnd.REJECTED, None, why).to_stop_reason())

    def _shadow_end(self, request_id: str, status: RequestStatus, reason: str) -> None:
        """End an offer (at the next ``update_from_output``, with an output for its client)."""
        key = self._shadow_offer_key.get(request_id)
        if key is not None and self.shadow_offers.get(key) is not None \
                and self.shadow_offers[key].request.request_id == request_id:
            del self.shadow_offers[key]
        self.shadow_to_finish.setdefault(request_id, (status, reason))

    def _free_request(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        rid = request.request_id
        key = self._shadow_offer_key.pop(rid, None)
        offer = self.shadow_offers.get(key) if key is not None else None
        if offer is not None and offer.request is request:
            del self.shadow_offers[key]
        params = self._shadow_offer_params.pop(rid, None)
        if params is not None:
            # Re-armed, so that the connector releases P's handle as for any remote prefill
            # that ends unread (NixlConnector: a notify-only read).
            request.kv_transfer_params = dict(params)
        self.shadow_to_finish.pop(rid, None)
        if self.shadow_push_inflight is not None and self.shadow_push_inflight.request_id == rid:
            self.shadow_push_inflight = None  # vLLM frees its blocks when the load ends (not cached)
        return super()._free_request(request, *args, **kwargs)

    def get_num_unfinished_requests(self) -> int:
        return super().get_num_unfinished_requests() + len(self.shadow_offers)

    # -- one step ----------------------------------------------------------------------
    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        may_push = bool(self.shadow_offers) and self.shadow_push_inflight is None
        self._shadow_defer_meta = may_push and self.connector is not None
        try:
            out = super().schedule(*args, **kwargs)
        finally:
            self._shadow_defer_meta = False
        try:
            if may_push:
                self._shadow_try_push(out, self.shadow_clock())
        finally:
            if self._shadow_deferred_meta is not None:
                self._shadow_build_connector_meta(out)
        return out

    def _shadow_link_busy(self) -> bool:
        """A normal transfer is in flight or waits for D's inbound link."""
        for request in self.requests.values():
            rid = request.request_id
            if rid in self._shadow_offer_key:
                continue
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                return True
            params = request.kv_transfer_params
            if request.status == RequestStatus.WAITING and params and params.get("do_remote_prefill"):
                return True
        return False

    def _shadow_candidates(self, now_s: float) -> list[PushCandidate]:
        out = []
        cold_age_s = self.shadow_bridge.policy.cold_age_s
        for key, offer in self.shadow_offers.items():
            if offer.request.request_id in self.shadow_to_finish:
                continue
            d_held = int(self.kv_cache_manager.get_computed_blocks(offer.request)[1])
            if backing_off(self._shadow_pushed.get(key), offer.tag.epoch, d_held, now_s, cold_age_s):
                self.shadow_push_stats.num_backoffs += 1  # anti-churn (the core's rule, as the simulator's fabric)
                continue
            if offer.num_prefill_tokens > d_held:
                out.append(PushCandidate(key, offer.num_prefill_tokens, d_held, offer.tag.switch_probability))
        return out

    def _shadow_try_push(self, out: SchedulerOutput, now_s: float) -> None:
        candidates = self._shadow_candidates(now_s)
        if not candidates:
            return
        room = self.shadow_bridge.shadow_room_blocks(now_s) * self.block_size
        view = DecodeLinkView(self.shadow_config.instance_id, self._shadow_link_busy(), room)
        grant = self.shadow_push_policy.pull(view, candidates)
        self._shadow_record(view, candidates, grant, now_s)
        if grant is not None and self._shadow_grant_ok(grant, view, candidates):
            self._shadow_start_push(out, self.shadow_offers[grant.job], grant, now_s)

    def _shadow_record(self, view: DecodeLinkView, candidates: list[PushCandidate], grant: PushGrant | None,
                       now_s: float) -> None:
        """Keep the decision when its inputs changed since the last one (agreement records)."""
        decision = PushDecision.of(view, candidates, grant, now_s)
        if decision.inputs == self._shadow_last_inputs and grant is None:
            return
        self._shadow_last_inputs = decision.inputs
        self.shadow_push_decisions.append(decision)

    def _shadow_grant_ok(self, grant: PushGrant, view: DecodeLinkView, candidates: list[PushCandidate]) -> bool:
        """The push rules a third-party policy must keep: a grant that breaks one is logged (one
        clear error naming the rule) and dropped; shadow work never fails the engine."""
        cand = next((c for c in candidates if c.job == grant.job), None)
        bs = self.block_size
        problem = None
        if cand is None:
            problem = "granted a job that is not a candidate"
        elif view.link_busy:
            problem = "granted a push while a normal transfer is in flight or waits"
        elif grant.start_token != cand.num_decode_held_tokens:
            problem = f"push starts at {grant.start_token}, D holds {cand.num_decode_held_tokens}"
        elif grant.num_tokens <= 0 or grant.num_tokens % bs or grant.num_tokens > self.shadow_pd.push_tokens \
                or grant.num_tokens > view.num_free_tokens or grant.num_tokens > cand.num_pushable_tokens:
            problem = (f"push of {grant.num_tokens} tokens (whole blocks of {bs}, at most push_tokens "
                       f"{self.shadow_pd.push_tokens}, free {view.num_free_tokens}, pushable {cand.num_pushable_tokens})")
        if problem is None:
            return True
        level = logging.DEBUG if self._shadow_policy_warned else logging.ERROR  # once, then quietly
        self._shadow_policy_warned = True
        logger.log(level, "push policy %s on %s: %s; push dropped", type(self.shadow_push_policy).__name__,
                   self.shadow_config.instance_id, problem)
        self.shadow_push_stats.num_dropped_push_tokens += max(0, grant.num_tokens)
        return False

    def _shadow_start_push(self, out: SchedulerOutput, offer: _Offer, grant: PushGrant, now_s: float) -> None:
        """An asynchronous connector load of exactly the grant's tokens into shadow-class blocks."""
        request, connector = offer.request, self.connector
        rid = request.request_id
        stats = self.shadow_push_stats
        request.kv_transfer_params = dict(offer.params)  # re-armed: one read per push
        if self.shadow_one_read:  # this read spends the handle: nothing to release when the offer ends
            self._shadow_offer_params.pop(rid, None)
        blocks, num_hit, _ = self.kv_cache_manager.get_computed_blocks(request)
        try:
            num_external, load_async = connector.get_num_new_matched_tokens(request, num_hit)
        except Exception:
            logger.exception("push %s: the KV connector failed; push dropped", rid)
            num_external, load_async = None, False
        if num_hit != grant.start_token or not num_external or num_external < grant.num_tokens or not load_async:
            if num_external and not load_async:
                logger.warning("push %s: the connector loads synchronously; pushes need an asynchronous one", rid)
            stats.num_dropped_push_tokens += grant.num_tokens
            return
        with self.shadow_bridge.shadow_allocation(now_s, (b for group in blocks.blocks for b in group)):
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, 0, num_new_computed_tokens=num_hit, new_computed_blocks=blocks,
                num_external_computed_tokens=grant.num_tokens, delay_cache_blocks=True,
                skip_zeroing_group_ids=connector.get_loaded_kv_cache_group_ids(request),
            )
        if new_blocks is None:
            stats.num_dropped_push_tokens += grant.num_tokens
            return
        connector.update_state_after_alloc(request, self.kv_cache_manager.get_blocks(rid), grant.num_tokens)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_computed_tokens = num_hit + grant.num_tokens
        zero = self._get_new_block_ids_to_zero()
        if zero:
            out.new_block_ids_to_zero = (out.new_block_ids_to_zero or []) + zero
        self.shadow_push_inflight = _Push(rid, grant, offer.tag.epoch)
        stats.num_pushes += 1

    # -- the step's output ---------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output: Any) -> Any:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        push = self.shadow_push_inflight
        if push is not None and push.request_id in self.finished_recving_kv_req_ids:
            self._shadow_end_push(push)
        if self.shadow_to_finish:
            self._shadow_finish(outputs)
        return outputs

    def _shadow_end_push(self, push: _Push) -> None:
        """The load finished: its blocks are cached (vLLM's own ``_update_waiting_for_remote_kv``; a
        failed load caches its valid prefix) and released, idle in the shadow class."""
        self.shadow_push_inflight = None
        request = self.requests[push.request_id]
        failed = push.request_id in self.failed_recving_kv_req_ids
        self._update_waiting_for_remote_kv(request)
        self._free_request_blocks(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        now_s = self.shadow_clock()
        grant = push.grant
        stats = self.shadow_push_stats
        if failed:
            stats.num_dropped_push_tokens += grant.num_tokens
        else:
            stats.num_pushed_tokens += grant.num_tokens
        self._shadow_pushed[grant.job] = (push.epoch, grant.start_token + grant.num_tokens, now_s)
        offer = self.shadow_offers.get(grant.job)
        if offer is not None and offer.request is request:
            held = int(self.kv_cache_manager.get_computed_blocks(request)[1])
            if held >= offer.num_prefill_tokens or held >= (request.num_tokens - 1) // self.block_size * self.block_size:
                self._shadow_end(push.request_id, RequestStatus.FINISHED_STOPPED,
                                 ShadowStop(ShadowEnd.PREFILLED, held).to_stop_reason())
            elif self.shadow_one_read:  # the handle is spent: the rest needs a new offer
                self._shadow_end(push.request_id, RequestStatus.FINISHED_STOPPED,
                                 ShadowStop(ShadowEnd.PUSHED, held).to_stop_reason())

    def _shadow_finish(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        todo, self.shadow_to_finish = self.shadow_to_finish, {}
        finish_shadows(self, todo, outputs, self.shadow_push_stats.num_ended)


class DecodeShadowScheduler(DecodePushMixin, Scheduler):
    """Shadow pushes on a P/D decode engine, vLLM's synchronous ``Scheduler``."""


class AsyncDecodeShadowScheduler(DecodePushMixin, AsyncScheduler):
    """Shadow pushes on a P/D decode engine, vLLM's ``AsyncScheduler``."""
