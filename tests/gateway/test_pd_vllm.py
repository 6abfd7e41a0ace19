"""End to end, P/D: the gateway in front of four real vLLM CPU servers, one
prefill (P) and one decode (D) instance for each of two tiny models
(random weights built offline, one tokenizer), KV moved between the P and the
D process of a model by vLLM's ``ExampleConnector`` (shared storage: P saves
each prefill's KV to a folder, D loads it by the prompt's tokens; one folder
per model, since the connector keys KV by token ids alone).

What it shows (issue 18's done-when, on CPU engines):

* a routed call goes P then D: D reports the prompt's KV as received through
  the connector (``vllm:external_prefix_cache_hits``) and decodes from it;
* the shadow of the session's context runs on the other model's P (stock vLLM,
  request-level at the lowest priority) and the gateway pushes it to that
  model's D, which takes it through the connector;
* at the switch call, the new model's P prefills only the tail (its
  ``cached_tokens`` are the shadow), and its D already holds the shadow-pushed
  prefix in its own prefix cache (``vllm:prefix_cache_hits`` grows by it) and
  receives only the rest; its greedy output equals a colocated prefill of the
  same prompt (the KV moved intact).

Limits of ``ExampleConnector`` that the settings respect: P saves a prompt's
KV only when it is prefilled in one step (``--max-num-batched-tokens`` 2048,
prompts well below), so P runs stock vLLM here; a prompt of length L is found
by D only when ``(L - 1) % block_size != 0`` (its save and load keys round
differently); the token lengths here are chosen so.

Runtime: about 2 minutes on 2 cores, most of it starting the four servers.
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
MODELS = ("tiny-a", "tiny-b")
NIXL_QUIET = Path(__file__).parent / "nixl_quiet"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_pd_command(model_dir: Path, served: str, port: int, role: str, storage: Path,
                    engine_level: bool = False) -> list[str]:
    """One P (``kv_producer``) or D (``kv_consumer``) server (docs/vllm.md): stock vLLM with
    ExampleConnector, or (``engine_level``) the P- / D-role shadow scheduler with NixlConnector; or
    (role ``colocated``) one without a connector: stock, or the colocated shadow scheduler."""
    if role == "colocated":  # no connector: the colocated shadow scheduler (engine_level) or stock vLLM
        extra = (["--scheduler-cls", "shadow_vllm.scheduler.ShadowScheduler", "--additional-config",
                  json.dumps({"shadowprefill": {"shadow": {"policy": "harvest-slo"}, "instance_id": served}})]
                 if engine_level else [])
        return [*_serve_command(model_dir, served, port), *extra]
    if engine_level:
        kv = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
        pd_role = "prefill" if role == "kv_producer" else "decode"
        cls = "PrefillShadowScheduler" if pd_role == "prefill" else "DecodeShadowScheduler"
        extra = ["--scheduler-cls", f"shadow_vllm.pd.{cls}", "--additional-config",
                 json.dumps({"shadowprefill": {"shadow": {"policy": "harvest-slo"}, "instance_id": f"{served}-{pd_role}",
                                               "pd": {"role": pd_role}}})]
    else:
        kv = {"kv_connector": "ExampleConnector", "kv_role": role,
              "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
        extra = []
    return [*_serve_command(model_dir, served, port), "--kv-transfer-config", json.dumps(kv), *extra]


def _serve_command(model_dir: Path, served: str, port: int) -> list[str]:
    return [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", served, "--host", "127.0.0.1", "--port", str(port),
            "--block-size", str(BLOCK), "--max-model-len", "2048", "--max-num-batched-tokens", "2048",
            "--dtype", "float32", "--enforce-eager", "--enable-prompt-tokens-details",
            "--scheduling-policy", "priority"]


def start_pd_servers(root: Path, engine_level: bool = False, colocated: tuple[str, ...] = ()):
    """A P and a D server per model, or one colocated server for a model in ``colocated``; returns
    (processes, urls: {model: {"prefill": url, "decode": url} or {"colocated": url}}); the caller
    stops them."""
    build = ("from shadow_vllm.tinymodel import build_tiny_model; import sys; "
             "build_tiny_model(sys.argv[1], seed=0); build_tiny_model(sys.argv[2], seed=1)")
    subprocess.run([VLLM_PYTHON, "-c", build, str(root / MODELS[0]), str(root / MODELS[1])], check=True,
                   capture_output=True, timeout=120)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1")
    procs, urls = [], {}
    for name in MODELS:
        storage = root / f"kv-{name}"
        storage.mkdir(exist_ok=True)
        roles = (("colocated", "colocated"),) if name in colocated else (("prefill", "kv_producer"),
                                                                          ("decode", "kv_consumer"))
        for role, kv_role in roles:
            port = _free_port()
            log_path = root / f"{name}-{role}.log"
            log = open(log_path, "w")  # noqa: SIM115 - closed with the process
            side = dict(env, VLLM_NIXL_SIDE_CHANNEL_PORT=str(_free_port()))
            if engine_level and role != "colocated":  # NIXL agents without their busy progress thread (nixl_quiet/sitecustomize.py says why)
                side["PYTHONPATH"] = os.pathsep.join(p for p in (str(NIXL_QUIET), env.get("PYTHONPATH")) if p)
            procs.append((subprocess.Popen(vllm_pd_command(root / name, name, port, kv_role, storage, engine_level),
                                           env=side, stdout=log, stderr=subprocess.STDOUT, start_new_session=True),
                          log, log_path))
            urls.setdefault(name, {})[role] = f"http://127.0.0.1:{port}"
    return procs, urls


class PortTaken(RuntimeError):
    """A server lost a port race: another process on the machine bound one of its ports (``_free_port``'s,
    or one vLLM or NIXL picked) before it did."""


def wait_healthy(procs, urls, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    for (proc, _, log_path), url in zip(procs, [u for m in urls.values() for u in m.values()], strict=True):
        while True:
            exited = proc.poll() is not None
            if not exited:
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
            text = Path(log_path).read_text()
            if "address already in use" in text.lower():  # a ZMQ or HTTP bind failed: it never comes up
                raise PortTaken(f"vLLM lost a port: {text[-3000:]}")
            if exited:
                raise RuntimeError(f"vLLM exited: {text[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM did not become healthy: {text[-3000:]}")
            time.sleep(0.5)


def start_healthy(root: Path, engine_level: bool = False, colocated: tuple[str, ...] = (), attempts: int = 3):
    """:func:`start_pd_servers`, then :func:`wait_healthy`; a start that lost a port race (:class:`PortTaken`:
    another test run on the machine took a port between the pick and the bind) is stopped and retried with
    fresh ports. Returns (processes, urls); the caller stops them."""
    for attempt in range(1, attempts + 1):
        procs, urls = start_pd_servers(root, engine_level, colocated)
        try:
            wait_healthy(procs, urls)
            return procs, urls
        except BaseException as e:
            stop_servers(procs)
            if not isinstance(e, PortTaken) or attempt == attempts:
                raise
    raise ValueError(f"start_healthy needs at least one attempt, got {attempts}")


def stop_servers(procs) -> None:
    for proc, _, _ in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc, log, _ in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()


def test_wait_healthy_names_a_lost_port_at_once_whether_the_server_hangs_or_exits(tmp_path):
    """No vLLM here: a process that never answers /health, with the bind error in its log, is a lost port
    race at the first poll (not a 300 s wait), and so is one that exited with it; an exit without it is not."""
    cases = (("sleep 30", "zmq.error.ZMQError: Address already in use (addr='tcp://localhost:1')", PortTaken),
             ("true", "[Errno 98] error while attempting to bind: address already in use", PortTaken),
             ("true", "some other failure", RuntimeError))
    for k, (command, text, error) in enumerate(cases):
        log_path = tmp_path / f"{k}.log"
        log_path.write_text(text)
        proc = subprocess.Popen(command.split(), start_new_session=True)
        log = open(log_path, "a")  # noqa: SIM115 - closed by stop_servers
        try:
            if command == "true":
                proc.wait(timeout=10)
            t0 = time.monotonic()
            with pytest.raises(error) as raised:
                wait_healthy([(proc, log, log_path)], {"m": {"r": f"http://127.0.0.1:{_free_port()}"}}, timeout_s=60)
            assert type(raised.value) is error and time.monotonic() - t0 < 10
        finally:
            stop_servers([(proc, log, log_path)])


def test_start_healthy_retries_a_lost_port_race_and_nothing_else(tmp_path, monkeypatch):
    import sys

    module = sys.modules[__name__]
    started, stopped, outcomes = [], [], []
    monkeypatch.setattr(module, "start_pd_servers", lambda root, e, c: (started.append(len(started)) or
                                                                         (f"procs{len(started)}", {})))
    monkeypatch.setattr(module, "stop_servers", stopped.append)

    def wait(procs, urls):
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome

    monkeypatch.setattr(module, "wait_healthy", wait)
    outcomes[:] = [PortTaken("lost"), None]
    assert start_healthy(tmp_path) == ("procs2", {}) and stopped == ["procs1"]
    started.clear(), stopped.clear()
    outcomes[:] = [RuntimeError("vLLM exited")]
    with pytest.raises(RuntimeError, match="exited"):
        start_healthy(tmp_path)
    assert started == [0] and stopped == ["procs1"]
    started.clear(), stopped.clear()
    outcomes[:] = [PortTaken("lost")] * 2
    with pytest.raises(PortTaken):
        start_healthy(tmp_path, attempts=2)
    assert stopped == ["procs1", "procs2"]


@pytest.fixture(scope="module")
def pd_servers(tmp_path_factory) -> Iterator[dict[str, dict[str, str]]]:
    """{model: {"prefill": url, "decode": url}}, four vLLM servers, always torn down."""
    procs, urls = start_healthy(tmp_path_factory.mktemp("pd_e2e"))
    try:
        yield urls
    finally:
        stop_servers(procs)


def pd_gateway_config(urls: dict[str, dict[str, str]], scheduler: str = "stock") -> dict:
    """The gateway configuration of the P/D deployment (docs/vllm.md shows it as YAML)."""
    return {
        "models": {name: ({"block_size": BLOCK, "instances": [{"url": u["colocated"], "scheduler": scheduler}]}
                          if "colocated" in u else
                          {"block_size": BLOCK,
                           "prefill_instances": [{"url": u["prefill"], "scheduler": scheduler}],
                           "decode_instances": [{"url": u["decode"], "scheduler": scheduler}]})
                   for name, u in urls.items()},
        "shadow": {"policy": "harvest-slo"},
        # four vLLM servers on 2 loaded cores answer /health late at times: a lenient check, so a slow answer
        # does not take an instance out of rotation (and drop the shadow or the push this test waits for)
        "health": {"interval_s": 1.0, "timeout_s": 10.0, "unhealthy_after": 5},
        "shadow_submit": {"timeout_s": 60.0, "poll_interval_s": 0.02},
        "pd": {"push_timeout_s": 60.0},
    }


@pytest.fixture(scope="module")
def pd_gateway(pd_servers) -> Iterator[GatewayServer]:
    g = GatewayServer(pd_gateway_config(pd_servers)).start()
    yield g
    g.stop()


def _counter(url: str, name: str) -> float:
    """A vLLM counter from ``/metrics``, summed over its label sets."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith((name + "{", name + " ")):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _hits(url: str) -> tuple[float, float]:
    """(local prefix-cache hits, hits through the KV connector) of a server, in tokens."""
    return _counter(url, "vllm:prefix_cache_hits_total"), _counter(url, "vllm:external_prefix_cache_hits_total")


def _ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 400 + 40 for i in range(n)]  # the tiny vocabulary has 467 ids


