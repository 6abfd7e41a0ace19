"""HTTP surface of the gateway (FastAPI).

Endpoints: ``POST /v1/chat/completions`` and ``POST /v1/completions``
(OpenAI-compatible, ``stream`` included), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus), the warmth query
``GET /v1/shadowprefill/warmth?session_id=S&model=M`` (or ``POST`` with the
next ``prompt`` / ``messages`` to count that prompt's expected cached tokens)
and ``DELETE /v1/shadowprefill/sessions/{session_id}`` (any id: ``/`` and
non-ASCII characters percent-encoded).

Invariants:

* With client API keys configured, every endpoint but ``/health`` and
  ``/metrics`` needs ``Authorization: Bearer KEY``; the key is compared in
  constant time (:func:`hmac.compare_digest` against every key); a missing or
  wrong key is a 401 in OpenAI's error shape. A session is visible only to
  the tenant whose key made it: another key's warmth query or DELETE gets
  404, and its calls under the same id reach a session of its own.
* A client error (bad JSON, a field of the wrong type or range, a field only
  the gateway may set, unknown model, bad session id) is a 4xx with an
  OpenAI-style ``{"error": {"message", "type", "param", "code"}}`` body
  naming the field, answered before any session changes; an upstream that
  fails every attempt gives its own status and body (or 502/503).
* One access-log line per call (logger ``shadow_gateway.access``, JSON):
  session digest, tenant, model, instance, status, prompt and cached tokens,
  shadow outcome, latency; request bodies only with ``access_log.bodies``.
  A call refused before it reached an upstream (400, 401, 404) gets a
  ``refused`` line (path, status, the field at fault), never its body or key.
* With keys and ``auth.isolate_caches``, every request made for a tenant
  carries that tenant's ``cache_salt`` (:meth:`~shadow_gateway.gateway.Gateway.cache_fields`): no
  tenant reaches another's prefix-cache entries.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from shadow_gateway.config import API_KEYS_ENV, AuthConfig, GatewayConfig
from shadow_gateway.gateway import UPSTREAM_ERRORS, CallContext, Gateway, UpstreamFailed, session_hash
from shadow_gateway.router import RouteError
from shadow_gateway.validation import BadRequest, check_body, check_session_id, parse_json

log = logging.getLogger("shadow_gateway.app")
access_log = logging.getLogger("shadow_gateway.access")
#: Client headers forwarded upstream (never ``Authorization``: instances get their own credentials).
FORWARDED_HEADERS = ("x-request-id",)
PUBLIC_PATHS = frozenset({"/health", "/metrics"})
TENANT_SCOPE_KEY = "shadowprefill.tenant"
#: Bodies from this size on are parsed and checked in a worker thread (the GIL
#: passes back to the event loop every few ms, so other calls keep moving).
OFFLOAD_BODY_BYTES = 1 << 20


def read_request(endpoint: str, raw: bytes) -> dict[str, Any]:
    body = parse_json(raw)
    check_body(endpoint, body)
    return body


def log_refused(path: str, status: int, tenant: str | None, param: str | None) -> None:
    """The access-log line of a request refused before it reached an upstream."""
    if access_log.isEnabledFor(logging.INFO):
        access_log.info(json.dumps({"event": "refused", "path": path, "status": status, "tenant": tenant,
                                    "param": param}, separators=(",", ":")))


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
           code: str | int | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": status if code is None else code}},
                        status_code=status, headers=headers)


class ApiKeyAuth:
    """ASGI middleware: the tenant of the request's key into the scope, or 401."""

    def __init__(self, app: ASGIApp, auth: AuthConfig, log_lines: bool = True) -> None:
        self.app, self.log_lines = app, log_lines
        self.keys = [(hashlib.sha256(k.key.encode()).digest(), k.tenant) for k in auth.api_keys]

    def tenant(self, authorization: bytes | None) -> str | None:
        """The tenant of an ``Authorization`` header's bearer key (its raw bytes), or None."""
        scheme, _, token = (authorization or b"").partition(b" ")
        if scheme.lower() != b"bearer" or not token.strip():
            return None
        digest = hashlib.sha256(token.strip()).digest()
        found = None
        for key_digest, tenant in self.keys:  # every key compared: the time does not say which matched
            if hmac.compare_digest(digest, key_digest):
                found = tenant
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        auth = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                auth = value
        tenant = self.tenant(auth)
        if tenant is None:
            message = ("Missing API key: send Authorization: Bearer KEY" if auth is None
                       else "Incorrect API key provided")
            if self.log_lines:
                log_refused(scope["path"], 401, None, "authorization")
            await _error(401, message, code="invalid_api_key",
                         headers={"www-authenticate": "Bearer"})(scope, receive, send)
            return
        scope[TENANT_SCOPE_KEY] = tenant
        await self.app(scope, receive, send)


