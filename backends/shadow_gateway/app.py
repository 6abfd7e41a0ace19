"""HTTP surface of the gateway (FastAPI).

Endpoints: ``POST /v1/chat/completions`` and ``POST /v1/completions``
(OpenAI-compatible, ``stream`` included), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus), the warmth query
``GET /v1/shadowprefill/warmth?session_id=S&model=M`` (or ``POST`` with the
next ``prompt`` / ``messages`` to count that prompt's expected cached tokens)
and ``DELETE /v1/shadowprefill/sessions/{session_id}``.

Invariant: a client error (bad JSON, unknown model, bad session id) is a 4xx
with an OpenAI-style ``{"error": {...}}`` body naming the problem; an upstream
that fails every attempt gives its own status and body (or 502/503).
"""

from __future__ import annotations

import contextlib
import json
import logging
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from shadow_gateway.config import GatewayConfig
from shadow_gateway.gateway import UPSTREAM_ERRORS, Gateway, UpstreamFailed
from shadow_gateway.router import RouteError

log = logging.getLogger("shadow_gateway.app")
FORWARDED_HEADERS = ("authorization", "x-request-id")


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def create_app(config: GatewayConfig, gateway: Gateway | None = None) -> FastAPI:
    gw = gateway or Gateway(config)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        await gw.start()
        try:
            yield
        finally:
            await gw.stop()

    app = FastAPI(title="shadowprefill gateway", lifespan=lifespan)
    app.state.gateway = gw

    async def proxy(request: Request, endpoint: str, path: str) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            return _error(400, f"invalid JSON body: {e}")
        if not isinstance(body, dict):
            return _error(400, "invalid JSON body: the body must be a JSON object")
        try:
            session_id, task = gw.session_of(request.headers, body)
            model = gw.choose_model(endpoint, body, session_id)
        except RouteError as e:
            return _error(404 if "not served" in str(e) else 400, str(e))
        ctx = gw.begin_routed(session_id, model, task, body) if session_id else None
        if ctx is None:
            gw.metrics.calls.labels(model, "plain").inc()
        else:
            gw.metrics.calls.labels(model, "routed").inc()
            if ctx.is_switch:
                gw.metrics.switch_calls.labels(model).inc()
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        try:
            resp, inst = await gw.open_upstream(path, body, model, ctx, headers)
        except UpstreamFailed as e:
            if ctx is not None:
                gw.end_routed(ctx, ok=False)
            return Response(e.body, status_code=e.status, media_type=e.headers.get("content-type") or
                            "application/json")
        except BaseException:
            if ctx is not None:
                gw.end_routed(ctx, ok=False)
            raise
        on_end = (lambda ok: gw.end_routed(ctx, ok)) if ctx is not None else (lambda ok: None)
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
        healthy = {m: len(gw.cluster.healthy_instances(m)) for m in gw.models}
        ok = all(healthy.values())
        return JSONResponse({"status": "ok" if ok else "degraded", "healthy_instances": healthy},
                            status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/shadowprefill/warmth")
    async def warmth_get(session_id: str, model: str) -> Response:
        try:
            return JSONResponse(_warmth_json(gw.warmth(session_id, model)))
        except RouteError as e:
            return _error(404, str(e))

    @app.post("/v1/shadowprefill/warmth")
    async def warmth_post(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
            session_id, model = body["session_id"], body["model"]
        except (ValueError, KeyError, TypeError) as e:
            return _error(400, f"the body needs session_id and model: {e!r}")
        if model not in gw.models:
            return _error(404, f"model {model!r} is not served here (models: {', '.join(gw.models)})")
        ids = None
        if "prompt" in body or "messages" in body:
            ids = await _tokenize(gw, model, body)
            if isinstance(ids, Response):
                return ids
        return JSONResponse(_warmth_json(gw.warmth(session_id, model, ids)))

    @app.delete("/v1/shadowprefill/sessions/{session_id}")
    async def end_session(session_id: str) -> Response:
        return JSONResponse({"session_id": session_id, "ended": gw.end_session(session_id)})

    return app


def _warmth_json(w: Any) -> dict[str, Any]:
    return {"session_id": w.session_id, "model": w.model, "instance": w.instance_id,
            "num_prompt_tokens": w.num_history_tokens, "num_expected_cached_tokens": w.num_expected_cached_tokens,
            "num_shadow_inflight_tokens": w.num_shadow_inflight_tokens}


async def _tokenize(gw: Gateway, model: str, body: dict[str, Any]) -> list[int] | Response:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return prompt
    req: dict[str, Any] = {"model": gw.config.model(model).upstream_name}
    if "messages" in body:
        req["messages"] = body["messages"]
        req["add_generation_prompt"] = bool(body.get("add_generation_prompt", True))
    elif isinstance(prompt, str):
        req["prompt"] = prompt
    else:
        return _error(400, "prompt must be a string or a list of token ids")
    for inst in gw.cluster.healthy_instances(model):
        try:
            r = await gw.client.post(inst.url + "/tokenize", json=req, timeout=gw.config.upstream.connect_timeout_s)
        except httpx.HTTPError as e:
            log.warning("tokenize on %s failed: %r", inst.id, e)
            continue
        if r.status_code == 200:
            return list(r.json().get("tokens", []))
        return Response(r.content, status_code=r.status_code, media_type="application/json")
    return _error(503, f"no healthy instance of {model!r} to tokenize with", "upstream_unavailable")