def test_switch_call_finds_the_shadow_pushed_prefix_on_d_and_p_prefills_only_the_tail(pd_gateway, pd_servers):
    a, b = pd_servers["tiny-a"], pd_servers["tiny-b"]
    c = httpx.Client(timeout=180)
    session = {"X-Session-Id": "pd-e2e"}
    prompt = _ids(1, 300)
    # 1. a routed call on tiny-a: P prefills, D takes the KV through the connector and decodes
    before = _hits(a["decode"])
    first = c.post(pd_gateway.url + "/v1/completions", headers=session,
                   json={"model": "tiny-a", "prompt": prompt, "max_tokens": 16, "temperature": 0,
                         "return_token_ids": True}).json()
    out = first["choices"][0]["token_ids"]
    assert len(out) == 16
    local, external = (x - y for x, y in zip(_hits(a["decode"]), before, strict=True))
    assert (local, external) == (0, (len(prompt) - 1) // BLOCK * BLOCK)  # D computed only the last partial block
    context = prompt + out  # 316 tokens: (316 - 1) % 32 != 0, so D finds what P saved
    # 2. the shadow of the context on tiny-b's P, pushed to tiny-b's D
    wait_for(lambda: pd_gateway.metric("shadowprefill_gateway_pushes_total", model="tiny-b", outcome="completed")
             >= 1, timeout_s=120, what="shadow pushed to tiny-b's D")
    pushed_local, pushed_external = _hits(b["decode"])
    held = len(context) // BLOCK * BLOCK  # whole blocks of the context in D's prefix cache
    assert pushed_external == (len(context) - 1) // BLOCK * BLOCK  # the push came through the connector
    assert pushed_local == 0
    # 3. the switch call on tiny-b: P prefills only the tail; D holds the pushed prefix, receives the rest
    nxt = context + _ids(2, 40)  # 356 tokens: (356 - 1) % 32 != 0
    p_before, d_before = _hits(b["prefill"]), _hits(b["decode"])
    switch = c.post(pd_gateway.url + "/v1/completions", headers=session,
                    json={"model": "tiny-b", "prompt": nxt, "max_tokens": 8, "temperature": 0,
                          "return_token_ids": True}).json()
    p_local = _hits(b["prefill"])[0] - p_before[0]
    d_local, d_external = (x - y for x, y in zip(_hits(b["decode"]), d_before, strict=True))
    assert p_local == held  # P's cached tokens: the shadow; it prefilled the other len(nxt) - held
    assert pd_gateway.metric("shadowprefill_gateway_switch_cached_tokens_total", model="tiny-b") == held
    assert d_local == held  # D already held the shadow-pushed prefix
    assert d_external == (len(nxt) - 1) // BLOCK * BLOCK - held  # and received only what it lacked
    assert switch["usage"]["prompt_tokens_details"]["cached_tokens"] == d_local + d_external  # D's own report
    assert pd_gateway.metric("shadowprefill_gateway_decode_cached_tokens_total", model="tiny-b") == d_local + d_external
    # the KV moved intact: D's greedy output equals a colocated prefill of the same prompt on P
    ref = c.post(b["prefill"] + "/v1/completions",
                 json={"model": "tiny-b", "prompt": nxt, "max_tokens": 8, "temperature": 0,
                       "return_token_ids": True}).json()
    assert switch["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
