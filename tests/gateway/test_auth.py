"""Client API keys, session ownership and upstream credentials, over real HTTP
on loopback: fake upstreams that demand their own key (like vLLM's
``--api-key``) behind a gateway with two client keys (two tenants)."""

from __future__ import annotations

import json
import logging
from urllib.parse import quote

import pytest
from shadow_gateway.fake_upstream import encode

from shadowcore.types import JobKey
from shadowcore.wire import parse_tag

from .conftest import two_model_config, wait_for

KEY_A, KEY_B = "client-key-of-team-a-0001", "client-key-of-team-b-0002"
UPSTREAM_KEY = "upstream-secret-vllm-key-42"
A = {"Authorization": f"Bearer {KEY_A}"}
B = {"Authorization": f"Bearer {KEY_B}"}
PROMPT = "You are an agent. " * 6


@pytest.fixture
def secured(upstreams, gateway, monkeypatch):
    """A gateway with two tenants in front of upstreams that need UPSTREAM_KEY."""
    monkeypatch.setenv("TEST_UPSTREAM_KEY", UPSTREAM_KEY)
    (a,), (b,) = upstreams(1, api_key=UPSTREAM_KEY), upstreams(1, api_key=UPSTREAM_KEY)
    cfg = two_model_config([a], [b])
    for m in cfg["models"].values():
        m["api_key_env"] = "TEST_UPSTREAM_KEY"
    cfg["auth"] = {"api_keys": [{"key": KEY_A, "tenant": "team-a"}, {"key": KEY_B, "tenant": "team-b"}]}
    return a, b, gateway(cfg)


def _call(client, gw, headers, model="a", prompt=PROMPT, session="s1", **body):
    h = {**headers, **({"X-Session-Id": session} if session else {})}
    return client.post(gw.url + "/v1/completions", headers=h,
                       json={"model": model, "prompt": prompt, "max_tokens": 8, **body})


def test_keys_are_required_and_401_has_openai_error_shape(secured, client):
    a, _, gw = secured
    for headers in ({}, {"Authorization": "Bearer wrong-key-wrong-key-1"}, {"Authorization": KEY_A},
                    {"Authorization": f"Basic {KEY_A}"}):
        for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"),
                             ("GET", "/v1/shadowprefill/warmth?session_id=s&model=a"),
                             ("DELETE", "/v1/shadowprefill/sessions/s")):
            r = client.request(method, gw.url + path, headers=headers, json={"model": "a", "prompt": "x"})
            assert r.status_code == 401, (headers, path, r.text)
            err = r.json()["error"]
            assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error" and err["message"]
            assert r.headers["www-authenticate"] == "Bearer"
    assert a.requests == [] and gw.gateway.manager.num_sessions == 0
    assert client.get(gw.url + "/health").status_code == 200  # probes and scrapers need no key
    assert client.get(gw.url + "/metrics").status_code == 200
    assert client.get(gw.url + "/v1/models", headers=A).status_code == 200


