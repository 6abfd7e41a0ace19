"""Large JSON off the event loop (``shadow_gateway.offload``): results equal
the inline path, and one huge call does not stall the gateway's event loop."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from array import array

import httpx
import pytest
from shadow_gateway.offload import Offloader, decode, encode

from .conftest import GatewayServer, two_model_config, wait_for


def test_decode_and_encode_match_the_inline_json():
    body = {"id": "x", "prompt_token_ids": list(range(300)), "choices": [
        {"index": 0, "text": "Grüße", "token_ids": [5, 6, 7], "prompt_token_ids": None, "logprobs": None}],
        "usage": {"prompt_tokens": 300}}
    raw = json.dumps(body).encode()
    got = decode(raw)
    assert isinstance(got["prompt_token_ids"], array) and isinstance(got["choices"][0]["token_ids"], array)
    assert json.loads(encode(got)) == body

    async def run() -> tuple:
        off = Offloader(min_bytes=64)
        try:
            return await off.decode(raw), await off.encode(got), off.num_offloaded
        finally:
            off.close()

    in_worker, encoded, n = asyncio.run(run())
    assert n == 2 and in_worker == got and json.loads(encoded) == body


@pytest.fixture
def fake_process():
    """Fake upstreams in their own process: their JSON work must not share the gateway's interpreter lock."""
    proc = subprocess.Popen([sys.executable, "-m", "shadow_gateway.fake_upstream", "--count", "2"],
                            stdout=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    try:
        urls = [proc.stdout.readline().strip() for _ in range(2)]
        yield urls
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)


def _max_loop_lag_s(gw: GatewayServer, work) -> tuple[float, float]:
    """Run ``work()`` (in this thread) while a probe on the gateway's event loop
    records how late its 2 ms sleeps wake up: the worst lateness in wall time,
    and the worst CPU time the loop's thread spent between two of its turns.
    The second is what a stall of the loop is made of (JSON decoded or encoded
    on it); the first also holds the time the process was not scheduled at
    all, which on a loaded machine can dwarf it."""
    loop = gw.gateway._tasks[0].get_loop()
    done = threading.Event()

    async def probe() -> tuple[float, float]:
        worst = worst_cpu = 0.0
        while not done.is_set():
            t0, c0 = time.perf_counter(), time.thread_time()
            await asyncio.sleep(0.002)
            worst = max(worst, time.perf_counter() - t0 - 0.002)
            worst_cpu = max(worst_cpu, time.thread_time() - c0)
        return worst, worst_cpu

    fut = asyncio.run_coroutine_threadsafe(probe(), loop)
    try:
        work()
    finally:
        done.set()
    return fut.result(timeout=30)


def test_a_huge_call_does_not_stall_the_event_loop(fake_process):
    """The same 1.5M-token call (its response lists 1.5M prompt ids; its shadow
    sends them on) through two gateways: inline JSON stalls the loop for the
    whole decode and encode; with the offloader the loop keeps turning. Judged
    by the loop thread's CPU time between its turns (less than half the inline
    stall), which a loaded machine does not inflate as it does wall-clock lag
    (a run beside another suite once measured 0.88 s of wall lag offloaded
    against 0.29 s inline)."""
    class _U:
        def __init__(self, url: str) -> None:
            self.url = url

    a, b = (_U(u) for u in fake_process)
    lags = {}
    for label, min_bytes in (("inline", 1 << 40), ("offloaded", 1 << 16)):
        cfg = two_model_config([a], [b])
        cfg["upstream"].update({"offload_min_bytes": min_bytes, "read_timeout_s": 60.0})
        cfg["shadow_submit"]["timeout_s"] = 60.0
        gw = GatewayServer(cfg).start()
        try:
            prompt = f"{label}: " + "the agent reads a large file. " * 50_000  # 1.5M bytes = tokens

            def huge_call(gw: GatewayServer = gw, label: str = label, prompt: str = prompt) -> None:
                with httpx.Client(timeout=60) as c:
                    r = c.post(gw.url + "/v1/completions", headers={"X-Session-Id": label},
                               json={"model": "a", "prompt": prompt, "max_tokens": 4})
                    assert r.status_code == 200
                wait_for(lambda: gw.metric("shadowprefill_gateway_shadow_tokens_submitted_total", model="b",
                                           mode="tagged") > 1_000_000, timeout_s=60, what="the huge shadow")

            time.sleep(0.5)  # the offload worker's interpreter has started
            lags[label] = _max_loop_lag_s(gw, huge_call)
            if label == "offloaded":
                assert gw.gateway.offload.num_offloaded >= 2  # the response decode and the shadow body
        finally:
            gw.stop()
    (_, inline_cpu), (_, offloaded_cpu) = lags["inline"], lags["offloaded"]
    assert offloaded_cpu < inline_cpu / 2, lags  # the size of the gain is a benchmark figure, not a test
