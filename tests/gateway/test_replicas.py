"""N gateway replicas behind a real load balancer: nginx hashing the session
header (``hash $http_x_session_id consistent``), two gateway processes, fake
upstreams. Calls of one session always land on one replica; when a replica
dies its sessions restart cold on the other one and no call fails.

Needs nginx (Debian's ``nginx-light``; ``.ci/run`` installs it): skipped with
the reason when it is missing, an error under ``CI=true``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)
if NGINX is None:
    if os.environ.get("CI") == "true":
        raise RuntimeError("nginx is missing: .ci/run installs it (apt-get install nginx-light)")
    pytestmark = pytest.mark.skip(reason="nginx is not installed (apt-get install nginx-light); the replica test "
                                         "needs a real load balancer")

NGINX_CONF = """\
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 256; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/body;
  proxy_temp_path {tmp}/proxy;
  fastcgi_temp_path {tmp}/fastcgi;
  uwsgi_temp_path {tmp}/uwsgi;
  scgi_temp_path {tmp}/scgi;
  upstream gateways {{
    hash $http_x_session_id consistent;
{servers}
    keepalive 16;
  }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://gateways;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_next_upstream error timeout http_502 http_503;
      proxy_connect_timeout 1s;
    }}
  }}
}}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gateway_yaml(a_url: str, b_url: str, port: int) -> str:
    return (f"models:\n  a:\n    block_size: 16\n    instances: [{{url: {a_url}}}]\n"
            f"  b:\n    block_size: 16\n    instances: [{{url: {b_url}}}]\n"
            "shadow: {policy: harvest-slo}\n"
            "health: {interval_s: 0.2, timeout_s: 0.5}\n"
            f"listen: {{host: 127.0.0.1, port: {port}}}\n")


def _wait_http(url: str, proc: subprocess.Popen, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{what} exited with {proc.returncode}"
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{what} did not answer {url}")


@pytest.fixture
def replicas(upstreams, tmp_path: Path):
    (a,), (b,) = upstreams(1), upstreams(1)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    procs: list[subprocess.Popen] = []
    gws = []
    try:
        for k in range(2):
            port = _free_port()
            cfg = tmp_path / f"gw{k}.yaml"
            cfg.write_text(_gateway_yaml(a.url, b.url, port))
            proc = subprocess.Popen([sys.executable, "-m", "shadow_gateway.serve", "--config", str(cfg),
                                     "--log-level", "warning"], env=env, start_new_session=True)
            procs.append(proc)
            gws.append((f"http://127.0.0.1:{port}", proc))
        lb_port = _free_port()
        servers = "".join(f"    server {u.removeprefix('http://')} max_fails=1 fail_timeout=30s;\n" for u, _ in gws)
        (tmp_path / "nginx.conf").write_text(NGINX_CONF.format(tmp=tmp_path, servers=servers, port=lb_port))
        nginx = subprocess.Popen([NGINX, "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf")],
                                 start_new_session=True, stderr=subprocess.PIPE, text=True)
        procs.append(nginx)
        for url, proc in gws:
            _wait_http(url + "/health", proc, "gateway")
        lb = f"http://127.0.0.1:{lb_port}"
        _wait_http(lb + "/health", nginx, "nginx")
        yield lb, gws
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def _known_context(gw_url: str, session: str) -> int | None:
    """Tokens of the session's history on that replica; None when it does not know the session."""
    w = httpx.get(gw_url + "/v1/shadowprefill/warmth", params={"session_id": session, "model": "a"}, timeout=5)
    if w.status_code == 404:  # the replica has no such session
        return None
    assert w.status_code == 200, w.text
    body = w.json()
    return body["num_prompt_tokens"] if body["instance"] is not None else None


def test_sessions_stick_to_one_replica_and_survive_its_death(replicas):
    lb, gws = replicas
    sessions = [f"agent-{i}" for i in range(25)]  # odd: a round robin would move every session
    prompts = {s: f"{s}: you are an agent, read the repository and plan an edit. " for s in sessions}
    with httpx.Client(timeout=10) as c:
        def call(s: str, model: str) -> None:
            r = c.post(lb + "/v1/completions", headers={"X-Session-Id": s},
                       json={"model": model, "prompt": prompts[s], "max_tokens": 4})
            assert r.status_code == 200, (s, r.status_code, r.text)
            prompts[s] += r.json()["choices"][0]["text"] + " tool: ok. "

        for model in ("a", "b", "a"):  # three calls per session, with switches
            for s in sessions:
                call(s, model)
        owner = {}
        for s in sessions:
            known = [(k, n) for k, (url, _) in enumerate(gws) if (n := _known_context(url, s)) is not None]
            assert len(known) == 1, f"{s} is known to replicas {known}: its calls did not stick to one"
            owner[s] = known[0][0]
        assert set(owner.values()) == {0, 1}, "the hash sent every session to one replica"

        live_url, dead = gws[1][0], gws[0][1]
        switches_before = _metric(live_url, 'shadowprefill_gateway_switch_calls_total{model="b"}')
        dead.send_signal(signal.SIGKILL)
        dead.wait(timeout=10)
        for s in sessions:  # nothing fails: nginx moves the dead replica's sessions to the live one
            call(s, "b")
        moved = [s for s in sessions if owner[s] == 0]
        for s in sessions:  # every session is now on the live replica, with its whole context
            assert _known_context(live_url, s) == len(prompts[s].encode()) - len(" tool: ok. ")
        # the live replica's own sessions went a -> b (a switch); the moved ones started there cold
        # (a first call, no previous model), so only the former count as switches
        switches = _metric(live_url, 'shadowprefill_gateway_switch_calls_total{model="b"}') - switches_before
        assert switches == len(sessions) - len(moved), (switches, len(moved))


def _metric(gw_url: str, sample: str) -> float:
    for line in httpx.get(gw_url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