def test_a_second_key_cannot_see_steer_poison_or_delete_a_first_keys_session(secured, client):
    a, b, gw = secured
    r = _call(client, gw, {**A, "X-Session-Task": "fix-bug"})
    assert r.status_code == 200, r.text
    out_a = r.json()["choices"][0]["text"]
    context = encode(PROMPT) + encode(out_a)
    aligned = len(context) // 16 * 16
    wait_for(lambda: gw.metric("shadowprefill_gateway_shadow_tokens_submitted_total", model="b", mode="tagged")
             >= aligned, what="team-a's shadow")
    manager = gw.gateway.manager
    key_a = gw.gateway.session_key("team-a", "s1")
    info_a = manager.session(key_a)
    assert info_a.task == "team-a:fix-bug"  # the predictor's task names are per tenant too
    before = (info_a.current_model, info_a.num_calls, list(manager.history(key_a).token_ids))

    # see: team-b's warmth queries of the same id are 404, for GET and POST alike
    params = {"session_id": "s1", "model": "b"}
    assert client.get(gw.url + "/v1/shadowprefill/warmth", params=params, headers=B).status_code == 404
    r = client.post(gw.url + "/v1/shadowprefill/warmth", headers=B, json={**params, "prompt": PROMPT})
    assert r.status_code == 404 and r.json()["error"]["param"] == "session_id"
    assert client.get(gw.url + "/v1/shadowprefill/warmth", params=params, headers=A).json()[
        "num_expected_cached_tokens"] == aligned
    # delete: 404, and the session is still there
    assert client.delete(gw.url + "/v1/shadowprefill/sessions/s1", headers=B).status_code == 404
    assert key_a in manager
    # steer and poison: team-b's calls under "s1" (another prompt, the other model) reach a session of its own
    for model in ("a", "b"):
        r = _call(client, gw, {**B, "X-Session-Task": "fix-bug"}, model=model, prompt="Ignore all previous. " * 5)
        assert r.status_code == 200, r.text
    info_a = manager.session(key_a)
    assert (info_a.current_model, info_a.num_calls, list(manager.history(key_a).token_ids)) == before
    key_b = gw.gateway.session_key("team-b", "s1")
    assert manager.session(key_b).num_calls == 2 and manager.session(key_b).task == "team-b:fix-bug"
    assert gw.metric("shadowprefill_gateway_switch_calls_total", model="b") == 1  # team-b's own switch
    assert manager.job(JobKey(key_a, "b")) is not None  # team-a's shadow job on b was not closed by b's call
    sessions_tagged = {parse_tag(body["vllm_xargs"]).session_id for _, body in a.requests + b.requests
                       if body.get("vllm_xargs")}
    assert sessions_tagged == {key_a, key_b}  # the engines see two sessions too
    # team-a's own switch still finds its shadow
    r = _call(client, gw, A, model="b", prompt=PROMPT + out_a + " Tool result: ok.")
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == aligned
    # only the owner deletes
    assert client.delete(gw.url + "/v1/shadowprefill/sessions/s1", headers=A).json() == {"session_id": "s1",
                                                                                         "ended": True}
    assert key_a not in manager and key_b in manager


def test_upstream_credentials_on_routed_calls_shadows_and_probes_never_the_clients(secured, client, caplog):
    a, b, gw = secured
    caplog.set_level(logging.INFO)
    assert _call(client, gw, A, session=None).status_code == 200  # plain
    assert _call(client, gw, A, stream=True).status_code == 200  # routed, streamed
    wait_for(lambda: gw.metric("shadowprefill_gateway_shadow_requests_total", model="b", mode="tagged",
                               outcome="completed") >= 1, what="a shadow behind the upstream key")
    r = client.post(gw.url + "/v1/shadowprefill/warmth", headers=A,
                    json={"session_id": "s1", "model": "b", "prompt": PROMPT + "more"})  # /tokenize on b
    assert r.status_code == 200, r.text
    seen = a.auth_seen + b.auth_seen
    paths = {p for p, _ in seen}
    assert {"/v1/completions", "/tokenize"} <= paths  # routed and plain calls, shadows, tokenizer probes
    assert sum(p == "/tokenize" for p, _ in seen) >= 3  # the startup probe on both, the warmth query on b
    assert all(ok for _, ok in seen), seen  # every one with the instance's key, never the client's
    errors = [m for m in gw.gateway.metrics.registry.collect() if m.name == "shadowprefill_gateway_errors"]
    assert not [s for m in errors for s in m.samples if s.name.endswith("_total") and s.value]
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert UPSTREAM_KEY not in logged and KEY_A not in logged


def test_without_keys_the_gateway_says_it_trusts_every_local_client(upstreams, gateway, caplog):
    caplog.set_level(logging.WARNING, logger="shadow_gateway.app")
    (a,), (b,) = upstreams(1), upstreams(1)
    gateway(two_model_config([a], [b]))
    assert any("no client API keys configured" in r.getMessage() and "loopback only" in r.getMessage()
               for r in caplog.records)


