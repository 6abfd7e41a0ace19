"""The gateway against fake OpenAI-compatible upstreams on loopback: routing,
token-id histories, shadow submission, warmth, streaming and metrics."""

from __future__ import annotations

import json
import time

import pytest
from shadow_gateway.config import from_dict
from shadow_gateway.fake_upstream import encode

from shadowcore.wire import parse_tag

from .conftest import two_model_config, wait_for

SESSION = {"X-Session-Id": "s1"}


def _complete(client, gw, model: str, prompt: str, session: str | None = "s1", **body):
    headers = {"X-Session-Id": session} if session else {}
    r = client.post(gw.url + "/v1/completions", headers=headers,
                    json={"model": model, "prompt": prompt, "max_tokens": 8, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_routed_call_feeds_a_shadow_and_the_switch_finds_it_cached(upstreams, gateway, client):
    (a,), (b,) = upstreams(1), upstreams(1)
    gw = gateway(two_model_config([a], [b]))
    prompt = "You are an agent. " * 6  # 108 bytes = 6 full blocks and a tail
    first = _complete(client, gw, "a", prompt)
    out_text = first["choices"][0]["text"]
    assert len(out_text) == 8
    assert "token_ids" not in first["choices"][0] and "prompt_token_ids" not in first["choices"][0]  # not asked for
    routed = a.requests[0][1]
    assert routed["return_token_ids"] is True
    assert parse_tag(routed["vllm_xargs"]).session_id == "s1"
    # the shadow on b covers the whole blocks of prompt + output, tagged for model b
    context = encode(prompt) + encode(out_text)
    aligned = len(context) // 16 * 16
    wait_for(lambda: any(len(s["prompt"]) == aligned for s in b.shadow_requests()), what="shadow of the context")
    shadow = next(s for s in b.shadow_requests() if len(s["prompt"]) == aligned)
    assert shadow["prompt"] == context[:aligned] and shadow["max_tokens"] == 1
    tag = parse_tag(shadow["vllm_xargs"])
    assert tag.is_shadow and tag.target_model == "b" and tag.session_id == "s1"
    wait_for(lambda: gw.metric("shadowprefill_gateway_shadow_tokens_submitted_total", model="b", mode="tagged")
             >= aligned, what="shadow completion")
    # the warmth query sees it before the switch
    w = client.get(gw.url + "/v1/shadowprefill/warmth", params={"session_id": "s1", "model": "b"}).json()
    assert w["num_expected_cached_tokens"] == aligned and w["num_prompt_tokens"] == len(context)
    next_prompt = prompt + out_text + " Tool result: ok."
    wp = client.post(gw.url + "/v1/shadowprefill/warmth",
                     json={"session_id": "s1", "model": "b", "prompt": next_prompt}).json()
    assert wp["num_expected_cached_tokens"] == aligned
    # the switch call on b: its context is cached there (the fake's own prefix cache says so)
    second = _complete(client, gw, "b", next_prompt)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == aligned
    assert gw.metric("shadowprefill_gateway_switch_calls_total", model="b") == 1
    assert gw.metric("shadowprefill_gateway_shadow_tokens_used_total", model="b") == aligned
    assert gw.metric("shadowprefill_gateway_calls_total", model="a", kind="routed") == 1


def test_a_shadow_the_engine_ends_early_counts_only_what_it_holds(upstreams, gateway, client):
    """The shadow scheduler ends a shadow whose tail is below its n_min and says
    how much it holds (``stop_reason`` ``held=N``): the gateway's warmth and
    counters take N, not the whole prompt, and it does not resend the same
    prefix until the context grows."""
    (a,), (b,) = upstreams(1), upstreams(1)
    b.shadow_short_tokens = 20  # the last 20 tokens stay uncomputed: one block less (and the tail) is held
    gw = gateway(two_model_config([a], [b]))
    prompt = "You are an agent. " * 6
    out_text = _complete(client, gw, "a", prompt)["choices"][0]["text"]
    context = encode(prompt) + encode(out_text)
    aligned = len(context) // 16 * 16
    held = (aligned - 20) // 16 * 16
    assert held < aligned
    wait_for(lambda: gw.metric("shadowprefill_gateway_shadow_requests_total", model="b", mode="tagged",
                               outcome="partial") == 1, what="the early end")
    assert gw.metric("shadowprefill_gateway_shadow_tokens_submitted_total", model="b", mode="tagged") == held
    w = client.get(gw.url + "/v1/shadowprefill/warmth", params={"session_id": "s1", "model": "b"}).json()
    assert w["num_expected_cached_tokens"] == held
    time.sleep(0.3)  # the lane refilled when the request ended: the declined job stays unsent
    assert len(b.shadow_requests()) == 1
    lane = next(lane for lane in gw.gateway.shadows.lanes.values() if lane.instance.model.name == "b")
    assert len(lane.declined) == 1
    second = _complete(client, gw, "b", prompt + out_text + " Tool result: ok.")
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == held
    assert gw.metric("shadowprefill_gateway_shadow_tokens_used_total", model="b") == held
    wait_for(lambda: not lane.declined, what="the decline forgotten once the context grew")  # no leak per job
    errors = [m for m in gw.gateway.metrics.registry.collect() if m.name == "shadowprefill_gateway_errors"]
    assert not [s for m in errors for s in m.samples if s.name.endswith("_total") and s.value]


def test_without_shadow_policy_the_switch_is_cold(upstreams, gateway, client):
    (a,), (b,) = upstreams(1), upstreams(1)
    gw = gateway(two_model_config([a], [b], shadow={"policy": "no-shadow"}))
    prompt = "You are an agent. " * 6
    out = _complete(client, gw, "a", prompt)["choices"][0]["text"]
    second = _complete(client, gw, "b", prompt + out + " Tool result: ok.")
    assert b.shadow_requests() == []
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert gw.metric("shadowprefill_gateway_fallbacks_total", reason="cold-switch") == 1


def test_streaming_chat_passes_chunks_and_streams_output_into_the_history(upstreams, gateway, client):
    (a,), (b,) = upstreams(1), upstreams(1)
    gw = gateway(two_model_config([a], [b]))
    messages = [{"role": "system", "content": "You are a coding agent. " * 4},
                {"role": "user", "content": "Fix the failing test."}]
    with client.stream("POST", gw.url + "/v1/chat/completions", headers=SESSION,
                       json={"model": "a", "messages": messages, "max_tokens": 8, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert len(text) == 8
    assert all("token_ids" not in c["choices"][0] and "prompt_token_ids" not in c for c in chunks)
    assert all(c["choices"] for c in chunks)  # the usage chunk the gateway asked for is not forwarded
    history = gw.gateway.manager.history("s1")
    from shadow_gateway.fake_upstream import chat_prompt

    assert history.token_ids.tolist() == encode(chat_prompt(messages)) + encode(text)
    # a follow-up that appends the assistant turn extends the same epoch (no divergence)
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Now run it."}]
    r = client.post(gw.url + "/v1/chat/completions", headers=SESSION,
                    json={"model": "a", "messages": messages, "max_tokens": 4,
                          "stream": True, "stream_options": {"include_usage": True}})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert chunks[-1]["usage"]["prompt_tokens"] > 0  # asked for by the client: forwarded
    text2 = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert gw.metric("shadowprefill_gateway_fallbacks_total", reason="history-diverged") == 0
    assert history.token_ids.tolist() == encode(chat_prompt(messages)) + encode(text2)


def test_calls_without_a_session_are_proxied_plainly(upstreams, gateway, client):
    (a,), (b,) = upstreams(1), upstreams(1)
    gw = gateway(two_model_config([a], [b]))
    body = _complete(client, gw, "a", "hello there", session=None)
    assert "prompt_token_ids" not in body
    sent = a.requests[-1][1]
    assert "return_token_ids" not in sent and "vllm_xargs" not in sent
    assert gw.gateway.manager.num_sessions == 0 and b.requests == []
    assert gw.metric("shadowprefill_gateway_calls_total", model="a", kind="plain") == 1


def test_client_errors_are_4xx_naming_the_problem(upstreams, gateway, client):
    (a,), (b,) = upstreams(1), upstreams(1)
    gw = gateway(two_model_config([a], [b]))
    r = client.post(gw.url + "/v1/completions", headers=SESSION, json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and "'nope'" in r.json()["error"]["message"]
    r = client.post(gw.url + "/v1/completions", content=b"{not json")
    assert r.status_code == 400 and "invalid JSON" in r.json()["error"]["message"]
    r = client.post(gw.url + "/v1/completions", json={"model": "a", "prompt": "x", "session_id": 7})
    assert r.status_code == 400 and "session_id = 7" in r.json()["error"]["message"]
    r = client.get(gw.url + "/v1/shadowprefill/warmth", params={"session_id": "s", "model": "zzz"})
    assert r.status_code == 404
    assert client.get(gw.url + "/v1/models").json()["data"][1]["id"] == "b"


def test_request_level_mode_on_stock_instances(upstreams, gateway, client):
    (a,), (b,) = upstreams(1), upstreams(1)
    gw = gateway(two_model_config([a], [b], scheduler_b="stock"))
    b.num_waiting = 1  # a busy destination gets no shadow
    prompt = "Plan the change. " * 5
    out = _complete(client, gw, "a", prompt)["choices"][0]["text"]
    wait_for(lambda: gw.gateway.shadows.request_level.stats.num_deferred >= 2, what="deferral")
    assert b.shadow_requests() == []
    b.num_waiting = 0
    wait_for(lambda: len(b.shadow_requests()) == 1, what="request-level shadow")
    shadow = b.shadow_requests()[0]
    assert shadow["prompt"] == encode(prompt) + encode(out)  # prompt + response, not block-trimmed
    assert shadow["priority"] > 0 and shadow["max_tokens"] == 1
    wait_for(lambda: gw.metric("shadowprefill_gateway_shadow_tokens_submitted_total", model="b",
                               mode="request-level") > 0, what="completion")
    second = _complete(client, gw, "b", prompt + out + " ok")
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == len(encode(prompt + out)) // 16 * 16


def test_metrics_endpoint_exposes_the_counters(upstreams, gateway, client):
    (a,), (b,) = upstreams(1), upstreams(1)
    gw = gateway(two_model_config([a], [b]))
    _complete(client, gw, "a", "x" * 40)
    text = client.get(gw.url + "/metrics").text
    for name in ("calls_total", "switch_calls", "cached_tokens", "shadow_tokens_submitted", "shadow_tokens_used",
                 "fallbacks", "errors"):
        assert f"shadowprefill_gateway_{name}" in text, name


def test_startup_refuses_models_that_tokenize_differently(upstreams, tmp_path, capsys):
    import asyncio

    from shadow_gateway.gateway import Gateway, TokenizerMismatch

    from shadowcore.cli import main as cli_main

    (a,), (b,), (c,) = upstreams(1), upstreams(1, vocab_offset=1), upstreams(1)
    assert asyncio.run(Gateway(from_dict(two_model_config([a], [c]))).check_tokenizers()).keys() == {"a", "b"}
    with pytest.raises(TokenizerMismatch, match=r"models\.b = 'b': tokenizes a probe text differently from models\.a"):
        asyncio.run(Gateway(from_dict(two_model_config([a], [b]))).check_tokenizers())
    a.kill()  # a model none of whose instances answers is skipped, never blocks startup
    assert asyncio.run(Gateway(from_dict(two_model_config([a], [b]))).check_tokenizers()).keys() == {"b"}
    cfg = tmp_path / "g.yaml"
    cfg.write_text(f"models:\n  a: {{instances: [{c.url}]}}\n  b: {{instances: [{b.url}]}}\n")
    assert cli_main(["serve", "--config", str(cfg), "--check"]) == 2
    assert "models.b = 'b': tokenizes a probe text differently" in capsys.readouterr().err
    cfg.write_text(cfg.read_text() + "tokenizer_check: false\n")
    assert cli_main(["serve", "--config", str(cfg), "--check"]) == 0
