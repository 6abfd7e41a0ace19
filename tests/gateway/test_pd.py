"""P/D deployments through the gateway, against fake upstreams on loopback:
configuration errors name the field; a call goes to the sticky P with
``do_remote_decode`` and one token, then to the sticky D with the
``kv_transfer_params`` P answered; shadows run on the non-chosen model's
sticky P and their prefixes are pushed toward its sticky D. (The fakes move
no KV; tests/gateway/test_pd_vllm.py runs the same path on real vLLM engines.)"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from shadow_gateway.config import from_dict, parse_config
from shadow_gateway.fake_upstream import encode

from shadowcore.errors import ConfigError
from shadowcore.wire import parse_tag

from .conftest import wait_for

S = {"X-Session-Id": "s1"}


def _pd_config(p_a, d_a, p_b, d_b, **extra: Any) -> dict[str, Any]:
    return {
        "models": {
            "a": {"block_size": 16, "prefill_instances": [u.url for u in p_a], "decode_instances": [u.url for u in d_a]},
            "b": {"block_size": 16, "instances": [{"url": u.url, "role": "prefill"} for u in p_b]
                  + [{"url": u.url, "role": "decode", "scheduler": "stock"} for u in d_b]},
        },
        "shadow": {"policy": "harvest-slo"},
        "health": {"interval_s": 0.1, "timeout_s": 0.5, "unhealthy_after": 1},
        "upstream": {"connect_timeout_s": 0.5, "read_timeout_s": 2.0, "retries": 1},
        "shadow_submit": {"timeout_s": 0.5, "connect_timeout_s": 0.2, "backoff_s": 0.1},
        **extra,
    }


@pytest.mark.parametrize(("yaml_models", "field", "problem"), [
    ("a: {prefill_instances: [http://127.0.0.1:1]}", "models.a.decode_instances", "at least one decode"),
    ("a: {decode_instances: [http://127.0.0.1:1]}", "models.a.prefill_instances", "at least one prefill"),
    ("a: {instances: [http://127.0.0.1:1], decode_instances: [http://127.0.0.1:2]}",
     "models.a.instances[0].role", "all prefill or decode"),
    ("a: {instances: [{url: 'http://127.0.0.1:1', role: prefil}]}", "models.a.instances[0].role", "must be one of"),
    ("a: {prefill_instances: [{url: 'http://127.0.0.1:1', role: decode}], decode_instances: [http://127.0.0.1:2]}",
     "models.a.prefill_instances[0].role", "has role 'prefill'"),
    ("a: {prefill_instances: [], decode_instances: [http://127.0.0.1:2]}", "models.a.prefill_instances",
     "non-empty list"),
    ("a: {prefill_instances: [http://127.0.0.1:1], decode_instances: [http://127.0.0.1:1]}",
     "models.a.decode_instances[0].url", "duplicates the URL"),
    (("a: {prefill_instances: [http://127.0.0.1:1], decode_instances: [http://127.0.0.1:2], "
      "shadow_instance: http://127.0.0.1:3}"), "models.a.shadow_instance", "not supported"),
    ("a: {}", "models.a.instances", "is required"),
])
def test_pd_config_errors_name_the_field(yaml_models, field, problem):
    with pytest.raises(ConfigError) as e:
        parse_config("models:\n  " + yaml_models + "\n", source="g.yaml")
    assert e.value.field == field and problem in str(e.value) and "(g.yaml:" in str(e.value)


def test_pd_config_roles_and_ids():
    cfg = parse_config("models:\n  a: {prefill_instances: [http://127.0.0.1:1], decode_instances: "
                       "[http://127.0.0.1:2, http://127.0.0.1:3]}\n  b: {instances: [http://127.0.0.1:4]}\n"
                       "pd: {push: false}\n")
    a, b = cfg.model("a"), cfg.model("b")
    assert a.is_pd and not b.is_pd and not cfg.pd.push
    assert [i.id for i in a.prefill_instances] == ["a/p0"] and [i.id for i in a.decode_instances] == ["a/d0", "a/d1"]
    assert [i.id for i in b.prefill_instances] == ["b/0"] and b.decode_instances == ()
    with pytest.raises(ConfigError, match=r"^pd.push_timeout_s"):
        from_dict({"models": {"a": {"instances": ["http://127.0.0.1:1"]}}, "pd": {"push_timeout_s": 0}})


def test_example_pd_config_loads():
    from pathlib import Path

    from shadow_gateway.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[2] / "examples" / "gateway-pd.yaml")
    assert all(m.is_pd for m in cfg.models) and cfg.pd.push
    assert [i.id for i in cfg.model("tiny-b").instances] == ["tiny-b/p0", "tiny-b/d0"]


def _call(client, gw, model: str, prompt: str, **body: Any) -> dict[str, Any]:
    r = client.post(gw.url + "/v1/completions", headers=S, json={"model": model, "prompt": prompt, "max_tokens": 8,
                                                                 **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_pd_call_goes_p_then_sticky_d_and_shadows_push_toward_the_other_models_d(upstreams, gateway, client):
    p_a, d_a, p_b, d_b = upstreams(1), upstreams(2), upstreams(1), upstreams(1)
    gw = gateway(_pd_config(p_a, d_a, p_b, d_b))
    prompt = "You are an agent. " * 6
    first = _call(client, gw, "a", prompt)
    # P: one token, not streamed, asked to keep the KV for a remote decode
    (_, pre), = p_a[0].requests
    assert pre["max_tokens"] == 1 and pre["stream"] is False and pre["kv_transfer_params"]["do_remote_decode"]
    # D: the client's body with P's kv_transfer_params; the client gets D's answer
    served = [d for d in d_a if d.requests]
    assert len(served) == 1
    (_, dec), = served[0].requests
    assert dec["max_tokens"] == 8 and dec["kv_transfer_params"]["remote_engine_id"] == p_a[0].name
    out = first["choices"][0]["text"]
    context = encode(prompt) + encode(out)
    aligned = len(context) // 16 * 16
    # the shadow of the context runs on b's P (tagged, do_remote_decode), then is pushed to b's D
    wait_for(lambda: any(len(s["prompt"]) == aligned for s in p_b[0].shadow_requests()), what="shadow on b's P")
    shadow = next(s for s in p_b[0].shadow_requests() if len(s["prompt"]) == aligned)
    assert shadow["kv_transfer_params"]["do_remote_decode"] and parse_tag(shadow["vllm_xargs"]).target_model == "b"
    wait_for(lambda: gw.metric("shadowprefill_gateway_push_tokens_total", model="b") >= aligned,
             what="push of the context to b's D")
    push = next(b for _, b in d_b[0].requests if len(b["prompt"]) == aligned)
    assert push["max_tokens"] == 1 and push["priority"] == 1_000_000  # d_b runs stock vLLM
    assert push["kv_transfer_params"]["remote_engine_id"] == p_b[0].name
    assert push["kv_transfer_params"]["remote_num_tokens"] == aligned
    # a second call of the session on a: same P, same D (sticky)
    _call(client, gw, "a", prompt + out + " ok.")
    assert len(p_a[0].requests) == 2 and len(served[0].requests) == 2
    assert not [d for d in d_a if d is not served[0] and d.requests]
    # the switch to b: P prefills (its cache holds the shadow), D is the one that got the push
    switch = _call(client, gw, "b", prompt + out + " ok." + "x" * 8 + " next.")
    decoded = [b for _, b in d_b[0].requests if b.get("max_tokens") == 8]  # pushes have max_tokens 1
    assert switch["usage"]["prompt_tokens"] > 0 and len(decoded) == 1
    assert decoded[0]["kv_transfer_params"]["remote_engine_id"] == p_b[0].name
    p_switch = [b for b in p_b[0].routed_requests() if b.get("max_tokens") == 1 and b["prompt"] != shadow["prompt"]]
    assert p_switch and p_switch[-1]["kv_transfer_params"]["do_remote_decode"]
    assert gw.metric("shadowprefill_gateway_switch_cached_tokens_total", model="b") >= aligned  # P's cache
    # the session's end forgets its sticky D and pending pushes
    assert client.delete(gw.url + "/v1/shadowprefill/sessions/s1").status_code in (200, 204)
    assert gw.gateway.cluster.num_sticky_decode() == 0 and gw.gateway.shadows.num_session_entries() == 0


@pytest.mark.parametrize("late", ["shadow", "push"])
def test_a_shadow_or_push_finishing_after_its_session_ended_records_nothing(upstreams, gateway, client, late):
    """DELETE while the switch's shadow on a's P (or its push to a's D) is in
    flight: when it answers, the ended session gets no known prefix, no push
    and no sticky D back (the race that failed the test above under load: a
    late push offer picked, and so re-created, the session's sticky D)."""
    p_a, d_a, p_b, d_b = upstreams(1), upstreams(2), upstreams(1), upstreams(1)
    gw = gateway(_pd_config(p_a, d_a, p_b, d_b))
    prompt = "You are an agent. " * 6
    _call(client, gw, "a", prompt)
    for slow in (p_a if late == "shadow" else d_a):
        slow.delay_s = 0.3  # answers the shadow of the switch's context (or its push) late

    def pushes_to_a() -> list:
        return [b for d in d_a for _, b in d.requests if b.get("max_tokens") == 1]

    _call(client, gw, "b", prompt + " next.")
    wait_for(lambda: p_a[0].shadow_requests() if late == "shadow" else pushes_to_a(), what=f"the {late} in flight")
    assert client.delete(gw.url + "/v1/shadowprefill/sessions/s1").status_code in (200, 204)
    cluster = gw.gateway.cluster
    assert cluster.num_sticky_decode() == 0
    if late == "shadow":
        wait_for(lambda: gw.metric("shadowprefill_gateway_shadow_requests_total", model="a", mode="tagged",
                                   outcome="completed") >= 1, what="the late shadow's answer")
        time.sleep(0.3)  # a push, had one been offered, starts and ends meanwhile
        assert not pushes_to_a()
    else:
        wait_for(lambda: gw.metric("shadowprefill_gateway_pushes_total", model="a", outcome="completed") >= 1,
                 what="the late push's answer")
    assert cluster.num_sticky_decode() == 0 and gw.gateway.shadows.num_session_entries() == 0
    assert not [inst.id for inst in cluster.by_id.values() if "s1" in inst.known]


def test_pd_streaming_call_and_a_dead_decode_instance(upstreams, gateway, client):
    p_a, d_a, p_b, d_b = upstreams(1), upstreams(2), upstreams(1), upstreams(1)
    gw = gateway(_pd_config(p_a, d_a, p_b, d_b, pd={"push": False}))
    with client.stream("POST", gw.url + "/v1/completions", headers=S,
                       json={"model": "a", "prompt": "hello " * 10, "max_tokens": 5, "stream": True}) as r:
        assert r.status_code == 200
        lines = [json.loads(x[5:]) for x in r.iter_lines() if x.startswith("data:") and "[DONE]" not in x]
    assert "".join(c["choices"][0]["text"] for c in lines if c.get("choices")) and all("usage" not in c or
                                                                                       c["usage"] is None
                                                                                       for c in lines)
    (_, pre), = p_a[0].requests
    assert pre["stream"] is False and "stream_options" not in pre
    served = next(d for d in d_a if d.requests)
    assert served.requests[0][1]["stream"] is True
    assert client.get(gw.url + "/health").json() == {"status": "ok", "healthy_instances": {"a": 1, "b": 1},
                                                    "healthy_decode_instances": {"a": 2, "b": 1}}
    # the sticky D dies: the next call goes to the other D, and still succeeds
    served.kill()
    _call(client, gw, "a", "hello " * 12)
    other = next(d for d in d_a if d is not served)
    assert other.requests and other.requests[-1][1]["kv_transfer_params"]["do_remote_prefill"]
    d_b[0].kill()  # no D left for b: degraded
    wait_for(lambda: client.get(gw.url + "/health").json()["healthy_decode_instances"] == {"a": 1, "b": 0},
             what="health sees the dead D instances")
    assert client.get(gw.url + "/health").json()["status"] == "degraded"
    assert gw.metric("shadowprefill_gateway_pushes_total", model="b", outcome="completed") == 0  # pd.push: false


def test_pusher_waits_for_normal_transfers_and_sends_one_push_per_d_at_a_time(upstreams):
    import asyncio

    import aiohttp
    from shadow_gateway.cluster import GatewayCluster
    from shadow_gateway.metrics import GatewayMetrics
    from shadow_gateway.pd import Push, Pusher

    (p,), (d,) = upstreams(1), upstreams(1)
    d.delay_s = 0.2
    cfg = from_dict({"models": {"a": {"block_size": 16, "prefill_instances": [p.url], "decode_instances": [d.url]}}})
    cluster = GatewayCluster(cfg)
    dest = cluster.decode_for("s1", "a")

    async def run() -> None:
        async with aiohttp.ClientSession() as client:
            pusher = Pusher(cluster, cfg.pd, GatewayMetrics(), client)
            ids = list(range(64))
            dest.num_transfers_inflight = 1  # a routed call's KV is on its way to D
            pusher.offer(Push("s1", "a", ids, 64, {"remote_engine_id": "p"}))
            pusher.offer(Push("s2", "a", ids, 48, None))
            await asyncio.sleep(0.05)
            assert not pusher.inflight and not d.requests  # normal transfers go first
            dest.num_transfers_inflight = 0
            pusher.pump()
            pusher.pump()
            assert len(pusher.inflight) == 1  # one push at a time on D's link
            await asyncio.sleep(0.1)
            assert len(d.requests) == 1 and len(pusher.inflight) == 1
            while pusher.inflight or pusher.num_session_entries():
                await asyncio.sleep(0.02)
            assert [len(b["prompt"]) for _, b in d.requests] == [64, 48]
            assert d.requests[0][1]["kv_transfer_params"] == {"remote_engine_id": "p"}
            # the same prefix again: D is expected to hold it, nothing is sent
            pusher.offer(Push("s1", "a", ids, 64, None))
            await asyncio.sleep(0.05)
            assert len(d.requests) == 2 and not pusher.inflight

    asyncio.run(run())


def test_a_push_d_held_only_in_part_records_what_d_says_it_holds(upstreams):
    import asyncio

    import aiohttp
    from shadow_gateway.cluster import GatewayCluster
    from shadow_gateway.metrics import GatewayMetrics
    from shadow_gateway.pd import Push, Pusher

    (p,), (d,) = upstreams(1), upstreams(1)
    d.shadow_short_tokens = 20  # plays a D-role shadow scheduler that ends an offer early, saying held=N
    cfg = from_dict({"models": {"a": {"block_size": 16, "prefill_instances": [p.url],
                                      "decode_instances": [{"url": d.url, "scheduler": "shadow"}]}}})
    cluster = GatewayCluster(cfg)
    metrics = GatewayMetrics()

    async def run() -> None:
        async with aiohttp.ClientSession() as client:
            pusher = Pusher(cluster, cfg.pd, metrics, client)
            pusher.offer(Push("s1", "a", list(range(64)), 64, None, switch_probability=0.7, epoch=2))
            while pusher.inflight or pusher.num_session_entries():
                await asyncio.sleep(0.02)

    asyncio.run(run())
    (_, body), = d.requests
    tag = parse_tag(body["vllm_xargs"])  # a push offer: shadow-tagged for the model, with the job's numbers
    assert tag.is_shadow and tag.target_model == "a" and tag.epoch == 2 and tag.switch_probability == 0.7
    assert "priority" not in body
    assert cluster.by_id["a/d0"].known["s1"].shadow_len == 32  # (64 - 20) // 16 * 16, not 64
    assert metrics.registry.get_sample_value("shadowprefill_gateway_pushes_total",
                                             {"model": "a", "outcome": "partial"}) == 1
