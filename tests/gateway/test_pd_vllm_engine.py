"""End to end, P/D with engine-level shadows: three real vLLM CPU servers, a
P and a D of ``tiny-b`` running the P-role and D-role shadow schedulers
(``shadow_vllm.pd.PrefillShadowScheduler`` / ``DecodeShadowScheduler``) with
``NixlConnector`` (``kv_buffer_device: cpu``), and one colocated ``tiny-a``
(``ShadowScheduler``, no connector: its routed call only makes the session's
context), behind the gateway with every instance ``scheduler: shadow``.

The gateway's tagged shadow of the session's context runs on the other
model's P in its slack (the P controller), P's answer carries the NIXL
handle, and the gateway's push offer to that model's D is pulled by D's push
policy as an asynchronous connector load into its reclaim-first shadow class.
At the switch call, P prefills only the tail (its local prefix hit is the
shadow) and D already holds the pushed prefix (its local prefix hit) and
receives only the rest through the connector; D's greedy output equals a
colocated prefill of the same prompt.

Needs the NIXL Python package in vLLM's interpreter (``install.sh`` installs
it): skipped with the reason without it, an error under ``CI=true``.
Runtime: about 2 minutes on 2 cores, nearly all of it starting the servers; their NIXL agents run
without the busy progress thread (``nixl_quiet/sitecustomize.py``).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest
from shadow_gateway.pd import decode_fields, prefill_body

from .conftest import GatewayServer, wait_for
from .test_pd_vllm import (
    BLOCK,
    VLLM_PYTHON,
    _hits,
    _ids,
    pd_gateway_config,
    start_healthy,
    stop_servers,
)

_HAVE_NIXL = subprocess.run([VLLM_PYTHON, "-c", "import nixl._api"], capture_output=True, timeout=120,
                            check=False).returncode == 0
if not _HAVE_NIXL:
    if os.environ.get("CI") == "true":
        raise RuntimeError("CI=true but NIXL is not importable by vLLM's Python: install.sh installs nixl and "
                           "nixl-cu12")
    pytest.skip("NIXL is not importable by vLLM's Python (pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1)",
                allow_module_level=True)


def warm_nixl(urls: dict[str, dict[str, str]], attempts: int = 4) -> None:
    """One P -> D transfer per P/D model, straight to the servers (not through the
    gateway, whose counters the test reads), retried: the first transfer makes
    D's NIXL handshake with P, which vLLM 0.32 gives a hard-coded 5 s ZMQ
    receive timeout (``nixl`` worker, no setting), too short at times for four
    servers on 2 loaded cores; a failed handshake fails only that request, and
    the next one handshakes again. The warm-up prompt shares no block with the
    test's prompts (its first token differs)."""
    prompt = _ids(9, 100)
    for name, u in urls.items():
        if "colocated" in u:
            continue
        errors = []
        for _ in range(attempts):
            body = {"model": name, "prompt": prompt, "max_tokens": 2, "temperature": 0}
            pre = httpx.post(u["prefill"] + "/v1/completions", json=prefill_body(body), timeout=180).json()
            out = httpx.post(u["decode"] + "/v1/completions", json={**body, **decode_fields(pre)}, timeout=180).json()
            if "choices" in out and "kv_transfer_params" in pre:
                break
            errors.append((pre.get("error"), out.get("error")))
            time.sleep(2.0)
        else:
            raise RuntimeError(f"{name}: no P -> D transfer in {attempts} attempts: {errors}")


@pytest.fixture(scope="module")
def engine_servers(tmp_path_factory) -> Iterator[dict[str, dict[str, str]]]:
    procs, urls = start_healthy(tmp_path_factory.mktemp("pd_engine_e2e"), engine_level=True, colocated=("tiny-a",))
    try:
        warm_nixl(urls)
        yield urls
    finally:
        stop_servers(procs)


@pytest.fixture(scope="module")
def engine_gateway(engine_servers) -> Iterator[GatewayServer]:
    cfg = pd_gateway_config(engine_servers, scheduler="shadow")
    cfg["upstream"] = {"first_byte_bound_s": 120.0}  # a first NIXL transfer on a loaded 2-core machine is slow
    g = GatewayServer(cfg).start()
    yield g
    g.stop()


def test_engine_level_switch_finds_the_pushed_prefix_on_d_and_p_prefills_only_the_tail(engine_gateway,
                                                                                       engine_servers):
    b = engine_servers["tiny-b"]
    c = httpx.Client(timeout=180)
    session = {"X-Session-Id": "pd-engine-e2e"}
    prompt = _ids(1, 300)
    first = c.post(engine_gateway.url + "/v1/completions", headers=session,
                   json={"model": "tiny-a", "prompt": prompt, "max_tokens": 16, "temperature": 0,
                         "return_token_ids": True}).json()
    context = prompt + first["choices"][0]["token_ids"]
    # the tagged shadow ran on tiny-b's P; D's push policy pulled the offer (the push request ends once D holds it)
    wait_for(lambda: engine_gateway.metric("shadowprefill_gateway_pushes_total", model="tiny-b",
                                           outcome="completed") >= 1, timeout_s=120, what="push to tiny-b's D")
    assert engine_gateway.metric("shadowprefill_gateway_shadow_requests_total", model="tiny-b", mode="tagged",
                                 outcome="completed") >= 1
    held = len(context) // BLOCK * BLOCK
    nxt = context + _ids(2, 40)
    p_before, d_before = _hits(b["prefill"]), _hits(b["decode"])
    switch = c.post(engine_gateway.url + "/v1/completions", headers=session,
                    json={"model": "tiny-b", "prompt": nxt, "max_tokens": 8, "temperature": 0,
                          "return_token_ids": True}).json()
    p_local = _hits(b["prefill"])[0] - p_before[0]
    d_local, d_received = (x - y for x, y in zip(_hits(b["decode"]), d_before, strict=True))
    assert p_local == held  # P prefilled only the tail
    assert d_local == held  # D already held the pushed prefix
    assert d_received == len(nxt) - held  # and received only what it lacked
    assert switch["usage"]["prompt_tokens_details"]["cached_tokens"] == held  # NIXL: D reports P's hits
    ref = c.post(b["prefill"] + "/v1/completions",
                 json={"model": "tiny-b", "prompt": nxt, "max_tokens": 8, "temperature": 0,
                       "return_token_ids": True}).json()
    assert switch["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
