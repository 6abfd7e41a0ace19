"""A fake OpenAI-compatible upstream (the parts of vLLM's server the gateway
uses) on a real loopback socket, with fault injection.

It tokenizes bytes (token id = byte value, plus ``vocab_offset`` to play a
model with another tokenizer), applies a one-line chat template,
keeps a block-level prefix cache (so ``usage.prompt_tokens_details.cached_tokens``
is real for its own requests; a request's ``cache_salt`` seeds its block
hashes, as in vLLM), streams SSE like vLLM (``return_token_ids``,
``stream_options.include_usage``), and serves ``/tokenize``, ``/health`` and
``/metrics`` (``vllm:num_requests_waiting``).

Faults, switchable while it runs: ``fail_status`` (answer every completion
with that status), ``fail_shadows_only``, ``hang`` (never answer), ``delay_s``
before answering, ``die_after_tokens`` (drop the connection mid-stream),
:meth:`FakeUpstream.kill` (stop listening and drop connections).

``api_key`` plays a server started with ``--api-key``: every endpoint but
``/health`` answers 401 without ``Authorization: Bearer <api_key>``
(stricter than vLLM, which guards ``/v1`` only), and ``auth_seen`` records
(path, whether the key was right) for each request.

``stop_token`` plays a model that ends its reply with an end-of-turn token:
the output's last id is ``stop_token`` (a special token: not in the text),
``finish_reason`` ``stop``.

A request with ``kv_transfer_params.do_remote_decode`` (a P/D prefill) is
answered with ``kv_transfer_params`` as vLLM's ``NixlConnector`` answers
(``do_remote_prefill``, this fake's name as ``remote_engine_id``, the
prompt's length as ``remote_num_tokens``); no KV moves between fakes.

``shadow_short_tokens`` plays the shadow scheduler ending a tagged shadow
early (a tail below its ``n_min``): it caches the prompt's whole blocks but
the last ``shadow_short_tokens`` tokens, and says so in ``stop_reason``
(``shadowprefill:tail-below-n-min held=N``, :class:`shadowcore.wire.ShadowStop`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import threading
import time
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from shadowcore.wire import ShadowEnd, ShadowStop


def encode(text: str) -> list[int]:
    return list(text.encode())


def chat_prompt(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    text = "".join(f"<|{m['role']}|>{m.get('content') or ''}\n" for m in messages)
    return text + ("<|assistant|>" if add_generation_prompt else "")


class _KeyCheck:
    """ASGI middleware of :attr:`FakeUpstream.api_key`."""

    def __init__(self, app: Any, fake: FakeUpstream) -> None:
        self.app, self.fake = app, fake

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        key = self.fake.api_key
        if scope["type"] != "http" or key is None or scope["path"] == "/health":
            await self.app(scope, receive, send)
            return
        ok = (b"authorization", f"Bearer {key}".encode()) in scope["headers"]
        self.fake.auth_seen.append((scope["path"], ok))
        if not ok:
            await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class FakeUpstream:
    def __init__(self, name: str = "fake", block_size: int = 16, token_delay_s: float = 0.0,
                 vocab_offset: int = 0, api_key: str | None = None, stop_token: int | None = None) -> None:
        self.name = name
        self.api_key = api_key
        self.stop_token = stop_token
        self.auth_seen: list[tuple[str, bool]] = []
        self.vocab_offset = vocab_offset
        self.block_size = block_size
        self.token_delay_s = token_delay_s
        self.fail_status: int | None = None
        self.fail_shadows_only = False
        self.hang = False
        self.delay_s = 0.0
        self.die_after_tokens: int | None = None
        self.num_waiting = 0
        self.shadow_short_tokens = 0
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self._cache: set[bytes] = set()
        self._lock = threading.Lock()
        self.app = Starlette(middleware=[Middleware(_KeyCheck, fake=self)], routes=[
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/tokenize", self._tokenize, methods=["POST"]),
            Route("/health", self._health),
            Route("/metrics", self._metrics),
        ])
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="error", lifespan="off",
                                                    timeout_graceful_shutdown=0))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> FakeUpstream:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake upstream did not start")
            time.sleep(0.01)
        return self

    def kill(self) -> None:
        """Stop listening and drop open connections (a dead instance)."""
        self.server.should_exit = True
        self.server.force_exit = True
        self.thread.join(timeout=5)
        try:
            self.sock.close()
        except OSError:
            pass

    # -- cache ---------------------------------------------------------------------------
    def _hashes(self, ids: list[int], salt: str | None = None) -> list[bytes]:
        """Block hashes, chained; a ``cache_salt`` seeds the chain (as vLLM's does)."""
        out, parent = [], (salt or "").encode()
        for i in range(len(ids) // self.block_size):
            block = ids[i * self.block_size:(i + 1) * self.block_size]
            parent = hashlib.blake2b(parent + json.dumps(block).encode(), digest_size=8).digest()
            out.append(parent)
        return out

    def cached_tokens(self, ids: list[int], salt: str | None = None) -> int:
        n = 0
        with self._lock:
            for h in self._hashes(ids[: max(0, len(ids) - 1)], salt):
                if h not in self._cache:
                    break
                n += self.block_size
        return n

    def _insert(self, ids: list[int], salt: str | None = None) -> None:
        with self._lock:
            self._cache.update(self._hashes(ids, salt))

    def shadow_requests(self) -> list[dict[str, Any]]:
        return [b for _, b in self.requests if (b.get("vllm_xargs") or {}).get("shadowprefill_kind") == "shadow"
                or b.get("priority", 0) > 0]

    def routed_requests(self) -> list[dict[str, Any]]:
        return [b for b in (b for _, b in self.requests) if b not in self.shadow_requests()]

    # -- endpoints -----------------------------------------------------------------------
    async def _health(self, _request: Request) -> Response:
        return PlainTextResponse("")

    async def _metrics(self, _request: Request) -> Response:
        return PlainTextResponse(f'vllm:num_requests_waiting{{model_name="{self.name}"}} {self.num_waiting}\n')

    async def _tokenize(self, request: Request) -> Response:
        body = await request.json()
        if "messages" in body:
            ids = encode(chat_prompt(body["messages"], body.get("add_generation_prompt", True)))
        else:
            ids = encode(body["prompt"])
        ids = [t + self.vocab_offset for t in ids]
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": 1 << 20})

    async def _completions(self, request: Request) -> Response:
        body = await request.json()
        prompt = body["prompt"]
        ids = prompt if isinstance(prompt, list) else encode(prompt)
        return await self._answer("/v1/completions", body, ids, chat=False)

    async def _chat(self, request: Request) -> Response:
        body = await request.json()
        return await self._answer("/v1/chat/completions", body, encode(chat_prompt(body["messages"])), chat=True)

    async def _answer(self, path: str, body: dict[str, Any], ids: list[int], chat: bool) -> Response:
        self.requests.append((path, body))
        is_shadow = (body.get("vllm_xargs") or {}).get("shadowprefill_kind") == "shadow" or body.get("priority", 0) > 0
        if self.hang:
            await asyncio.sleep(3600)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail_status is not None and (is_shadow or not self.fail_shadows_only):
            return JSONResponse({"error": {"message": "injected failure", "code": self.fail_status}},
                                status_code=self.fail_status)
        salt = body.get("cache_salt")
        cached = self.cached_tokens(ids, salt)
        n_out = int(body.get("max_tokens") or 8)
        out = [ord("a") + (sum(ids) + i) % 26 for i in range(n_out)]
        finish = "length"
        if self.stop_token is not None and not tagged_shadow(body):
            out[-1], finish = self.stop_token, "stop"
        tagged = (body.get("vllm_xargs") or {}).get("shadowprefill_kind") == "shadow"
        if tagged and self.shadow_short_tokens:
            held = max(0, len(ids) - self.shadow_short_tokens) // self.block_size * self.block_size
            self._insert(ids[:held], salt)
            stop = ShadowStop(ShadowEnd.BELOW_N_MIN, held).to_stop_reason()
            return JSONResponse({"id": "cmpl-1", "object": "text_completion", "model": body.get("model"),
                                 "choices": [{"index": 0, "text": "", "finish_reason": "stop", "stop_reason": stop}],
                                 "usage": {"prompt_tokens": len(ids), "completion_tokens": 0,
                                           "total_tokens": len(ids)}})
        self._insert(ids + out[:-1], salt)
        usage = {"prompt_tokens": len(ids), "completion_tokens": n_out, "total_tokens": len(ids) + n_out,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        want_ids = bool(body.get("return_token_ids"))
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(self._stream(body, ids, out, usage, chat, want_ids, include_usage, finish),
                                     media_type="text/event-stream")
        text = _text(out, self.stop_token)
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if want_ids:
            choice["token_ids"] = out
        data: dict[str, Any] = {"id": "cmpl-1", "object": "chat.completion" if chat else "text_completion",
                                "model": body.get("model"), "choices": [choice], "usage": usage}
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            data["kv_transfer_params"] = {"do_remote_prefill": True, "do_remote_decode": False,
                                          "remote_engine_id": self.name, "remote_num_tokens": len(ids),
                                          "remote_block_ids": [list(range(len(ids) // self.block_size))]}
        if want_ids:  # like vLLM: top level for chat, in the choice for completions
            (data if chat else choice)["prompt_token_ids"] = ids
        return JSONResponse(data)

    async def _stream(self, body: dict[str, Any], ids: list[int], out: list[int], usage: dict[str, Any], chat: bool,
                      want_ids: bool, include_usage: bool, finish: str = "length"):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choice: dict[str, Any], **extra: Any) -> bytes:
            data = {"id": "cmpl-1", "object": obj, "model": body.get("model"), "choices": [choice], **extra}
            return f"data: {json.dumps(data)}\n\n".encode()

        first_extra = {"prompt_token_ids": ids} if want_ids and chat else {}
        if chat:
            yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None},
                        **first_extra)
            first_extra = {}
        for i, t in enumerate(out):
            if self.die_after_tokens is not None and i >= self.die_after_tokens:
                raise ConnectionResetError("injected: instance died mid-stream")
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            last = i == len(out) - 1
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish if last else None}
            if chat:
                choice["delta"] = {"content": _text([t], self.stop_token)}
            else:
                choice["text"] = _text([t], self.stop_token)
            if want_ids:
                choice["token_ids"] = [t]
                if not chat:
                    choice["prompt_token_ids"] = ids if i == 0 else None
            yield chunk(choice, **first_extra)
            first_extra = {}
        if include_usage:
            yield f"data: {json.dumps({'id': 'cmpl-1', 'object': obj, 'choices': [], 'usage': usage})}\n\n".encode()
        yield b"data: [DONE]\n\n"


def tagged_shadow(body: dict[str, Any]) -> bool:
    return (body.get("vllm_xargs") or {}).get("shadowprefill_kind") == "shadow"


def _text(ids: list[int], stop_token: int | None) -> str:
    """The text of output ids (a special stop token has none)."""
    return bytes(t for t in ids if t != stop_token).decode()


def main(argv: list[str] | None = None) -> int:
    """``python -m shadow_gateway.fake_upstream --count N``: serve N fakes on
    loopback, print one URL per line, run until interrupted."""
    import argparse
    import signal
    import sys

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=2)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--token-delay-s", type=float, default=0.0)
    args = p.parse_args(argv)
    fakes = [FakeUpstream(f"fake{i}", args.block_size, args.token_delay_s).start() for i in range(args.count)]
    for f in fakes:
        print(f.url, flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    for f in fakes:
        f.kill()
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
