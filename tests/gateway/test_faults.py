"""Fault injection: dead, hung and erroring instances and failed shadow
submissions never fail a routed call that its own instance could serve, and
no routed call is lost."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from .conftest import two_model_config, wait_for

PROMPT = "Read the repository and plan the fix. " * 3


def _call(url: str, session: str, model: str, prompt: str, stream: bool = False) -> tuple[int, str]:
    with httpx.Client(timeout=30.0) as c:
        body = {"model": model, "prompt": prompt, "max_tokens": 8, "stream": stream}
        r = c.post(url + "/v1/completions", headers={"X-Session-Id": session}, json=body)
        if r.status_code != 200:
            return r.status_code, r.text
        if stream:
            chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
            assert r.text.rstrip().endswith("data: [DONE]"), r.text
            return 200, "".join(ch["choices"][0]["text"] for ch in chunks)
        return 200, r.json()["choices"][0]["text"]


def _shadow_inflight(gw, instance_id: str) -> int:
    return len(gw.gateway.shadows.lanes[instance_id].inflight)


def test_shadow_target_returning_500s_fails_no_routed_call(upstreams, gateway):
    (a,), (b,) = upstreams(1), upstreams(1)
    b.fail_status = 500
    b.fail_shadows_only = True
    gw = gateway(two_model_config([a], [b]))
    prompt = PROMPT
    for _ in range(4):
        status, out = _call(gw.url, "s", "a", prompt)
        assert status == 200
        prompt += out + " ok. "
    wait_for(lambda: gw.metric("shadowprefill_gateway_shadow_requests_total", model="b", mode="tagged",
                               outcome="http-5xx") >= 1, what="failed shadow")
    assert gw.metric("shadowprefill_gateway_errors_total", where="shadow", instance="b/0") >= 1
    b.fail_status = None  # the instance recovers: shadow work resumes after the backoff
    wait_for(lambda: gw.metric("shadowprefill_gateway_shadow_requests_total", model="b", mode="tagged",
                               outcome="completed") >= 1, what="recovered shadow")
    status, _ = _call(gw.url, "s", "b", prompt)  # the switch still works
    assert status == 200


def test_hung_shadow_target_does_not_hold_routed_calls(upstreams, gateway):
    (a,), (b,) = upstreams(1), upstreams(1)
    b.hang = True
    cfg = two_model_config([a], [b])
    cfg["shadow_submit"]["timeout_s"] = 60.0  # the shadow stays in flight for the whole test
    gw = gateway(cfg)
    prompt = PROMPT
    status, out = _call(gw.url, "s", "a", prompt)
    assert status == 200
    wait_for(lambda: _shadow_inflight(gw, "b/0") == 1, what="a hung shadow")
    for _ in range(3):  # routed calls complete while the shadow is still hanging
        prompt += out + " ok. "
        status, out = _call(gw.url, "s", "a", prompt, stream=True)
        assert status == 200 and len(out) == 8
    assert _shadow_inflight(gw, "b/0") == 1
    assert gw.metric("shadowprefill_gateway_calls_total", model="a", kind="routed") == 4


def test_shadow_timeout_is_counted_and_dropped(upstreams, gateway):
    (a,), (b,) = upstreams(1), upstreams(1)
    b.hang = True
    gw = gateway(two_model_config([a], [b]))  # shadow timeout 0.5 s
    assert _call(gw.url, "s", "a", PROMPT)[0] == 200
    wait_for(lambda: gw.metric("shadowprefill_gateway_shadow_requests_total", model="b", mode="tagged",
                               outcome="timeout") >= 1, timeout_s=5, what="shadow timeout")
    job = gw.gateway.manager.job(__import__("shadowcore.types", fromlist=["JobKey"]).JobKey("s", "b"))
    assert job.num_held_tokens == 0 and job.num_inflight_tokens in (0, job.num_target_tokens)


def test_killing_an_instance_mid_shadow(upstreams, gateway):
    (a,), (b0, b1) = upstreams(1), upstreams(2)
    b0.hang = True
    cfg = two_model_config([a], [b0, b1])
    cfg["shadow_submit"]["timeout_s"] = 60.0
    gw = gateway(cfg)
    prompt = PROMPT
    status, out = _call(gw.url, "s", "a", prompt)
    assert status == 200
    wait_for(lambda: _shadow_inflight(gw, "b/0") == 1, what="shadow in flight on b/0")
    b0.kill()
    wait_for(lambda: _shadow_inflight(gw, "b/0") == 0, what="the dead instance's shadow to fail")
    prompt += out + " ok. "
    assert _call(gw.url, "s", "a", prompt)[0] == 200
    status, _ = _call(gw.url, "s", "b", prompt + "switch")  # sticky b/0 is dead: b/1 serves it
    assert status == 200
    assert len(b1.routed_requests()) == 1
    wait_for(lambda: not gw.gateway.cluster.by_id["b/0"].healthy, what="health check")


def test_routed_500_is_retried_on_another_instance_else_returned(upstreams, gateway):
    (a0, a1), (b,) = upstreams(2), upstreams(1)
    a0.fail_status = 500
    gw = gateway(two_model_config([a0, a1], [b]))
    for i in range(3):
        assert _call(gw.url, f"s{i}", "a", PROMPT)[0] == 200
    assert gw.metric("shadowprefill_gateway_errors_total", where="routed", instance="a/0") >= 1
    a1.fail_status = 503  # every instance fails: the client gets the instance's own answer
    status, text = _call(gw.url, "s9", "a", PROMPT)
    assert status in (500, 503) and "injected failure" in text
    assert "s9" not in gw.gateway.busy  # the session is not left busy


def test_instance_dying_mid_stream_ends_the_stream_with_an_error(upstreams, gateway):
    (a,), (b,) = upstreams(1), upstreams(1)
    a.die_after_tokens = 3
    gw = gateway(two_model_config([a], [b]))
    with httpx.Client(timeout=10) as c:
        r = c.post(gw.url + "/v1/completions", headers={"X-Session-Id": "s"},
                   json={"model": "a", "prompt": PROMPT, "max_tokens": 8, "stream": True})
    events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    assert [e["choices"][0]["text"] for e in events[:-1]] and len(events) == 4
    assert "mid-stream" in events[-1]["error"]["message"]
    a.die_after_tokens = None
    status, _ = _call(gw.url, "s", "a", PROMPT + "again")  # the session is usable afterwards
    assert status == 200


def test_concurrent_sessions_under_faults_lose_no_routed_call(upstreams, gateway):
    (a0, a1), (b0, b1) = upstreams(2), upstreams(2)
    cfg = two_model_config([a0, a1], [b0, b1])
    gw = gateway(cfg)
    b0.hang = True  # shadows to b/0 hang; later b/0 dies
    a1.fail_status = 500  # routed calls on a/1 are retried on a/0
    num_sessions, num_calls = 8, 5

    def session(i: int) -> list[int]:
        prompt, statuses = f"session {i}: " + PROMPT, []
        for k in range(num_calls):
            model = "a" if (i + k) % 3 else "b"
            if i == 0 and k == 2:
                b0.kill()
            status, out = _call(gw.url, f"s{i}", model, prompt, stream=bool(k % 2))
            statuses.append(status)
            prompt += out + f" result {k}. "
        return statuses

    with ThreadPoolExecutor(num_sessions) as pool:
        results = list(pool.map(session, range(num_sessions)))
    assert all(s == 200 for r in results for s in r), results
    total = sum(gw.metric("shadowprefill_gateway_calls_total", model=m, kind=k)
                for m in ("a", "b") for k in ("routed", "plain"))
    assert total == num_sessions * num_calls
    assert not gw.gateway.busy


def test_hung_but_healthy_instance_is_ejected_within_the_bound(upstreams, gateway):
    """a/0 hangs on completions while its /health answers: the first call that
    waits past ``first_byte_bound_s`` ejects it (within the bound, while that
    call still waits), new sessions go to a/1, no shadow goes there, and the
    ejection outlives passing health checks until ``eject_s`` ends."""
    a, (b,) = upstreams(2), upstreams(1)
    cfg = two_model_config(a, [b])
    cfg["upstream"].update({"first_byte_bound_s": 0.3, "eject_s": 2.0, "read_timeout_s": 1.5, "retries": 0})
    gw = gateway(cfg)
    a[0].hang = True
    t0 = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        hung = pool.submit(_call, gw.url, "first", "a", PROMPT)  # placed on a/0 (both idle: the first wins)
        wait_for(lambda: gw.metric("shadowprefill_gateway_ejections_total", instance="a/0",
                                   reason="first-byte-bound") == 1, timeout_s=2.0, what="ejection")
        ejected_after_s = time.monotonic() - t0
        assert not hung.done()  # ejected while the call still waits, not after its read timeout
        assert gw.gateway.cluster.by_id["a/0"].healthy  # its /health still answers
        for i in range(4):  # new sessions avoid it
            status, _ = _call(gw.url, f"new{i}", "a", PROMPT)
            assert status == 200
        assert hung.result(timeout=5)[0] == 502  # it ends by its own read timeout, its instance already out
    assert ejected_after_s < 1.0
    completions = [[body for path, body in u.requests if path.endswith("completions")] for u in a]
    assert len(completions[0]) == 1 and len(completions[1]) == 4
    assert gw.gateway.cluster.by_id["a/0"].ejected  # health checks passed meanwhile: still out
    wait_for(lambda: not gw.gateway.cluster.by_id["a/0"].ejected, timeout_s=4.0, what="the ejection to end")
    assert [i.id for i in gw.gateway.cluster.healthy_instances("a")] == ["a/0", "a/1"]


def test_shadows_stop_going_to_an_ejected_instance(upstreams, gateway):
    (a,), (b,) = upstreams(1), upstreams(1)
    gw = gateway(two_model_config([a], [b]))
    gw.gateway.cluster.eject("b/0", 60.0)
    status, _ = _call(gw.url, "s", "a", PROMPT)
    assert status == 200
    time.sleep(0.3)  # lanes had many fill intervals to send the shadow
    assert b.shadow_requests() == []
    gw.gateway.cluster.by_id["b/0"].ejected_until_s = 0.0  # the ejection ends
    assert _call(gw.url, "s", "a", PROMPT + " more")[0] == 200
    wait_for(lambda: len(b.shadow_requests()) >= 1, what="the shadow after the ejection")
