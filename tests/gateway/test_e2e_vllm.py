"""End to end: the gateway in front of two real vLLM CPU servers (two tiny
random-weight models built offline, sharing one tokenizer, as two "models").

Both servers start through ``shadow_vllm.serve`` (``vllm-serve``) with the
shadow scheduler (``--scheduler-cls shadow_vllm.scheduler.ShadowScheduler``,
policy ``harvest-slo``) and priority scheduling; they are shared by two
gateways (one server pair: starting vLLM on 2 cores takes most of a minute):

* ``gw`` marks both instances ``scheduler: stock``: shadows take the
  request-level path (Appendix D.1: untagged lowest-priority requests, which
  the shadow scheduler, with no tagged shadow, schedules exactly as stock
  vLLM; ``tests/vllm/test_scheduler.py`` checks that step by step);
* ``gw_tagged`` marks them ``scheduler: shadow``: shadows are requests tagged
  ``shadowprefill_kind=shadow`` that the engine runs only in slack.

In both, a session that switches models finds its context cached on the new
model (vLLM's own ``usage.prompt_tokens_details.cached_tokens``); the same
switch without the gateway's session (plain calls) finds nothing cached.

Both servers run with ``--api-key``: the gateways know the key only through
``api_key_env`` and send it on routed calls, shadows (request-level and
tagged), ``/metrics`` reads and tokenizer probes; a request without it gets
vLLM's 401.
Each test uses its own token sequences, so the shared prefix caches do not mix.

vLLM runs in its own interpreter: this one when it imports vllm, else
``$SHADOWPREFILL_VLLM_PYTHON``; otherwise the module is skipped (except under
``CI=true``, where a missing vLLM is an error). Servers start once per module
and are always torn down.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .conftest import GatewayServer, vllm_python_or_skip, wait_for

VLLM_PYTHON = vllm_python_or_skip()

BLOCK = 32
UPSTREAM_KEY = "e2e-vllm-key-" + os.urandom(8).hex()
KEY_ENV = "SHADOWPREFILL_E2E_VLLM_KEY"
AUTH = {"Authorization": f"Bearer {UPSTREAM_KEY}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_servers(tmp_path_factory) -> Iterator[dict[str, str]]:
    root = tmp_path_factory.mktemp("gateway_e2e")
    build = ("from shadow_vllm.tinymodel import build_tiny_model; import sys; "
             "build_tiny_model(sys.argv[1], seed=0); build_tiny_model(sys.argv[2], seed=1)")
    subprocess.run([VLLM_PYTHON, "-c", build, str(root / "tiny-a"), str(root / "tiny-b")], check=True,
                   capture_output=True, timeout=120)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1")
    procs, urls = [], {}
    try:
        for name in ("tiny-a", "tiny-b"):
            port = _free_port()
            log = open(root / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
            cmd = [VLLM_PYTHON, "-m", "shadow_vllm.serve", "--policy", "harvest-slo", "--instance-id", name,
                   "--scheduler", "sync", "--model", str(root / name),
                   "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port),
                   "--block-size", str(BLOCK), "--max-model-len", "2048", "--dtype", "float32",
                   "--enforce-eager",  # no torch.compile: healthy in 40 s, not 96 s (30 CPU-s, not 67)
                   "--enable-prompt-tokens-details", "--scheduling-policy", "priority", "--api-key", UPSTREAM_KEY]
            procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True), log, root / f"{name}.log"))
            urls[name] = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        for (proc, _, log_path), url in zip(procs, urls.values()):
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"vLLM exited: {Path(log_path).read_text()[-3000:]}")
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vLLM did not become healthy: {Path(log_path).read_text()[-3000:]}")
                time.sleep(0.5)
        os.environ[KEY_ENV] = UPSTREAM_KEY  # the gateways' api_key_env
        yield urls
    finally:
        os.environ.pop(KEY_ENV, None)
        for proc, log, _ in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc, log, _ in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            log.close()


def _config(vllm_servers: dict[str, str], scheduler: str, **shadow_submit: float) -> dict:
    """A gateway over both servers, every instance with ``scheduler`` (stock or shadow)."""
    return {
        "models": {name: {"block_size": BLOCK, "api_key_env": KEY_ENV,
                          "instances": [{"url": url, "scheduler": scheduler}]}
                   for name, url in vllm_servers.items()},
        "shadow": {"policy": "harvest-slo"},
        "health": {"interval_s": 1.0},
        "shadow_submit": {"timeout_s": 60.0, **shadow_submit},
    }


@pytest.fixture(scope="module")
def gw(vllm_servers) -> Iterator[GatewayServer]:
    g = GatewayServer(_config(vllm_servers, "stock", poll_interval_s=0.02)).start()
    yield g
    g.stop()


@pytest.fixture(scope="module")
def gw_tagged(vllm_servers) -> Iterator[GatewayServer]:
    """A second gateway on the same servers, in tagged mode (``scheduler: shadow``)."""
    g = GatewayServer(_config(vllm_servers, "shadow")).start()
    yield g
    g.stop()


def _context(seed: int, n: int = 300) -> list[int]:
    return [(seed * 7919 + i * 104729) % 400 + 40 for i in range(n)]  # the tiny vocabulary has 467 ids


def test_the_servers_demand_their_key_and_the_gateway_sends_it_on_probes(gw, vllm_servers):
    import asyncio

    body = {"model": "tiny-a", "prompt": _context(9, 8), "max_tokens": 1}
    url = vllm_servers["tiny-a"] + "/v1/completions"
    assert httpx.post(url, json=body, timeout=60).status_code == 401  # the key is enforced
    assert httpx.post(url, json=body, headers=AUTH, timeout=60).status_code == 200
    # tokenizer probes (as at startup) answered by both models
    assert asyncio.run(gw.gateway.check_tokenizers()).keys() == {"tiny-a", "tiny-b"}
    # without the key the startup probe stops the gateway with one error naming the field
    from shadow_gateway.config import from_dict
    from shadow_gateway.gateway import Gateway, UpstreamCredentials

    bare = _config(vllm_servers, "stock")
    for m in bare["models"].values():
        m.pop("api_key_env")
    with pytest.raises(UpstreamCredentials, match=r"api_key_env = None: instance tiny-./0 refused .*/v1/models "
                                                  r"answered 401"):
        asyncio.run(Gateway(from_dict(bare)).check_tokenizers())
    # a warmth query that tokenizes the next prompt (/tokenize through the gateway)
    r = httpx.post(gw.url + "/v1/shadowprefill/warmth", timeout=60,
                   json={"session_id": "never-called", "model": "tiny-b", "prompt": "x"})
    assert r.status_code == 404  # no such session: nothing to count


def test_switch_finds_context_cached_after_a_shadow(gw, vllm_servers):
    c = httpx.Client(timeout=120)
    prompt = _context(1)
    first = c.post(gw.url + "/v1/completions", headers={"X-Session-Id": "e2e"},
                   json={"model": "tiny-a", "prompt": prompt, "max_tokens": 16, "temperature": 0,
                         "return_token_ids": True}).json()
    out = first["choices"][0]["token_ids"]
    assert len(out) == 16 and first["choices"][0]["prompt_token_ids"] == prompt  # the client asked for ids
    context = prompt + out
    wait_for(lambda: gw.metric("shadowprefill_gateway_shadow_tokens_submitted_total", model="tiny-b",
                               mode="request-level") >= len(context), timeout_s=60, what="request-level shadow")
    warm = c.get(gw.url + "/v1/shadowprefill/warmth", params={"session_id": "e2e", "model": "tiny-b"}).json()
    assert warm["num_expected_cached_tokens"] == len(context) // BLOCK * BLOCK
    switch = c.post(gw.url + "/v1/completions", headers={"X-Session-Id": "e2e"},
                    json={"model": "tiny-b", "prompt": context + _context(2, 40), "max_tokens": 4}).json()
    cached = switch["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == len(context) // BLOCK * BLOCK, switch["usage"]
    assert gw.metric("shadowprefill_gateway_shadow_tokens_used_total", model="tiny-b") == cached
    assert gw.metric("shadowprefill_gateway_switch_calls_total", model="tiny-b") == 1
    # the next prompt, tokenized by tiny-a behind its key (/tokenize through the gateway)
    wp = c.post(gw.url + "/v1/shadowprefill/warmth",
                json={"session_id": "e2e", "model": "tiny-a", "prompt": "a tool result"})
    assert wp.status_code == 200 and wp.json()["num_prompt_tokens"] > 0, wp.text
    for outcome in ("http-4xx", "failed", "timeout"):
        for model in ("tiny-a", "tiny-b"):
            assert gw.metric("shadowprefill_gateway_shadow_requests_total", model=model, mode="request-level",
                             outcome=outcome) == 0


def test_same_switch_without_a_session_is_cold(gw, vllm_servers):
    c = httpx.Client(timeout=120)
    prompt = _context(3)
    first = c.post(gw.url + "/v1/completions",
                   json={"model": "tiny-a", "prompt": prompt, "max_tokens": 16, "return_token_ids": True}).json()
    context = prompt + first["choices"][0]["token_ids"]
    time.sleep(0.5)  # give a (wrong) shadow every chance to appear
    switch = c.post(gw.url + "/v1/completions",
                    json={"model": "tiny-b", "prompt": context + _context(4, 40), "max_tokens": 4}).json()
    assert switch["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_streaming_chat_session_through_real_vllm(gw, vllm_servers):
    messages = [{"role": "system", "content": "An agent session calls a model, reads a tool result. " * 4},
                {"role": "user", "content": "def main():"}]
    with httpx.Client(timeout=120) as c:
        r = c.post(gw.url + "/v1/chat/completions", headers={"X-Session-Id": "chat"},
                   json={"model": "tiny-a", "messages": messages, "max_tokens": 8, "stream": True})
    assert r.status_code == 200
    chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    assert r.text.rstrip().endswith("data: [DONE]")
    assert all("token_ids" not in ch["choices"][0] for ch in chunks if ch["choices"])
    history = gw.gateway.manager.history("chat")
    tokenized = httpx.post(vllm_servers["tiny-a"] + "/tokenize", headers=AUTH,
                           json={"model": "tiny-a", "messages": messages}).json()
    assert history.token_ids[: tokenized["count"]].tolist() == tokenized["tokens"]
    assert history.num_tokens == tokenized["count"] + 8  # prompt + streamed output ids
    # the client re-sends the conversation with the reply as text: not a diverged history
    reply = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "ok"}]
    with httpx.Client(timeout=120) as c:
        r = c.post(gw.url + "/v1/chat/completions", headers={"X-Session-Id": "chat"},
                   json={"model": "tiny-a", "messages": messages, "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert gw.gateway.manager.session("chat").num_calls == 2
    assert gw.metric("shadowprefill_gateway_fallbacks_total", reason="history-diverged") == 0


def test_tagged_mode_switch_finds_the_context_the_shadow_scheduler_prefilled(gw_tagged, vllm_servers):
    """Tagged mode end to end: the gateway sends the session's context to tiny-b
    as a tagged shadow; tiny-b's shadow scheduler prefills it in slack and
    finishes it (``shadowprefill:prefilled``); the switch call's cached tokens
    are exactly the shadow's whole blocks. Control: the same two calls without
    a session (no shadow) find nothing cached."""
    c = httpx.Client(timeout=120)

    def first_call(seed: int, headers: dict) -> list[int]:
        prompt = _context(seed)
        r = c.post(gw_tagged.url + "/v1/completions", headers=headers,
                   json={"model": "tiny-a", "prompt": prompt, "max_tokens": 16, "temperature": 0,
                         "return_token_ids": True}).json()
        return prompt + r["choices"][0]["token_ids"]

    def switch_cached(context: list[int], seed: int, headers: dict) -> int:
        r = c.post(gw_tagged.url + "/v1/completions", headers=headers,
                   json={"model": "tiny-b", "prompt": context + _context(seed, 40), "max_tokens": 4}).json()
        return r["usage"]["prompt_tokens_details"]["cached_tokens"]

    control = first_call(5, {})
    time.sleep(0.5)  # give a (wrong) shadow every chance to appear
    assert switch_cached(control, 6, {}) == 0

    context = first_call(7, {"X-Session-Id": "tagged"})
    expected = len(context) // BLOCK * BLOCK
    wait_for(lambda: gw_tagged.metric("shadowprefill_gateway_shadow_tokens_submitted_total", model="tiny-b",
                                      mode="tagged") >= expected, timeout_s=60, what="tagged shadow")
    assert gw_tagged.metric("shadowprefill_gateway_shadow_tokens_submitted_total", model="tiny-b",
                            mode="request-level") == 0
    assert gw_tagged.metric("shadowprefill_gateway_shadow_requests_total", model="tiny-b", mode="tagged",
                            outcome="completed") >= 1
    warm = c.get(gw_tagged.url + "/v1/shadowprefill/warmth", params={"session_id": "tagged", "model": "tiny-b"})
    assert warm.json()["num_expected_cached_tokens"] == expected
    cached = switch_cached(context, 8, {"X-Session-Id": "tagged"})
    assert cached == expected > 0
    assert gw_tagged.metric("shadowprefill_gateway_shadow_tokens_used_total", model="tiny-b") == cached
    assert gw_tagged.metric("shadowprefill_gateway_shadow_requests_total", model="tiny-b", mode="tagged",
                            outcome="http-4xx") == 0  # every shadow carried the key


def test_tenants_behind_gateway_keys_get_salted_caches_and_their_own_switches(vllm_servers):
    """A gateway with two client keys over the same servers (tagged mode):
    team-a's switch finds the context its (salted) shadow prefilled on tiny-b;
    team-b sending the very same tokens finds none of them cached (vLLM's own
    count), and cannot see team-a's session."""
    keys = {"team-a": "e2e-client-key-team-a-" + os.urandom(4).hex(),
            "team-b": "e2e-client-key-team-b-" + os.urandom(4).hex()}
    cfg = _config(vllm_servers, "shadow")
    cfg["auth"] = {"api_keys": [{"key": k, "tenant": t} for t, k in keys.items()]}
    g = GatewayServer(cfg).start()
    try:
        c = httpx.Client(timeout=120)
        a = {"Authorization": f"Bearer {keys['team-a']}", "X-Session-Id": "tenant-session"}
        b = {"Authorization": f"Bearer {keys['team-b']}"}
        prompt = _context(21)
        first = c.post(g.url + "/v1/completions", headers=a,
                       json={"model": "tiny-a", "prompt": prompt, "max_tokens": 16, "temperature": 0,
                             "return_token_ids": True})
        assert first.status_code == 200, first.text
        context = prompt + first.json()["choices"][0]["token_ids"]
        expected = len(context) // BLOCK * BLOCK
        wait_for(lambda: g.metric("shadowprefill_gateway_shadow_tokens_submitted_total", model="tiny-b",
                                  mode="tagged") >= expected, timeout_s=60, what="team-a's salted shadow")
        warmth = {"session_id": "tenant-session", "model": "tiny-b"}
        assert c.get(g.url + "/v1/shadowprefill/warmth", params=warmth, headers=b).status_code == 404
        plain = c.post(g.url + "/v1/completions", headers=b,
                       json={"model": "tiny-b", "prompt": context + _context(22, 40), "max_tokens": 4})
        assert plain.status_code == 200, plain.text
        assert plain.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # another tenant's cache
        switch = c.post(g.url + "/v1/completions", headers=a,
                        json={"model": "tiny-b", "prompt": context + _context(23, 40), "max_tokens": 4})
        assert switch.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == expected > 0
    finally:
        g.stop()


