"""The session gateway: an OpenAI-compatible front door (Chat Completions and
Completions, streaming included) that routes agent calls per step and keeps
the models the router did not choose warm.

A call with a session id (header ``X-Session-Id`` or body field
``session_id`` by default) is a *routed call*: the router picks the model,
the core's :class:`~shadowcore.manager.ShadowManager` places it (sticky
instance unless another would finish the uncached prefill sooner) and opens or
extends shadow jobs on the other models, and the call is forwarded at once.
The gateway asks the upstream for token ids (``return_token_ids``): the
prompt's ids arrive with the first chunk and extend the session history (a
prompt that does not extend the history starts a new epoch), and every output
chunk's ids extend it further, so shadow jobs grow while the call streams.
Calls without a session id are proxied plainly.

Sessions belong to tenants: with client API keys configured, a session id
is namespaced by the tenant of the key that sent it (:meth:`Gateway.session_key`),
so another key naming the same id reaches a different session, and the
switch predictor's task names are namespaced the same way.

Invariants:

* Nothing on a routed call's path waits for shadow work: shadow requests run
  in :class:`~shadow_gateway.shadow.ShadowDispatcher` lanes on their own
  connection pool; bookkeeping errors are counted, never raised to the client.
* A routed call is retried (at most ``upstream.retries`` times, on other
  healthy instances of the same model) only when nothing of it reached the
  client yet; once streaming, an upstream failure ends the stream with an
  error event (the instance's own behaviour).
* The client gets the upstream's response: the gateway removes only the
  fields it added itself (token ids, the usage chunk it asked for).
* One routed call per session at a time: a concurrent call of a busy session
  is served plainly (counted as a fallback), never queued.
* A routed call changes its session (the manager's
  :meth:`~shadowcore.manager.ShadowManager.on_call_arrival`, the
  predictor's transition, the history) only once an upstream accepted it
  (answered 200); until then the gateway only reads the manager
  (:meth:`~shadowcore.manager.ShadowManager.placement`). A call every
  upstream rejected leaves its session as it was.
* Every request to an instance (routed and plain calls, shadows, health
  checks, ``/tokenize`` probes) carries that instance's own credentials
  (``api_key_env``); a client's ``Authorization`` header is never forwarded.
* P/D models (:mod:`shadow_gateway.pd`): a call goes to a P instance (the
  manager's placement: the sticky P), then to the session's sticky D with the
  ``kv_transfer_params`` P answered; the session changes once P accepted the
  call (P holds the prompt then), and the client gets D's response. Both
  phases retry on other instances of their role, before any byte reached the
  client.

Speed: routed and plain calls go through an aiohttp session (C-accelerated
HTTP parsing; httpx's pure-Python stack cost several milliseconds of CPU per
streamed call); health checks and ``/tokenize`` use an httpx client. SSE
chunks are parsed from whatever the upstream's read returned and the
rewritten chunks of one read go out in one write.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import time
from array import array
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import attrs
import httpx

from shadow_gateway.cluster import GatewayCluster, InstanceState
from shadow_gateway.config import GatewayConfig, SchedulerKind
from shadow_gateway.metrics import GatewayMetrics
from shadow_gateway.offload import Offloader
from shadow_gateway.pd import decode_fields, prefill_body
from shadow_gateway.recording import CallFacts, Recorder
from shadow_gateway.router import RouteError, Router, RouteRequest, Warmth, load_router
from shadow_gateway.shadow import ShadowDispatcher
from shadow_gateway.validation import BadRequest, check_session_id, header_text
from shadowcore.errors import ConfigError
from shadowcore.job import token_array
from shadowcore.manager import ShadowManager
from shadowcore.pipeline import build_runtime
from shadowcore.types import CallArrival, JobKey
from shadowcore.wire import ShadowTag, TagKind

log = logging.getLogger("shadow_gateway")
RETRYABLE_STATUS = frozenset({500, 502, 503, 504})
#: What a failed, dropped or timed-out upstream connection raises.
UPSTREAM_ERRORS = (aiohttp.ClientError, TimeoutError, OSError)
JSON_HEADERS = {"content-type": "application/json"}
#: Token-id lists as responses carry them: JSON lists, or arrays when decoded off the loop (shadow_gateway.offload).
TOKEN_LISTS = (list, array)
#: Text every model's ``/tokenize`` must turn into the same ids (see ``tokenizer_check``).
TOKENIZER_PROBE = "ShadowPrefill tokenizer probe: Grüße, 東京! def f(x):\n    return x ** 2  # 12345 <|tool|>"


class TokenizerMismatch(ConfigError):
    """Two models of one gateway tokenize the same text differently."""


class UpstreamCredentials(ConfigError):
    """An instance refuses the credentials the gateway has for it."""


class UpstreamFailed(Exception):
    """Every attempt failed before a byte reached the client."""

    def __init__(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        super().__init__(f"upstream status {status}")
        self.status, self.body, self.headers = status, body, headers or {}


@attrs.define(eq=False)
class CallContext:
    """One routed call in flight (``session_id`` is the gateway's key: tenant and client id)."""

    session_id: str
    model: str
    task: str = ""
    is_switch: bool = False
    instance: InstanceState | None = None  # P/D models: the P instance
    decode_instance: InstanceState | None = None  # P/D models: the D instance
    #: P/D: the D instance whose KV transfer for this call is in flight (sent, no output yet).
    transfer_to: InstanceState | None = None
    num_decode_cached_tokens: int | None = None
    client_wants_ids: bool = False
    client_wants_usage: bool = False
    prompt_seen: bool = False
    started_s: float = 0.0
    #: The manager knows the call (an upstream accepted it).
    accepted: bool = False
    num_prompt_tokens: int | None = None
    num_cached_tokens: int | None = None
    num_shadow_tokens_used: int = 0
    usage: Any = None  # the upstream's usage, when one came (for the recorder)
    prompt_ids: list[int] | None = None
    request: Any = None  # messages / prompt, only when the recorder records text


def session_hash(session_key: str) -> str:
    """What logs show of a session: a digest, never the id."""
    return hashlib.sha256(session_key.encode()).hexdigest()[:16]


@attrs.define(eq=False)
class Gateway:
    """State and logic of one gateway (the FastAPI app in ``app.py`` wraps it)."""

    config: GatewayConfig
    clock: Callable[[], float] = time.monotonic
    metrics: GatewayMetrics = attrs.Factory(GatewayMetrics)
    cluster: GatewayCluster = attrs.field(init=False)
    manager: ShadowManager = attrs.field(init=False)
    router: Router = attrs.field(init=False)
    shadows: ShadowDispatcher = attrs.field(init=False)
    client: httpx.AsyncClient = attrs.field(init=False)  # health checks, /tokenize
    upstream: aiohttp.ClientSession = attrs.field(init=False)  # routed and plain calls
    busy: set[str] = attrs.field(init=False, factory=set)
    offload: Offloader = attrs.field(init=False)  # large JSON off the event loop
    last_seen_s: dict[str, float] = attrs.field(init=False, factory=dict)
    #: Per session: where the last accepted call's prompt ended in the history.
    prompt_end: dict[str, int] = attrs.field(init=False, factory=dict)
    _epoch0_s: float = attrs.field(init=False, default=0.0)
    _tasks: list[asyncio.Task] = attrs.field(init=False, factory=list)
    recorder: Recorder | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        self.cluster = GatewayCluster(self.config)
        runtime = build_runtime(self.config.shadow, self.cluster, self.config.model_names,
                                self.cluster.shadow_instances())
        self.manager = runtime.manager
        self.manager.predictor.limit_tasks(self.config.session.max_tasks)
        self.router = load_router(self.config.router)
        self.offload = Offloader(self.config.upstream.offload_min_bytes)
        self.shadows = ShadowDispatcher(self.manager, self.cluster, self.config.shadow_submit, self.metrics,
                                        self.offload, session_fields=self.session_cache_fields, pd=self.config.pd)
        self._epoch0_s = self.clock()
        if self.config.record is not None:
            self.recorder = Recorder(self.config.record, self._epoch0_s, self.config.model_names)

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        if self.config.tokenizer_check:
            await self.check_tokenizers()
        u = self.config.upstream
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(u.read_timeout_s, connect=u.connect_timeout_s),
            limits=httpx.Limits(max_connections=u.max_connections, max_keepalive_connections=u.max_connections),
        )
        self.upstream = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=u.connect_timeout_s, sock_read=u.read_timeout_s),
            connector=aiohttp.TCPConnector(limit=u.max_connections, force_close=False),
            skip_auto_headers=("User-Agent",),
        )
        self.offload.start()
        self.shadows.start()
        self._tasks.append(asyncio.create_task(self._health_loop(), name="gateway-health"))
        self._tasks.append(asyncio.create_task(self._expiry_loop(), name="gateway-expiry"))

    async def check_tokenizers(self) -> dict[str, list[int]]:
        """Tokenize :data:`TOKENIZER_PROBE` on the first answering instance of
        every model; raise :class:`TokenizerMismatch` when two models disagree,
        :class:`UpstreamCredentials` when an instance refuses the gateway's
        key for it (401/403). A model none of whose instances answers is
        skipped (logged): a dead instance must not keep the gateway from starting."""
        async with httpx.AsyncClient(timeout=self.config.health.timeout_s) as client:
            async def probe(model: str) -> list[int] | None:
                for inst_id in self.cluster.instances(model):
                    inst = self.cluster.by_id[inst_id]
                    tokens, answers = None, []
                    try:  # /v1/models: vLLM's --api-key guards /v1 (its /tokenize may be open)
                        answers.append(await client.get(inst.url + "/v1/models", headers=inst.config.auth_headers))
                        answers.append(await client.post(inst.url + "/tokenize", headers=inst.config.auth_headers,
                                                         json={"model": self.config.model(model).upstream_name,
                                                               "prompt": TOKENIZER_PROBE}))
                        if answers[-1].status_code == 200:
                            tokens = answers[-1].json().get("tokens")
                    except (httpx.HTTPError, OSError, ValueError, AttributeError):
                        pass
                    for r in answers:
                        if r.status_code in (401, 403):  # misconfigured, not down: every shadow and routed
                            # call would be refused the same way
                            raise UpstreamCredentials(
                                f"models.{model}.api_key_env", inst.config.api_key_env or None,
                                f"instance {inst.id} refused the gateway's credentials ({r.url.path} answered "
                                f"{r.status_code}): give the variable holding the key it was started with "
                                "(vLLM's --api-key)")
                    if isinstance(tokens, list):
                        return tokens
                log.warning("tokenizer check: no instance of %r answered /tokenize; not checked", model)
                return None

            found = dict(zip(self.models, await asyncio.gather(*(probe(m) for m in self.models)), strict=True))
        checked = {m: ids for m, ids in found.items() if ids is not None}
        if checked:
            first, ref = next(iter(checked.items()))
            for model, ids in checked.items():
                if ids != ref:
                    at = next((i for i, (a, b) in enumerate(zip(ids, ref, strict=False)) if a != b),
                              min(len(ids), len(ref)))
                    raise TokenizerMismatch(
                        f"models.{model}", self.config.model(model).upstream_name,
                        f"tokenizes a probe text differently from models.{first} ({len(ids)} vs {len(ref)} ids, "
                        f"first difference at id {at}): all models of one gateway must share a tokenizer "
                        "(shadow work sends one model's token ids to the others); run one gateway per "
                        "tokenizer, or set tokenizer_check: false to skip this check")
        return checked

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.shadows.close()
        await self.client.aclose()
        await self.upstream.close()
        self.offload.close()
        if self.recorder is not None:
            self.recorder.close()

    # -- RouterView ----------------------------------------------------------------------
    @property
    def models(self) -> tuple[str, ...]:
        return self.config.model_names

    def price(self, model: str) -> tuple[float, float, float]:
        p = self.config.model(model).price
        return p.input_per_mtok, p.cached_input_per_mtok, p.output_per_mtok

    def current_model(self, session_id: str) -> str | None:
        s = self.manager.session(session_id)
        return s.current_model if s else None

    def warmth(self, session_id: str, model: str, prompt_ids: list[int] | None = None) -> Warmth:
        """Tokens of the session's context (or of ``prompt_ids``, the next
        prompt) expected cached on the instance the next call would use."""
        s = self.manager.session(session_id)
        if model not in self.models:
            raise RouteError(f"model {model!r} is not served here (models: {', '.join(self.models)})")
        if s is None:
            return Warmth(session_id, model, None, len(prompt_ids or ()), 0)
        candidates = [s.sticky[model]] if model in s.sticky else list(self.cluster.instances(model))
        ids = prompt_ids if prompt_ids is not None else s.history.token_ids
        n = len(prompt_ids) if prompt_ids is not None else s.history.num_tokens
        best, best_n = None, 0
        for inst_id in candidates:
            known = self.cluster.by_id[inst_id].known.get(session_id)
            got = max(known.matched(ids, n)) if known is not None else 0
            if prompt_ids is not None:
                got = min(got, max(0, n - 1))  # an engine computes at least the last prompt token
            got -= got % self.cluster.block_size(inst_id)
            if best is None or got > best_n:
                best, best_n = inst_id, got
        job = self.manager.job(JobKey(session_id, model))
        return Warmth(session_id, model, best, n, best_n, job.num_inflight_tokens if job else 0)

    # -- entry points --------------------------------------------------------------------
    def cache_fields(self, tenant: str | None) -> dict[str, str]:
        """Body fields of every request made for ``tenant`` (``auth.isolate_caches``):
        a ``cache_salt`` of its own, the same on every gateway replica."""
        if tenant is None or not self.config.auth.isolate_caches:
            return {}
        return {"cache_salt": "sp-" + hashlib.sha256(b"shadowprefill cache salt\0" + tenant.encode()).hexdigest()[:32]}

    def session_cache_fields(self, session_key: str) -> dict[str, str]:
        """:meth:`cache_fields` of the tenant that owns a session (shadows)."""
        if not self.config.auth.enabled:
            return {}
        return self.cache_fields(session_key.partition(":")[0])

    @staticmethod
    def session_key(tenant: str | None, session_id: str) -> str:
        """The gateway's key of a client's session: the id itself without
        client keys, else ``tenant:id`` (tenant names have no ``:``)."""
        return session_id if tenant is None else f"{tenant}:{session_id}"

    def session_of(self, headers: Any, body: dict[str, Any], tenant: str | None = None) -> tuple[str | None, str]:
        """(session key or None, task) of a call; removes the session field
        from ``body``. :class:`BadRequest` for a bad id, or a header and a
        body field that name different sessions."""
        cfg = self.config.session
        from_body = body.pop(cfg.field, None)
        raw = headers.get(cfg.header)
        from_header = check_session_id(cfg.header, header_text(cfg.header, raw)) if raw is not None else None
        if from_body is not None:
            check_session_id(cfg.field, from_body)
            if from_header is not None and from_header != from_body:
                raise BadRequest(cfg.field, f"{cfg.header} and {cfg.field} name different sessions")
        sid = from_header if from_header is not None else from_body
        task = headers.get(cfg.task_header, "")
        task = check_session_id(cfg.task_header, header_text(cfg.task_header, task)) if task else ""
        if sid is None:
            return None, task
        return self.session_key(tenant, sid), (self.session_key(tenant, task) if task else "")

    def choose_model(self, endpoint: str, body: dict[str, Any], session_id: str | None) -> str:
        s = self.manager.session(session_id) if session_id else None
        call = RouteRequest(session_id, body.get("model"), endpoint, body, s.num_calls if s else 0)
        model = self.router.choose(call, self)
        if model not in self.models:
            raise RouteError(f"router {self.config.router.name!r} chose unknown model {model!r}")
        return model

    def begin_routed(self, session_id: str, model: str, task: str, body: dict[str, Any]) -> CallContext | None:
        """A routed call about to be sent: the session is busy, the manager
        is only read (where would it place the call); None: serve it plainly."""
        if session_id in self.busy:
            self.metrics.fallbacks.labels("session-busy").inc()
            return None
        try:
            instance_id = self.manager.placement(session_id, model)
        except Exception:  # bookkeeping must never fail a call
            log.exception("session %s: no placement; serving the call plainly", session_hash(session_id))
            self.metrics.fallbacks.labels("manager-error").inc()
            return None
        self.busy.add(session_id)
        ctx = CallContext(session_id, model, task, instance=self.cluster.by_id[instance_id],
                          client_wants_ids=bool(body.get("return_token_ids")), started_s=self.clock())
        if self.recorder is not None and self.recorder.wants_text:
            ctx.request = body.get("messages", body.get("prompt"))
        return ctx

    def accept(self, ctx: CallContext, inst: InstanceState) -> None:
        """The upstream accepted the call (status 200): register it with the
        manager now, on the instance that serves it."""
        ctx.instance = inst
        try:
            if ctx.session_id not in self.manager:
                self._make_room()
            placement = self.manager.on_call_arrival(
                CallArrival(ctx.session_id, ctx.model, 0, max(0.0, self.clock() - self._epoch0_s), ctx.task,
                            new_token_ids=())
            )
        except Exception:  # bookkeeping must never fail a call
            log.exception("session %s: manager rejected the call; serving it plainly", session_hash(ctx.session_id))
            self.metrics.fallbacks.labels("manager-error").inc()
            return
        ctx.accepted, ctx.is_switch = True, placement.is_switch
        self.metrics.calls.labels(ctx.model, "routed").inc()
        if ctx.is_switch:
            self.metrics.switch_calls.labels(ctx.model).inc()
        self._seen(ctx.session_id)
        self.shadows.on_call_arrival(ctx.session_id, inst.id)
        self.shadows.wake_all()

    def end_routed(self, ctx: CallContext, ok: bool) -> None:
        self.busy.discard(ctx.session_id)
        if not ctx.accepted:
            return
        s = self.manager.session(ctx.session_id)
        self._end_transfer(ctx)
        if ok and s is not None and ctx.instance is not None and s.history.token_ids is not None:
            if ctx.decode_instance is not None:  # P/D: P holds the prompt, D the prompt and the output
                self.cluster.record_routed(ctx.instance.id, ctx.session_id, s.history.token_ids,
                                           min(self.prompt_end.get(ctx.session_id, 0), s.history.num_tokens))
                self.cluster.record_routed(ctx.decode_instance.id, ctx.session_id, s.history.token_ids,
                                           max(0, s.history.num_tokens - 1))
            else:  # the instance holds the prompt and all output but the last token
                self.cluster.record_routed(ctx.instance.id, ctx.session_id, s.history.token_ids,
                                           max(0, s.history.num_tokens - 1))
        self.metrics.call_seconds.labels(ctx.model).observe(self.clock() - ctx.started_s)
        if ctx.session_id in self.last_seen_s:
            self._seen(ctx.session_id)
        if ok:
            self.shadows.on_call_complete(ctx.session_id)
        if self.recorder is not None:
            try:
                self.recorder.on_call_end(CallFacts(ctx.session_id, ctx.model, ctx.task, ctx.started_s, self.clock(),
                                                    ctx.usage, ctx.prompt_ids, ctx.request), ok)
            except Exception:  # recording never fails a call
                log.exception("session %s: recording failed", session_hash(ctx.session_id))
                self.metrics.errors.labels("recording", ctx.model).inc()
        self.shadows.wake_all()

    # -- token ids from the upstream's responses ------------------------------------------
    def on_prompt_ids(self, ctx: CallContext, ids: list[int], num_cached: int | None) -> None:
        ctx.prompt_seen = True
        ctx.prompt_ids = ids
        s = self.manager.session(ctx.session_id) if ctx.accepted else None
        if s is None:
            return
        h = s.history
        n = h.num_tokens
        if len(ids) >= n and (not n or h.token_ids == token_array(ids[:n])):
            self.manager.on_tool_result(ctx.session_id, len(ids) - n, ids[n:])
        else:  # the prompt does not extend the history: a new epoch (jobs restart, caches still hit)
            end = self.prompt_end.get(ctx.session_id, 0)
            # A client that re-sends the rendered conversation extends the last
            # prompt, not its output as generated (an end-of-turn token, another
            # tokenization of the reply): not a diverged history.
            extends_prompt = (0 < end <= len(ids) and h.token_ids is not None
                              and h.token_ids[:end] == token_array(ids[:end]))
            self.metrics.fallbacks.labels("history-re-rendered" if extends_prompt else "history-diverged").inc()
            self.manager.on_new_epoch(ctx.session_id, len(ids), ids)
        self.prompt_end[ctx.session_id] = len(ids)
        if num_cached is not None and ctx.instance is not None:
            self._count_cached(ctx, ids, num_cached)
        self.shadows.wake_all()

    def _count_cached(self, ctx: CallContext, ids: list[int], num_cached: int) -> None:
        ctx.num_cached_tokens = num_cached
        self.metrics.cached_tokens.labels(ctx.model).inc(num_cached)
        if not ctx.is_switch:
            return
        self.metrics.switch_cached_tokens.labels(ctx.model).inc(num_cached)
        known = ctx.instance.known.get(ctx.session_id) if ctx.instance else None
        if known is not None:
            via_routed, via_shadow = known.matched(ids, len(ids))
            used = max(0, min(num_cached, via_shadow) - via_routed)
            ctx.num_shadow_tokens_used = used
            if used:
                self.metrics.shadow_tokens_used.labels(ctx.model).inc(used)
        if num_cached == 0:
            self.metrics.fallbacks.labels("cold-switch").inc()

    def on_output_ids(self, ctx: CallContext, ids: list[int]) -> None:
        if not ctx.prompt_seen or not ids or not ctx.accepted:
            return
        if ctx.session_id in self.manager:
            self.manager.on_output_tokens(ctx.session_id, len(ids), ids)
            self.shadows.wake_all()

    # -- upstream calls -------------------------------------------------------------------
    def upstream_body(self, body: dict[str, Any], model: str, inst: InstanceState,
                      ctx: CallContext | None) -> dict[str, Any]:
        out = dict(body)
        out["model"] = self.config.model(model).upstream_name
        if ctx is None:
            return out
        out["return_token_ids"] = True
        if out.get("stream"):
            opts = dict(out.get("stream_options") or {})
            ctx.client_wants_usage = bool(opts.get("include_usage"))
            opts["include_usage"] = True
            out["stream_options"] = opts
        if inst.scheduler is SchedulerKind.SHADOW:
            xargs = dict(out.get("vllm_xargs") or {})
            xargs.update(ShadowTag(TagKind.ROUTED, ctx.session_id).to_extra_args())
            out["vllm_xargs"] = xargs
        return out

    def attempt_order(self, model: str, first: InstanceState | None) -> list[InstanceState]:
        healthy = sorted(self.cluster.healthy_instances(model), key=lambda i: i.num_routed_inflight)
        order = ([first] if first is not None else []) + [i for i in healthy if i is not first]
        if not order:
            order = [self.cluster.by_id[i] for i in self.cluster.instances(model)]  # all down: try anyway
        return order[: 1 + self.config.upstream.retries]

    def decode_order(self, model: str, first: InstanceState) -> list[InstanceState]:
        """D instances to try for a P/D call: ``first`` (the sticky D), then the least loaded available ones."""
        rest = sorted((i for i in self.cluster.decode_instances(model) if i.available and i is not first),
                      key=lambda i: i.num_routed_inflight)
        return ([first] + rest)[: 1 + self.config.upstream.retries]

    async def open_routed(self, path: str, body: dict[str, Any], model: str, ctx: CallContext | None,
                          headers: dict[str, str]) -> tuple[aiohttp.ClientResponse, InstanceState]:
        """:meth:`open_upstream`, or for a P/D model the prefill on P and then the open D response."""
        if not self.cluster.is_pd(model):
            return await self.open_upstream(path, body, model, ctx, headers)
        resp, p_inst = await self.open_upstream(path, body, model, ctx, headers, shape=prefill_body)
        try:
            raw = await resp.read()
        except UPSTREAM_ERRORS as e:
            resp.close()
            raise UpstreamFailed(502, json.dumps({"error": {"message": f"instance {p_inst.id} failed while "
                                                            f"prefilling: {e!r}", "type": "upstream_error"}}
                                                 ).encode()) from None
        finally:
            p_inst.num_routed_inflight -= 1
        resp.release()
        if resp.status != 200:
            raise UpstreamFailed(resp.status, raw, {"content-type": resp.headers.get("content-type", "")})
        try:
            data = json.loads(raw)
        except ValueError:
            raise UpstreamFailed(502, json.dumps({"error": {"message": f"instance {p_inst.id} answered the "
                                                            "prefill with no JSON", "type": "upstream_error"}}
                                                 ).encode()) from None
        if ctx is not None:
            self.process_prefill(ctx, data)
        dest = self.cluster.decode_for(ctx.session_id if ctx else None, model)
        return await self.open_upstream(path, body, model, ctx, headers, order=self.decode_order(model, dest),
                                        extra=decode_fields(data))

    def process_prefill(self, ctx: CallContext, data: dict[str, Any]) -> None:
        """P's answer to a P/D call: the prompt's ids extend the history; its cached tokens are the call's."""
        try:
            ids = _prompt_ids(data)
            if isinstance(ids, TOKEN_LISTS):
                self.on_prompt_ids(ctx, ids, _cached(data.get("usage")))
            else:
                self.metrics.fallbacks.labels("no-token-ids").inc()
        except Exception:
            log.exception("session %s: bookkeeping failed", session_hash(ctx.session_id))
            self.metrics.errors.labels("bookkeeping", ctx.model).inc()

    def _end_transfer(self, ctx: CallContext) -> None:
        """The call's KV reached its D instance (an output token came back, or the call ended)."""
        dest, ctx.transfer_to = ctx.transfer_to, None
        if dest is not None:
            dest.num_transfers_inflight -= 1
            self.shadows.pusher.pump()

    async def open_upstream(self, path: str, body: dict[str, Any], model: str, ctx: CallContext | None,
                            headers: dict[str, str], *, order: list[InstanceState] | None = None,
                            shape: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                            extra: dict[str, Any] | None = None) -> tuple[aiohttp.ClientResponse, InstanceState]:
        """The first attempt that answers with a non-retryable status; the
        response is open (streamed) and the caller must close it. A routed
        call an upstream accepted (200) is registered (:meth:`accept`).
        P/D calls: ``shape`` makes the P request (:func:`shadow_gateway.pd.prefill_body`);
        ``order`` lists the D instances to try and ``extra`` adds P's ``kv_transfer_params``."""
        last = UpstreamFailed(503, json.dumps({"error": {"message": f"no instance of {model!r} answered",
                                                         "type": "upstream_unavailable"}}).encode())
        decode = order is not None
        for inst in order if decode else self.attempt_order(model, ctx.instance if ctx else None):
            payload = self.upstream_body(body, model, inst, ctx)
            payload = shape(payload) if shape is not None else payload
            payload.update(extra or {})
            inst.num_routed_inflight += 1
            watchdog = asyncio.get_running_loop().call_later(
                self.config.upstream.first_byte_bound_s, self.eject, inst, "first-byte-bound")
            try:
                resp = await self.upstream.post(inst.url + path, data=json.dumps(payload).encode(),
                                                headers={**headers, **inst.config.auth_headers, **JSON_HEADERS})
            except UPSTREAM_ERRORS as e:
                inst.num_routed_inflight -= 1
                if isinstance(e, TimeoutError):
                    self.eject(inst, "timeout")
                self.metrics.errors.labels("routed" if ctx else "plain", inst.id).inc()
                if self.cluster.mark(inst.id, False):
                    self.shadows.wake_all()
                last = UpstreamFailed(502, json.dumps({"error": {"message": f"instance {inst.id}: {e!r}",
                                                                 "type": "upstream_error"}}).encode())
                continue
            finally:
                watchdog.cancel()
            if resp.status in RETRYABLE_STATUS:
                try:
                    data = await resp.read()
                except UPSTREAM_ERRORS:
                    data = b""
                resp.release()
                inst.num_routed_inflight -= 1
                self.metrics.errors.labels("routed" if ctx else "plain", inst.id).inc()
                last = UpstreamFailed(resp.status, data, {"content-type": resp.headers.get("content-type", "")})
                continue
            if ctx is not None and decode:
                if ctx.decode_instance is not None and ctx.decode_instance is not inst:
                    self.metrics.fallbacks.labels("retried-elsewhere").inc()
                ctx.decode_instance = inst
                if resp.status == 200 and ctx.transfer_to is None:
                    ctx.transfer_to = inst
                    inst.num_transfers_inflight += 1
                return resp, inst
            if ctx is not None and ctx.instance is not inst:
                self.metrics.fallbacks.labels("retried-elsewhere").inc()
                ctx.instance = inst
            if ctx is not None and resp.status == 200:
                self.accept(ctx, inst)
            return resp, inst
        raise last

    # -- response processing ---------------------------------------------------------------
    def process_json(self, ctx: CallContext, data: dict[str, Any]) -> dict[str, Any]:
        """A whole (non-streamed) response: feed ids, strip what we added."""
        try:
            self._end_transfer(ctx)
            ids = _prompt_ids(data)
            if ctx.decode_instance is not None:  # P/D: P's answer gave the prompt; this is D's
                self._count_decode_cached(ctx, _cached(data.get("usage")))
            elif isinstance(ids, TOKEN_LISTS):
                self.on_prompt_ids(ctx, ids, _cached(data.get("usage")))
            else:
                self.metrics.fallbacks.labels("no-token-ids").inc()
            choices = data.get("choices") or []
            if choices and isinstance(choices[0].get("token_ids"), TOKEN_LISTS):
                self.on_output_ids(ctx, choices[0]["token_ids"])
            self._count_usage(ctx, data.get("usage"))
        except Exception:
            log.exception("session %s: bookkeeping failed", session_hash(ctx.session_id))
            self.metrics.errors.labels("bookkeeping", ctx.model).inc()
        if not ctx.client_wants_ids:
            _strip_ids(data)
        return data

    def process_chunk(self, ctx: CallContext, data: dict[str, Any]) -> dict[str, Any] | None:
        """One SSE chunk; None drops it (the usage chunk the client did not ask for)."""
        try:
            ids = _prompt_ids(data)
            if isinstance(ids, TOKEN_LISTS) and not ctx.prompt_seen:
                self.on_prompt_ids(ctx, ids, None)
            for c in data.get("choices") or []:
                if c.get("index", 0) == 0 and isinstance(c.get("token_ids"), TOKEN_LISTS):
                    if c["token_ids"] and ctx.transfer_to is not None:
                        self._end_transfer(ctx)
                    self.on_output_ids(ctx, c["token_ids"])
            usage = data.get("usage")
            if usage and not data.get("choices"):
                self._count_usage(ctx, usage)
                cached = _cached(usage)
                if ctx.decode_instance is not None:
                    self._count_decode_cached(ctx, cached)
                elif cached is not None and ctx.prompt_seen and ctx.accepted:
                    s = self.manager.session(ctx.session_id)
                    if s is not None and s.history.token_ids is not None:
                        self._count_cached(ctx, s.history.token_ids, cached)
        except Exception:
            log.exception("session %s: bookkeeping failed", session_hash(ctx.session_id))
            self.metrics.errors.labels("bookkeeping", ctx.model).inc()
        if not ctx.client_wants_ids:
            _strip_ids(data)
        if data.get("usage") and not data.get("choices") and not ctx.client_wants_usage:
            return None
        if not ctx.client_wants_usage and "usage" in data and data.get("choices"):
            data["usage"] = None
        return data

    def _count_decode_cached(self, ctx: CallContext, num_cached: int | None) -> None:
        """P/D: the prompt tokens D reported cached (its local prefix cache and,
        by connector, the KV it received; NixlConnector reports P's hits instead)."""
        if num_cached is not None:
            ctx.num_decode_cached_tokens = num_cached
            self.metrics.decode_cached_tokens.labels(ctx.model).inc(num_cached)

    def _count_usage(self, ctx: CallContext, usage: Any) -> None:
        ctx.usage = usage
        if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            ctx.num_prompt_tokens = usage["prompt_tokens"]
            self.metrics.prompt_tokens.labels(ctx.model).inc(usage["prompt_tokens"])

    def rewrite_event_line(self, ctx: CallContext, line: bytes) -> bytes | None:
        """One SSE line of a routed call's stream, rewritten for the client
        (with its blank-line terminator); None drops it."""
        if not line.startswith(b"data:"):
            return line + b"\n\n"
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return b"data: [DONE]\n\n"
        try:
            data = json.loads(payload)
        except ValueError:
            return line + b"\n\n"
        out = self.process_chunk(ctx, data) if isinstance(data, dict) else data
        if out is None:
            return None
        return b"data: " + json.dumps(out, separators=(",", ":")).encode() + b"\n\n"

    async def _rewrite(self, ctx: CallContext, line: bytes) -> bytes | None:
        """:meth:`rewrite_event_line`, with a long line decoded and encoded off the event loop."""
        if len(line) < self.offload.min_bytes or not line.startswith(b"data:"):
            return self.rewrite_event_line(ctx, line)
        try:
            data = await self.offload.decode(line[5:].strip())
        except ValueError:
            return line + b"\n\n"
        out = self.process_chunk(ctx, data) if isinstance(data, dict) else data
        return None if out is None else b"data: " + await self.offload.encode(out) + b"\n\n"

    async def stream_chunks(self, ctx: CallContext | None, resp: aiohttp.ClientResponse, inst: InstanceState,
                            on_end: Callable[[bool], None]) -> AsyncIterator[bytes]:
        ok = False
        try:
            if ctx is None:
                async for raw in resp.content.iter_any():
                    yield raw
                ok = True
                return
            pending = bytearray()  # a long line arrives in many reads: appended, split once it ends
            async for raw in resp.content.iter_any():
                pending += raw
                if b"\n" not in raw:
                    continue
                *lines, rest = bytes(pending).split(b"\n")
                pending = bytearray(rest)
                out = [await self._rewrite(ctx, line.rstrip(b"\r")) for line in lines if line.strip()]
                batch = b"".join(x for x in out if x)
                if batch:
                    yield batch
            if pending.strip():
                last = await self._rewrite(ctx, bytes(pending).rstrip(b"\r"))
                if last:
                    yield last
            ok = True  # the upstream closed the stream normally
        except UPSTREAM_ERRORS as e:
            self.metrics.errors.labels("routed" if ctx else "plain", inst.id).inc()
            if isinstance(e, TimeoutError):
                self.eject(inst, "timeout")
            err = {"error": {"message": f"instance {inst.id} failed mid-stream: {e!r}", "type": "upstream_error"}}
            yield b"data: " + json.dumps(err).encode() + b"\n\n"
        finally:
            inst.num_routed_inflight -= 1
            if ok:
                resp.release()
            else:  # unfinished (failed, or the client went away): the connection is not reusable
                resp.close()
            on_end(ok)

    def eject(self, inst: InstanceState, reason: str) -> None:
        """Outlier ejection (see ``upstream.first_byte_bound_s``): no new placement or shadow work there for
        ``upstream.eject_s``, whatever its /health says."""
        if self.cluster.eject(inst.id, self.config.upstream.eject_s):
            log.warning("instance %s ejected for %.0f s (%s)", inst.id, self.config.upstream.eject_s, reason)
            self.metrics.ejections.labels(inst.id, reason).inc()

    # -- background loops --------------------------------------------------------------------
    async def _health_loop(self) -> None:
        h = self.config.health
        while True:
            await asyncio.gather(*(self._check(inst) for inst in self.cluster.by_id.values()))
            await asyncio.sleep(h.interval_s)

    async def _check(self, inst: InstanceState) -> None:
        try:
            r = await self.client.get(inst.url + "/health", headers=inst.config.auth_headers,
                                      timeout=self.config.health.timeout_s)
            ok = r.status_code == 200
        except (httpx.HTTPError, OSError):
            ok = False
        if not ok:
            self.metrics.errors.labels("health", inst.id).inc()
        if self.cluster.mark(inst.id, ok):
            log.warning("instance %s is now %s", inst.id, "healthy" if ok else "unhealthy")
            self.shadows.wake_all()

    # -- session lifetime: idle timeout and LRU cap (last_seen_s is in last-seen order) ----------
    def _seen(self, session_id: str) -> None:
        self.last_seen_s.pop(session_id, None)
        self.last_seen_s[session_id] = self.clock()

    def _make_room(self) -> None:
        """Before a new session: end least recently seen idle sessions beyond ``session.max_sessions``."""
        over = self.manager.num_sessions - self.config.session.max_sessions + 1
        if over > 0:
            for sid in [s for s in itertools.islice(self.last_seen_s, over + len(self.busy)) if s not in self.busy
                        ][:over]:
                self.end_session(sid)
                self.metrics.fallbacks.labels("session-evicted-lru").inc()

    async def _expiry_loop(self) -> None:
        timeout = self.config.session.idle_timeout_s
        while True:
            await asyncio.sleep(min(60.0, timeout / 4))
            self.expire_idle()

    def expire_idle(self) -> int:
        """End sessions idle longer than ``session.idle_timeout_s`` (oldest first; stops at the first recent one)."""
        cutoff, ended = self.clock() - self.config.session.idle_timeout_s, []
        for sid, seen in self.last_seen_s.items():
            if seen >= cutoff:
                break
            if sid not in self.busy:
                ended.append(sid)
        for sid in ended:
            self.end_session(sid)
        return len(ended)

    def end_session(self, session_id: str) -> bool:
        known = session_id in self.manager
        self.manager.on_session_end(session_id)
        self.cluster.forget_session(session_id)
        self.shadows.forget_session(session_id)
        self.last_seen_s.pop(session_id, None)
        self.prompt_end.pop(session_id, None)
        if self.recorder is not None:
            self.recorder.forget(session_id)
        return known


def _prompt_ids(data: dict[str, Any]) -> Any:
    """vLLM puts the prompt's ids at the top of a chat response and in the
    choice of a completions response."""
    ids = data.get("prompt_token_ids")
    if ids is None:
        choices = data.get("choices") or []
        ids = choices[0].get("prompt_token_ids") if choices and isinstance(choices[0], dict) else None
    return ids


def _strip_ids(data: dict[str, Any]) -> None:
    data.pop("prompt_token_ids", None)
    for c in data.get("choices") or []:
        c.pop("token_ids", None)
        c.pop("prompt_token_ids", None)


def _cached(usage: Any) -> int | None:
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        return details["cached_tokens"]
    return None
