"""A table of malformed requests, over real HTTP: every one is a 4xx in
OpenAI's error shape naming the field (no 500, no hang), and none reaches an
upstream or changes a session."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from shadow_gateway.fake_upstream import FakeUpstream

from .conftest import GatewayServer, two_model_config

C, CHAT, W = "/v1/completions", "/v1/chat/completions", "/v1/shadowprefill/warmth"
OK_C: dict[str, Any] = {"model": "a", "prompt": "hello", "max_tokens": 4}
OK_CHAT: dict[str, Any] = {"model": "a", "messages": [{"role": "user", "content": "hi"}]}
OK_W: dict[str, Any] = {"session_id": "s", "model": "a"}


def c(**fields: Any) -> dict[str, Any]:
    return {**OK_C, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {**OK_CHAT, **fields}


def msg(**fields: Any) -> dict[str, Any]:
    return chat(messages=[{"role": "user", "content": "hi", **fields}])


def without(d: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k != key}


# (method, path, body: dict or raw bytes or None, expected status, expected param or None)
CASES: list[tuple[str, str, Any, int, str | None]] = [
    # the JSON itself
    ("POST", C, b"{not json", 400, None),
    ("POST", C, b"", 400, None),
    ("POST", C, b"[1, 2]", 400, None),
    ("POST", C, b'"a string"', 400, None),
    ("POST", C, b'{"model": "a", "prompt": "x", "max_tokens": NaN}', 400, None),
    ("POST", C, b'{"model": "a", "prompt": "x", "temperature": Infinity}', 400, None),
    ("POST", C, b'{"model": "a", "prompt": "x", "top_p": -Infinity}', 400, None),
    ("POST", C, b'{"model": "a", "prompt": "x", "temperature": 1e400}', 400, None),
    ("POST", C, b'{"model": "a", "prompt": "x", "top_k": NaN}', 400, None),  # a field only vLLM checks
    ("POST", C, b'{"model": "a", "prompt": "x", "vllm_xargs": {"k": [1, -Infinity]}}', 400, None),
    ("POST", C, b'{"model": "a", "prompt": "\xff\xfe"}', 400, None),
    ("POST", C, b"[" * 100_000, 400, None),
    ("POST", C, json.dumps(c(prompt=list(range(250_000)) + ["x"])).encode(), 400, "prompt"),  # > 1 MiB: off the loop
    # numbers: types and ranges
    ("POST", C, c(max_tokens=-5), 400, "max_tokens"),
    ("POST", C, c(max_tokens=0), 400, "max_tokens"),
    ("POST", C, c(max_tokens=1.5), 400, "max_tokens"),
    ("POST", C, c(max_tokens="8"), 400, "max_tokens"),
    ("POST", C, c(max_tokens=True), 400, "max_tokens"),
    ("POST", C, c(temperature=3), 400, "temperature"),
    ("POST", C, c(temperature="hot"), 400, "temperature"),
    ("POST", C, c(top_p=1.5), 400, "top_p"),
    ("POST", C, c(n=0), 400, "n"),
    ("POST", C, c(presence_penalty=5), 400, "presence_penalty"),
    ("POST", C, c(frequency_penalty=-3), 400, "frequency_penalty"),
    ("POST", C, c(seed="x"), 400, "seed"),
    ("POST", C, c(logprobs=50), 400, "logprobs"),
    ("POST", C, c(logit_bias={"1": 500}), 400, "logit_bias.1"),
    # flags and objects
    ("POST", C, c(stream="yes"), 400, "stream"),
    ("POST", C, c(stream=True, stream_options="yes"), 400, "stream_options"),
    ("POST", C, c(stream=True, stream_options=[1]), 400, "stream_options"),
    ("POST", C, c(stream=True, stream_options={"include_usage": "yes"}), 400, "stream_options.include_usage"),
    ("POST", C, c(echo="yes"), 400, "echo"),
    ("POST", C, c(return_token_ids="yes"), 400, "return_token_ids"),
    ("POST", C, c(vllm_xargs="x"), 400, "vllm_xargs"),
    ("POST", C, c(vllm_xargs=[1]), 400, "vllm_xargs"),
    ("POST", C, c(vllm_xargs={"k": {"a": 1}}), 400, "vllm_xargs.k"),
    # what only the gateway sets
    ("POST", C, c(vllm_xargs={"shadowprefill_kind": "shadow", "shadowprefill_session": "victim"}), 400,
     "vllm_xargs.shadowprefill_kind"),
    ("POST", C, c(vllm_xargs={"shadowprefill_session": "victim"}), 400, "vllm_xargs.shadowprefill_session"),
    ("POST", C, c(priority=-100), 400, "priority"),
    ("POST", C, c(shadowprefill_kind="routed"), 400, "shadowprefill_kind"),
    # prompt, model, stop
    ("POST", C, without(OK_C, "prompt"), 400, "prompt"),
    ("POST", C, c(prompt=5), 400, "prompt"),
    ("POST", C, c(prompt=None), 400, "prompt"),
    ("POST", C, c(prompt=[1, "a"]), 400, "prompt"),
    ("POST", C, c(prompt=[-1]), 400, "prompt"),
    ("POST", C, c(prompt={"text": "x"}), 400, "prompt"),
    ("POST", C, c(model=5), 400, "model"),
    ("POST", C, c(model="nope"), 404, "model"),
    ("POST", C, c(stop=3), 400, "stop"),
    ("POST", C, c(stop=[1]), 400, "stop[0]"),
    # session ids
    ("POST", C, c(session_id=7), 400, "session_id"),
    ("POST", C, c(session_id=""), 400, "session_id"),
    ("POST", C, c(session_id="x" * 257), 400, "session_id"),
    ("POST", C, c(session_id="line\nbreak"), 400, "session_id"),
    ("POST", C, c(session_id=["s"]), 400, "session_id"),
    # chat messages
    ("POST", CHAT, without(OK_CHAT, "messages"), 400, "messages"),
    ("POST", CHAT, chat(messages=[]), 400, "messages"),
    ("POST", CHAT, chat(messages="hi"), 400, "messages"),
    ("POST", CHAT, chat(messages=[1]), 400, "messages[0]"),
    ("POST", CHAT, chat(messages=[{"content": "x"}]), 400, "messages[0].role"),
    ("POST", CHAT, msg(role="robot"), 400, "messages[0].role"),
    ("POST", CHAT, msg(content=5), 400, "messages[0].content"),
    ("POST", CHAT, msg(content={"a": 1}), 400, "messages[0].content"),
    ("POST", CHAT, msg(content=[{"type": "text", "text": 5}]), 400, "messages[0].content[0].text"),
    ("POST", CHAT, msg(name=3), 400, "messages[0].name"),
    ("POST", CHAT, chat(max_completion_tokens=-1), 400, "max_completion_tokens"),
    ("POST", CHAT, chat(logprobs=3), 400, "logprobs"),
    ("POST", CHAT, chat(tools="x"), 400, "tools"),
    ("POST", CHAT, chat(stream=True, stream_options=7), 400, "stream_options"),
    ("POST", CHAT, chat(vllm_xargs={"shadowprefill_kind": "shadow"}), 400, "vllm_xargs.shadowprefill_kind"),
    ("POST", CHAT, json.dumps(chat(messages=[{"role": "user", "content": "x"}] * 50_000
                                   + [{"role": "user", "content": 5}])).encode(), 400, "messages[50000].content"),
    # the warmth query and DELETE
    ("POST", W, {**OK_W, "session_id": 7}, 400, "session_id"),
    ("POST", W, without(OK_W, "session_id"), 400, "session_id"),
    ("POST", W, without(OK_W, "model"), 400, "model"),
    ("POST", W, {**OK_W, "model": 5}, 400, "model"),
    ("POST", W, {**OK_W, "model": "nope"}, 404, "model"),
    ("POST", W, {**OK_W, "prompt": 5}, 400, "prompt"),
    ("POST", W, {**OK_W, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("POST", W, {**OK_W, "colour": "red"}, 400, "colour"),
    ("POST", W, b"{bad", 400, None),
    ("POST", W, OK_W, 404, "session_id"),  # no such session
    ("GET", W, None, 400, "session_id"),
    ("GET", W + "?session_id=s", None, 400, "model"),
    ("GET", W + "?session_id=s&model=nope", None, 404, "model"),
    ("GET", W + "?session_id=&model=a", None, 400, "session_id"),
    ("DELETE", "/v1/shadowprefill/sessions/", None, 400, "session_id"),
    ("DELETE", "/v1/shadowprefill/sessions/none%2Fsuch", None, 404, "session_id"),
    # routes
    ("GET", C, None, 405, None),
    ("POST", "/v1/nothing", c(), 404, None),
]


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[GatewayServer, FakeUpstream, FakeUpstream]]:
    a, b = FakeUpstream("fa").start(), FakeUpstream("fb").start()
    gw = GatewayServer(two_model_config([a], [b])).start()
    yield gw, a, b
    gw.stop()
    a.kill()
    b.kill()


def test_the_table_has_enough_cases():
    assert len(CASES) >= 40


@pytest.mark.parametrize(("method", "path", "body", "status", "param"), CASES,
                         ids=[f"{i}-{m}-{p.rsplit('/', 1)[-1][:20]}" for i, (m, p, *_rest) in enumerate(CASES)])
def test_malformed_request_is_a_4xx_naming_the_field(served, method, path, body, status, param):
    gw, a, b = served
    kw: dict[str, Any] = {}
    if isinstance(body, bytes):
        kw = {"content": body, "headers": {"content-type": "application/json"}}
    elif body is not None:
        kw = {"content": json.dumps(body).encode(), "headers": {"content-type": "application/json",
                                                                  "X-Session-Id": "victim"}}
        if "session_id" in body and path != W:
            kw["headers"].pop("X-Session-Id")
    r = httpx.request(method, gw.url + path, timeout=5.0, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param, err
        assert param.split(".")[0].split("[")[0] in err["message"], err
    assert a.requests == [] and b.requests == []  # nothing reached an upstream
    assert gw.gateway.manager.num_sessions == 0 and not gw.gateway.busy  # no session made or held