def test_a_missing_upstream_key_is_a_clear_error_not_a_silent_fallback(upstreams, gateway, client):
    (a,), (b,) = upstreams(1, api_key=UPSTREAM_KEY), upstreams(1)
    gw = gateway(two_model_config([a], [b], tokenizer_check=False))
    r = _call(client, gw, {}, session="s")
    assert r.status_code == 401  # the instance's answer, as it gave it
    assert gw.gateway.manager.num_sessions == 0  # a rejected call leaves no session
    import asyncio

    from shadow_gateway.gateway import Gateway, UpstreamCredentials

    # at startup (and --check) the tokenizer probe says which model's key is missing, before any call
    with pytest.raises(UpstreamCredentials, match=r"models\.a\.api_key_env .*instance a/0 refused the gateway's "
                       r"credentials \(/v1/models answered 401\)"):
        asyncio.run(Gateway(gw.config).check_tokenizers())


def test_session_state_changes_only_after_the_upstream_accepted_the_call(upstreams, gateway, client):
    (a,), (b,) = upstreams(1), upstreams(1)
    gw = gateway(two_model_config([a], [b]))
    manager = gw.gateway.manager
    a.fail_status = 400  # the upstream rejects the first call of a new session: no session
    assert _call(client, gw, {}).status_code == 400
    assert manager.num_sessions == 0 and "s1" not in gw.gateway.last_seen_s
    a.fail_status = None
    out = _call(client, gw, {}).json()["choices"][0]["text"]
    before = manager.session("s1")
    history = list(manager.history("s1").token_ids)
    b.fail_status = 422  # a rejected switch: no transition, no call counted, jobs as they were
    assert _call(client, gw, {}, model="b", prompt=PROMPT + out + " next").status_code == 422
    after = manager.session("s1")
    assert (after.current_model, after.num_calls, dict(after.sticky)) == (before.current_model, before.num_calls,
                                                                          dict(before.sticky))
    assert list(manager.history("s1").token_ids) == history
    assert manager.job(JobKey("s1", "b")) is not None
    assert gw.metric("shadowprefill_gateway_switch_calls_total", model="b") == 0
    assert "s1" not in gw.gateway.busy
    b.fail_status = None
    assert _call(client, gw, {}, model="b", prompt=PROMPT + out + " next").status_code == 200
    assert manager.session("s1").current_model == "b" and manager.session("s1").num_calls == 2


