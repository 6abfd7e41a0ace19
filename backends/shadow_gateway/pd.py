"""P/D deployments: vLLM's disaggregated-serving protocol, and shadow pushes.

A model with prefill (P) and decode (D) instances (``prefill_instances`` /
``decode_instances`` in the configuration) serves a call in two requests, as
vLLM's own disaggregated proxies do:

1. to P: the call's body with one output token, not streamed, and
   ``kv_transfer_params`` = :data:`PREFILL_KV_PARAMS` (``do_remote_decode``:
   P keeps the KV for a D instance to take);
2. to D: the call's body as the client sent it, with the ``kv_transfer_params``
   P answered (``do_remote_prefill`` and where the blocks are, for
   ``NixlConnector``; ``null`` for connectors that move KV by content, such as
   ``ExampleConnector``, whose D finds P's KV by the prompt's tokens).

Shadow jobs of a P/D model run on the session's sticky P (the core sees only
P instances). :class:`Pusher` then moves each shadow prefix P finished toward
the session's sticky D of that model (paper §3.5): a request for the prefix
with one output token and P's ``kv_transfer_params``, so D takes the KV over
its connector and keeps it in its prefix cache; at the switch call, D's
connector sends only the tokens D lacks. To a ``scheduler: stock`` D the
push is a plain request at ``pd.push_priority``; to a ``scheduler: shadow`` D
(``shadow_vllm.pd.DecodeShadowScheduler``) it is a shadow-tagged *push
offer* that D's own push policy pulls in pushes of its size, when its link
carries no normal transfer, into its reclaim-first shadow class.

Invariants:

* At most one push in flight per D instance (its inbound link), and none
  while a routed call's KV is on its way to it (``num_transfers_inflight``):
  normal transfers go first. A newer push of the same (session, model)
  replaces a pending one.
* A push never fails or delays a routed call: its own connection pool (the
  shadow dispatcher's), its own timeout; a failure counts an error and
  records nothing as held.
* A push is skipped when the D instance is already expected to hold the
  prefix (a routed call or an earlier push left it there).
* What D is expected to hold after a push is what it says it holds: the
  whole prefix for a plain answer or ``shadowprefill:prefilled``, the
  ``held=`` count of ``shadowprefill:pushed`` (a NIXL handle serves one read:
  the rest waits for the next shadow of the session on P, whose answer
  brings a new handle) or of ``superseded``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
import attrs

from shadow_gateway.cluster import GatewayCluster, InstanceState
from shadow_gateway.config import PDConfig, SchedulerKind
from shadow_gateway.metrics import GatewayMetrics
from shadowcore.wire import PREFILL_KV_PARAMS, ShadowEnd, ShadowTag, TagKind, parse_stop

log = logging.getLogger("shadow_gateway.pd")
JSON_HEADERS = {"content-type": "application/json"}



def prefill_body(upstream_body: dict[str, Any]) -> dict[str, Any]:
    """The P request of a call: its upstream body, one output token, not
    streamed, ``kv_transfer_params`` asking P to keep the KV for D."""
    out = dict(upstream_body)
    out["stream"] = False
    out.pop("stream_options", None)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    return out


def decode_fields(prefill_response: dict[str, Any]) -> dict[str, Any]:
    """Fields the D request adds: P's ``kv_transfer_params`` when it answered some."""
    params = prefill_response.get("kv_transfer_params")
    return {"kv_transfer_params": params} if isinstance(params, dict) else {}


@attrs.frozen
class Push:
    """One shadow prefix for a D instance."""

    session_id: str
    model: str
    token_ids: Sequence[int] = attrs.field(eq=False, repr=False)
    num_tokens: int
    kv_transfer_params: dict[str, Any] | None = attrs.field(eq=False, repr=False)
    cache_fields: dict[str, str] = attrs.field(factory=dict, eq=False, repr=False)
    switch_probability: float = 1.0  # the job's, for a D-role shadow scheduler's push policy
    epoch: int = 0