def _engine_metric(url: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_vllm_metrics_export_the_engine_shadow_counters(gw_tagged, vllm_servers):
    """``vllm-serve`` puts the shadow scheduler's counters on vLLM's own
    ``/metrics``: after a tagged shadow and a switch that used it (the test
    above, or this one's own session), tiny-b shows planned >= computed > 0,
    prefilled shadow requests, and the switch's cached tokens counted as used."""
    c = httpx.Client(timeout=120)
    prompt = _context(11)
    r = c.post(gw_tagged.url + "/v1/completions", headers={"X-Session-Id": "metrics"},
               json={"model": "tiny-a", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                     "return_token_ids": True}).json()
    context = prompt + r["choices"][0]["token_ids"]
    b = vllm_servers["tiny-b"]
    wait_for(lambda: _engine_metric(b, "shadowprefill_engine_shadow_requests_total", instance="tiny-b",
                                    reason="prefilled") >= 1, timeout_s=60, what="a prefilled shadow on /metrics")
    computed = _engine_metric(b, "shadowprefill_engine_shadow_tokens_computed_total", instance="tiny-b")
    planned = _engine_metric(b, "shadowprefill_engine_shadow_tokens_planned_total", instance="tiny-b")
    assert planned >= computed >= len(context) // BLOCK * BLOCK - BLOCK > 0
    used_before = _engine_metric(b, "shadowprefill_engine_shadow_tokens_used_total", instance="tiny-b")
    r = c.post(gw_tagged.url + "/v1/completions", headers={"X-Session-Id": "metrics"},
               json={"model": "tiny-b", "prompt": context + _context(12, 40), "max_tokens": 2}).json()
    cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
    used = _engine_metric(b, "shadowprefill_engine_shadow_tokens_used_total", instance="tiny-b") - used_before
    assert used == cached > 0  # the switch hit exactly the shadow's blocks (promoted: used)


def test_replay_of_a_session_file_through_real_vllm(gw, vllm_servers, tmp_path):
    """``shadowprefill replay`` against the gateway in front of the real vLLM
    servers: every call reaches its recorded model with the trace's token
    counts as vLLM reports them (prompt = the session's context so far plus the
    call's new input, output = the trace's), and a session's second call on
    the same model finds its context in vLLM's prefix cache."""
    from shadow_gateway.replay import replay

    from shadow_traces.agent_loaders import load_call_csv

    rows = ["session_id,call_index,model,task,arrival_s,gap_s,input_tokens,output_tokens,compact_to_tokens"]
    for k in range(2):
        rows += [f"r{k},0,tiny-a,t{k},{0.01 * k},,{200 + 20 * k},8,",
                 f"r{k},1,tiny-b,,,0.0,{30 + k},6,",
                 f"r{k},2,tiny-b,,,0.0,20,4,"]
    (tmp_path / "calls.csv").write_text("\n".join(rows) + "\n")
    trace, _ = load_call_csv(tmp_path / "calls.csv")
    report = replay(trace, gw.url, max_sessions=2, time_scale=0.0, vocab_size=460, session_prefix="e2e-replay-",
                    timeout_s=180.0)
    assert report.failures == ()
    got = sorted((c.session_id, c.call_index, c.model, c.is_switch, c.num_prompt_tokens, c.num_output_tokens)
                 for c in report.calls)
    want = sorted((s.session_id, i, c.model, i > 0 and c.model != s.calls[i - 1].model, p, c.output_tokens)
                  for s in trace.sessions for i, (c, p) in enumerate(zip(s.calls, s.prompt_lengths())))
    assert got == want
    repeat = [c for c in report.calls if c.call_index == 2]  # the second call on tiny-b: its context is cached
    assert len(repeat) == 2 and all(c.num_cached_tokens >= BLOCK for c in repeat)
    assert report.summary()["calls"] == 6 and report.summary()["switch_calls"] == 2