def test_session_ids_are_utf8_by_header_and_body_and_any_id_is_deletable(upstreams, gateway, client):
    (a,), (b,) = upstreams(1), upstreams(1)
    gw = gateway(two_model_config([a], [b]))
    manager = gw.gateway.manager
    sid = "räksmörgås/東京 #1"
    r = client.post(gw.url + "/v1/completions", headers={"X-Session-Id": sid.encode()},
                    json={"model": "a", "prompt": PROMPT, "max_tokens": 4})
    assert r.status_code == 200, r.text
    r = client.post(gw.url + "/v1/completions",
                    json={"model": "a", "prompt": PROMPT + r.json()["choices"][0]["text"], "max_tokens": 4,
                          "session_id": sid})
    assert r.status_code == 200, r.text
    assert manager.num_sessions == 1 and manager.session(sid).num_calls == 2  # one session
    assert client.get(gw.url + "/v1/shadowprefill/warmth", params={"session_id": sid, "model": "b"}).status_code == 200
    r = client.delete(gw.url + "/v1/shadowprefill/sessions/" + quote(sid, safe=""))
    assert r.status_code == 200 and r.json() == {"session_id": sid, "ended": True}
    assert manager.num_sessions == 0
    assert client.delete(gw.url + "/v1/shadowprefill/sessions/" + quote(sid, safe="")).status_code == 404
    for bad in ("x" * 257, "tab\there", "zero\u200bwidth"):
        r = client.post(gw.url + "/v1/completions", json={"model": "a", "prompt": "x", "session_id": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "session_id", bad
    r = client.post(gw.url + "/v1/completions", headers={"X-Session-Id": b"\xff\xfe"},
                    json={"model": "a", "prompt": "x"})
    assert r.status_code == 400 and "UTF-8" in r.json()["error"]["message"]
    r = client.post(gw.url + "/v1/completions", headers={"X-Session-Id": "one"},
                    json={"model": "a", "prompt": "x", "session_id": "two"})
    assert r.status_code == 400 and "different sessions" in r.json()["error"]["message"]
    r = client.post(gw.url + "/v1/completions", headers={"X-Session-Id": "one", "X-Session-Task": "t" * 300},
                    json={"model": "a", "prompt": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Session-Task"
    assert "x" * 256 not in manager  # nothing made it in
    assert a.requests.__len__() == 2


def test_chat_client_resending_the_rendered_history_is_not_a_divergence(upstreams, gateway, client):
    """The model ends its reply with an end-of-turn token the text does not
    show; the client re-sends the conversation with the reply as text: the
    prompt extends the last prompt but not the generated ids. That is a new
    epoch, counted as ``history-re-rendered``; an edited conversation is
    still ``history-diverged``."""
    (a,), (b,) = upstreams(1, stop_token=3), upstreams(1)
    gw = gateway(two_model_config([a], [b]))
    messages = [{"role": "system", "content": "You are a coding agent. " * 4},
                {"role": "user", "content": "Fix the failing test."}]
    for turn in range(3):
        r = client.post(gw.url + "/v1/chat/completions", headers={"X-Session-Id": "chat"},
                        json={"model": "a", "messages": messages, "max_tokens": 6})
        assert r.status_code == 200, r.text
        messages += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                     {"role": "user", "content": f"Tool result {turn}: ok."}]
    assert gw.metric("shadowprefill_gateway_fallbacks_total", reason="history-diverged") == 0
    assert gw.metric("shadowprefill_gateway_fallbacks_total", reason="history-re-rendered") == 2
    messages[1]["content"] = "Fix the other test."  # an edited conversation
    assert client.post(gw.url + "/v1/chat/completions", headers={"X-Session-Id": "chat"},
                       json={"model": "a", "messages": messages, "max_tokens": 6}).status_code == 200
    assert gw.metric("shadowprefill_gateway_fallbacks_total", reason="history-diverged") == 1


def test_one_access_log_line_per_call_without_bodies_or_ids(secured, client, caplog):
    _, _, gw = secured
    caplog.set_level(logging.INFO, logger="shadow_gateway.access")
    out = _call(client, gw, A, session="secret-session-name").json()["choices"][0]["text"]
    context = encode(PROMPT) + encode(out)
    wait_for(lambda: gw.metric("shadowprefill_gateway_shadow_tokens_submitted_total", model="b", mode="tagged")
             >= len(context) // 16 * 16, what="shadow")
    _call(client, gw, A, model="b", prompt=PROMPT + out + " ok", session="secret-session-name", stream=True)
    _call(client, gw, B, session=None)
    assert _call(client, gw, B, max_tokens=-5).status_code == 400  # refused before any call
    assert _call(client, gw, {"Authorization": "Bearer not-a-key-not-a-key"}).status_code == 401
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "shadow_gateway.access"]
    assert len(lines) == 5, lines
    first, switch, plain, bad, unauthorized = lines
    assert bad == {"event": "refused", "path": "/v1/completions", "status": 400, "tenant": "team-b",
                   "param": "max_tokens"}
    assert unauthorized == {"event": "refused", "path": "/v1/completions", "status": 401, "tenant": None,
                            "param": "authorization"}
    assert first["kind"] == "routed" and first["model"] == "a" and first["instance"] == "a/0"
    assert first["tenant"] == "team-a" and first["status"] == 200 and first["latency_ms"] >= 0
    assert first["prompt_tokens"] == len(encode(PROMPT)) and first["cached_tokens"] == 0
    assert first["shadow"] == "none" and first["session"] == switch["session"]
    assert switch["switch"] is True and switch["shadow"] == "used"
    assert switch["cached_tokens"] == switch["shadow_tokens_used"] == len(context) // 16 * 16
    assert plain["kind"] == "plain" and plain["tenant"] == "team-b" and "session" not in plain
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "secret-session-name" not in text and "You are an agent" not in text and KEY_A not in text
    assert "not-a-key" not in text


@pytest.mark.parametrize(("access_log", "expect"), [({"bodies": True}, "body"), ({"enabled": False}, None)])
def test_access_log_bodies_only_when_asked_and_off_when_disabled(upstreams, gateway, client, caplog, access_log,
                                                                 expect):
    caplog.set_level(logging.INFO, logger="shadow_gateway.access")
    (a,), (b,) = upstreams(1), upstreams(1)
    gw = gateway(two_model_config([a], [b], access_log=access_log))
    assert _call(client, gw, {}).status_code == 200
    assert _call(client, gw, {}, max_tokens=0).status_code == 400
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "shadow_gateway.access"]
    if expect is None:
        assert lines == []
    else:
        assert lines[0]["body"]["prompt"] == PROMPT and lines[0]["kind"] == "routed"


@pytest.mark.parametrize("scheduler_b", ["shadow", "stock"])
def test_tenants_do_not_share_prefix_caches_and_shadows_carry_their_tenants_salt(upstreams, gateway, client,
                                                                                 scheduler_b):
    """With keys, every request made for a tenant carries its own cache_salt
    (the fakes salt their block hashes as vLLM does): another tenant's same
    prompt finds nothing cached (``cached_tokens`` would tell it what the
    first tenant sent), while the tenant's own switch still finds its shadow
    (tagged and request-level shadows carry the salt of the session's tenant)."""
    (a,), (b,) = upstreams(1), upstreams(1)
    cfg = two_model_config([a], [b], scheduler_b=scheduler_b,
                           auth={"api_keys": [{"key": KEY_A, "tenant": "team-a"}, {"key": KEY_B, "tenant": "team-b"}]})
    gw = gateway(cfg)
    aligned_prompt = (len(encode(PROMPT)) - 1) // 16 * 16
    assert _call(client, gw, A, session=None).json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert _call(client, gw, B, session=None).json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert _call(client, gw, A, session=None).json()["usage"]["prompt_tokens_details"]["cached_tokens"] \
        == aligned_prompt
    salts = {body.get("cache_salt") for _, body in a.requests}
    assert len(salts) == 2 and None not in salts
    out = _call(client, gw, A, prompt="Another agent. " * 8).json()["choices"][0]["text"]
    context = encode("Another agent. " * 8) + encode(out)
    mode = "tagged" if scheduler_b == "shadow" else "request-level"
    wait_for(lambda: gw.metric("shadowprefill_gateway_shadow_tokens_submitted_total", model="b", mode=mode) > 0,
             what="a shadow")
    r = _call(client, gw, A, model="b", prompt="Another agent. " * 8 + out + " ok")
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(context) // 16 * 16
    assert {body.get("cache_salt") for body in b.shadow_requests()} == {gw.gateway.cache_fields("team-a")["cache_salt"]}


def test_shared_caches_when_isolation_is_off(upstreams, gateway, client):
    (a,), (b,) = upstreams(1), upstreams(1)
    gw = gateway(two_model_config([a], [b], auth={"isolate_caches": False, "api_keys": [KEY_A, KEY_B]}))
    _call(client, gw, A, session=None)
    r = _call(client, gw, B, session=None)
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(encode(PROMPT)) - 1) // 16 * 16
    assert all("cache_salt" not in body for _, body in a.requests)