@attrs.define(eq=False)
class Pusher:
    """Moves finished shadow prefixes from P toward the sticky D (one lane per D instance)."""

    cluster: GatewayCluster
    config: PDConfig
    metrics: GatewayMetrics
    client: aiohttp.ClientSession | None = None  # set by the dispatcher at start
    #: whether a session has not ended: an offer or a finished push of an ended one records nothing
    is_live: Callable[[str], bool] = lambda _session_id: True
    pending: dict[str, OrderedDict[tuple[str, str], Push]] = attrs.field(factory=dict)
    inflight: dict[str, asyncio.Task] = attrs.field(factory=dict)
    _closed: bool = False

    def offer(self, push: Push) -> None:
        """A shadow prefix P finished: queue it for the session's sticky D of ``push.model``."""
        if (not self.config.push or self._closed or not self.cluster.is_pd(push.model)
                or not self.is_live(push.session_id)):
            return
        dest = self.cluster.decode_for(push.session_id, push.model)
        block = dest.model.block_size
        if push.num_tokens - push.num_tokens % block <= self._held(dest, push):
            self.metrics.pushes.labels(push.model, "skipped-held").inc()
            return
        queue = self.pending.setdefault(dest.id, OrderedDict())
        queue.pop((push.session_id, push.model), None)
        queue[(push.session_id, push.model)] = push
        self.pump()

    def _held(self, dest: InstanceState, push: Push) -> int:
        known = dest.known.get(push.session_id)
        return max(known.matched(push.token_ids, push.num_tokens)) if known is not None else 0

    def pump(self) -> None:
        """Start a push on every D instance with one pending, none in flight, and no routed transfer."""
        if self._closed:
            return
        for dest_id, queue in self.pending.items():
            if not queue or dest_id in self.inflight:
                continue
            dest = self.cluster.by_id[dest_id]
            if dest.num_transfers_inflight or not dest.available or time.monotonic() < dest.shadow_blocked_until_s:
                continue
            _, push = queue.popitem(last=False)
            self.inflight[dest_id] = asyncio.create_task(self._send(dest, push), name=f"push-{dest_id}")

    async def _send(self, dest: InstanceState, push: Push) -> None:
        try:
            outcome, num_held = await self._post(dest, push)
        finally:
            self.inflight.pop(dest.id, None)
        self.metrics.pushes.labels(push.model, outcome).inc()
        if outcome in ("completed", "partial", "superseded"):
            before = self._held(dest, push)
            if num_held > before:
                if self.is_live(push.session_id):  # an ended session keeps no entry
                    self.cluster.record_shadow(dest.id, push.session_id, push.token_ids, num_held)
                self.metrics.push_tokens.labels(push.model).inc(num_held - before)
        else:
            self.metrics.errors.labels("push", dest.id).inc()
            dest.shadow_blocked_until_s = time.monotonic() + 1.0
            asyncio.get_running_loop().call_later(1.0, self.pump)
        if not self._closed:
            self.pump()

    async def _post(self, dest: InstanceState, push: Push) -> tuple[str, int]:
        """(outcome, prompt tokens D holds for the push)."""
        body: dict[str, Any] = {"model": dest.model.upstream_name, "prompt": list(push.token_ids[:push.num_tokens]),
                                "max_tokens": 1, "temperature": 0.0, **push.cache_fields}
        if push.kv_transfer_params is not None:
            body["kv_transfer_params"] = push.kv_transfer_params
        if dest.scheduler is SchedulerKind.SHADOW:  # a D-role shadow scheduler reads the tag
            body["vllm_xargs"] = ShadowTag(TagKind.SHADOW, push.session_id, push.model, push.epoch,
                                           push.switch_probability).to_extra_args()
        else:
            body["priority"] = self.config.push_priority
        try:
            assert self.client is not None
            async with self.client.post(f"{dest.url}/v1/completions", data=json.dumps(body).encode(),
                                        headers={**JSON_HEADERS, **dest.config.auth_headers},
                                        timeout=aiohttp.ClientTimeout(total=self.config.push_timeout_s)) as r:
                raw = await r.read()
                if r.status != 200:
                    return f"http-{r.status // 100}xx", 0
                choice = (json.loads(raw).get("choices") or [{}])[0]
                stop = parse_stop(choice.get("stop_reason"))
        except TimeoutError:
            return "timeout", 0
        except (aiohttp.ClientError, OSError, ValueError, AttributeError) as e:
            log.warning("push to %s failed: %r", dest.id, e)
            return "failed", 0
        if stop is None or stop.end is ShadowEnd.PREFILLED:
            return "completed", push.num_tokens
        held = min(stop.num_held_tokens or 0, push.num_tokens)
        return ("superseded" if stop.end is ShadowEnd.SUPERSEDED else "partial"), held

    def forget_session(self, session_id: str) -> None:
        for queue in self.pending.values():
            for key in [k for k in queue if k[0] == session_id]:
                del queue[key]

    def num_session_entries(self) -> int:
        return sum(len(q) for q in self.pending.values())

    async def close(self) -> None:
        self._closed = True
        tasks = list(self.inflight.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