def create_app(config: GatewayConfig, gateway: Gateway | None = None) -> FastAPI:
    gw = gateway or Gateway(config)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        if config.auth.enabled:
            log.info("client API keys: %d (tenants: %s)", len(config.auth.api_keys),
                     ", ".join(sorted({k.tenant for k in config.auth.api_keys})))
        else:
            log.warning("no client API keys configured (auth.api_keys, $%s): listening on loopback only (%s), "
                        "every local client is trusted", API_KEYS_ENV, config.host)
        await gw.start()
        try:
            yield
        finally:
            await gw.stop()

    app = FastAPI(title="shadowprefill gateway", lifespan=lifespan)
    app.state.gateway = gw
    if config.auth.enabled:
        app.add_middleware(ApiKeyAuth, auth=config.auth, log_lines=config.access_log.enabled)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, e: StarletteHTTPException) -> Response:
        return _error(e.status_code, str(e.detail))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, e: RequestValidationError) -> Response:
        return _error(400, str(e.errors()))

    def tenant_of(request: Request) -> str | None:
        return request.scope.get(TENANT_SCOPE_KEY)

    def log_call(ctx: CallContext | None, tenant: str | None, model: str, instance: str | None, status: int,
                 started_s: float, body: dict[str, Any]) -> None:
        if not config.access_log.enabled or not access_log.isEnabledFor(logging.INFO):
            return
        line: dict[str, Any] = {"event": "call", "kind": "plain" if ctx is None else "routed",
                                "tenant": tenant, "model": model, "instance": instance, "status": status,
                                "latency_ms": round((gw.clock() - started_s) * 1000, 1)}
        if ctx is not None:
            line.update(session=session_hash(ctx.session_id), switch=ctx.is_switch,
                        prompt_tokens=ctx.num_prompt_tokens, cached_tokens=ctx.num_cached_tokens,
                        shadow=_shadow_outcome(ctx), shadow_tokens_used=ctx.num_shadow_tokens_used)
            if ctx.decode_instance is not None:  # P/D: instance is D's; prefill and cached tokens are P's
                line.update(prefill_instance=ctx.instance.id if ctx.instance else None,
                            decode_cached_tokens=ctx.num_decode_cached_tokens)
        if config.access_log.bodies:
            line["body"] = body
        access_log.info(json.dumps(line, separators=(",", ":"), ensure_ascii=False))

    async def proxy(request: Request, endpoint: str, path: str) -> Response:
        started_s = gw.clock()
        tenant = tenant_of(request)
        try:
            raw = await request.body()
            body = (await asyncio.to_thread(read_request, endpoint, raw) if len(raw) >= OFFLOAD_BODY_BYTES
                    else read_request(endpoint, raw))
            session_id, task = gw.session_of(request.headers, body, tenant)
            model = gw.choose_model(endpoint, body, session_id)
        except BadRequest as e:
            if config.access_log.enabled:
                log_refused(path, e.status, tenant, e.param)
            return _error(e.status, str(e), param=e.param)
        except RouteError as e:
            status = 404 if "not served" in str(e) else 400
            if config.access_log.enabled:
                log_refused(path, status, tenant, "model")
            return _error(status, str(e), param="model")
        body.update(gw.cache_fields(tenant))
        ctx = gw.begin_routed(session_id, model, task, body) if session_id else None
        if ctx is None:
            gw.metrics.calls.labels(model, "plain").inc()
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        try:
            resp, inst = await gw.open_routed(path, body, model, ctx, headers)
        except UpstreamFailed as e:
            if ctx is not None:
                gw.end_routed(ctx, ok=False)
            log_call(ctx, tenant, model, None, e.status, started_s, body)
            return Response(e.body, status_code=e.status, media_type=e.headers.get("content-type") or
                            "application/json")
        except BaseException:
            if ctx is not None:
                gw.end_routed(ctx, ok=False)
            raise
        status = resp.status

        def on_end(ok: bool) -> None:
            if ctx is not None:
                gw.end_routed(ctx, ok)
            log_call(ctx, tenant, model, inst.id, status if ok else 502, started_s, body)

        is_sse = resp.headers.get("content-type", "").startswith("text/event-stream")
        if is_sse:
            return StreamingResponse(gw.stream_chunks(ctx, resp, inst, on_end), status_code=resp.status,
                                     media_type="text/event-stream")
        try:
            raw = await resp.read()
        except UPSTREAM_ERRORS as e:  # the instance died while sending the body
            inst.num_routed_inflight -= 1
            resp.close()
            on_end(False)
            gw.metrics.errors.labels("routed" if ctx else "plain", inst.id).inc()
            return _error(502, f"instance {inst.id} failed while answering: {e!r}", "upstream_error")
        inst.num_routed_inflight -= 1
        resp.release()
        if ctx is None or resp.status != 200:
            on_end(resp.status == 200)
            return Response(raw, status_code=resp.status,
                            media_type=resp.headers.get("content-type", "application/json"))
        try:
            data = gw.process_json(ctx, await gw.offload.decode(raw))
        except ValueError:
            on_end(False)
            return Response(raw, status_code=resp.status, media_type=resp.headers.get("content-type"))
        on_end(True)
        return Response(await gw.offload.encode(data), status_code=resp.status, media_type="application/json")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy(request, "chat", "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy(request, "completions", "/v1/completions")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "shadowprefill"}
                                           for m in gw.models]}

    @app.get("/health")
    async def health() -> Response:
        healthy = {m: len(gw.cluster.healthy_instances(m)) for m in gw.models}  # P instances of a P/D model
        decode = {m: sum(i.available for i in gw.cluster.decode_instances(m)) for m in gw.models
                  if gw.cluster.is_pd(m)}
        ok = all(healthy.values()) and all(decode.values())
        out: dict[str, Any] = {"status": "ok" if ok else "degraded", "healthy_instances": healthy}
        if decode:
            out["healthy_decode_instances"] = decode
        return JSONResponse(out, status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def known_session(request: Request, source: str, session_id: Any, model: Any) -> str:
        """The session key of a client's session id, or BadRequest (400/404)."""
        check_session_id(source, session_id)
        if not isinstance(model, str):
            raise BadRequest("model", f"model = {model!r}: must be a string")
        if model not in gw.models:
            raise BadRequest("model", f"model {model!r} is not served here (models: {', '.join(gw.models)})", 404)
        key = gw.session_key(tenant_of(request), session_id)
        if key not in gw.manager:
            raise BadRequest(source, f"{source} = {session_id!r}: no such session (a session is visible only "
                             "to the API key that made it)", 404)
        return key

    @app.get("/v1/shadowprefill/warmth")
    async def warmth_get(request: Request) -> Response:
        q = request.query_params
        try:
            for name in ("session_id", "model"):
                if name not in q:
                    raise BadRequest(name, f"{name}: is required (query parameter)")
            key = known_session(request, "session_id", q["session_id"], q["model"])
        except BadRequest as e:
            return _error(e.status, str(e), param=e.param)
        return JSONResponse(_warmth_json(q["session_id"], gw.warmth(key, q["model"])))

    @app.post("/v1/shadowprefill/warmth")
    async def warmth_post(request: Request) -> Response:
        try:
            body = parse_json(await request.body())
            check_body("warmth", body)
            key = known_session(request, "session_id", body["session_id"], body["model"])
        except BadRequest as e:
            return _error(e.status, str(e), param=e.param)
        ids = None
        if body.get("prompt") is not None or body.get("messages") is not None:
            ids = await _tokenize(gw, body["model"], body)
            if isinstance(ids, Response):
                return ids
        return JSONResponse(_warmth_json(body["session_id"], gw.warmth(key, body["model"], ids)))

    @app.delete("/v1/shadowprefill/sessions/{session_id:path}")
    async def end_session(request: Request, session_id: str) -> Response:
        try:
            check_session_id("session_id", session_id)
            key = gw.session_key(tenant_of(request), session_id)
            if key not in gw.manager:
                raise BadRequest("session_id", f"session_id = {session_id!r}: no such session (a session is "
                                 "visible only to the API key that made it)", 404)
        except BadRequest as e:
            return _error(e.status, str(e), param=e.param)
        return JSONResponse({"session_id": session_id, "ended": gw.end_session(key)})

    return app


def _shadow_outcome(ctx: CallContext) -> str:
    """What shadows did for this call: ``none`` (not a switch), ``used`` (cached
    tokens only a shadow had provided), ``cold`` (a switch with nothing
    cached), ``unused`` (cached, but not from a shadow), ``unknown``."""
    if not ctx.is_switch:
        return "none"
    if ctx.num_cached_tokens is None:
        return "unknown"
    if ctx.num_shadow_tokens_used:
        return "used"
    return "cold" if ctx.num_cached_tokens == 0 else "unused"


def _warmth_json(client_session_id: str, w: Any) -> dict[str, Any]:
    return {"session_id": client_session_id, "model": w.model, "instance": w.instance_id,
            "num_prompt_tokens": w.num_history_tokens, "num_expected_cached_tokens": w.num_expected_cached_tokens,
            "num_shadow_inflight_tokens": w.num_shadow_inflight_tokens}


async def _tokenize(gw: Gateway, model: str, body: dict[str, Any]) -> list[int] | Response:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return prompt
    req: dict[str, Any] = {"model": gw.config.model(model).upstream_name}
    if body.get("messages") is not None:
        req["messages"] = body["messages"]
        req["add_generation_prompt"] = bool(body.get("add_generation_prompt", True))
    elif isinstance(prompt, str):
        req["prompt"] = prompt
    else:
        return _error(400, "prompt: the warmth query counts one prompt, a string or a list of token ids",
                      param="prompt")
    for inst in gw.cluster.healthy_instances(model):
        try:
            r = await gw.client.post(inst.url + "/tokenize", json=req, headers=inst.config.auth_headers,
                                     timeout=gw.config.upstream.connect_timeout_s)
        except httpx.HTTPError as e:
            log.warning("tokenize on %s failed: %r", inst.id, e)
            continue
        if r.status_code == 200:
            return list(r.json().get("tokens", []))
        if r.status_code >= 500 or r.status_code in (401, 403):
            log.warning("tokenize on %s: status %d", inst.id, r.status_code)
            continue
        return Response(r.content, status_code=r.status_code, media_type="application/json")
    return _error(503, f"no healthy instance of {model!r} to tokenize with", "upstream_unavailable")
