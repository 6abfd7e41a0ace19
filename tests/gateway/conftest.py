"""Gateway tests run real HTTP on loopback: fake upstreams (fault injection)
and the gateway itself under uvicorn, each in a thread, always torn down."""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

try:  # the gateway extra (fastapi, uvicorn, httpx, aiohttp, prometheus-client, pyyaml)
    import httpx
    import uvicorn
    from shadow_gateway.app import create_app
    from shadow_gateway.config import from_dict
    from shadow_gateway.fake_upstream import FakeUpstream
except ImportError:
    if os.environ.get("CI") == "true":  # CI installs the extra: a missing one is an error there
        raise
    collect_ignore_glob = ["test_*.py"]  # elsewhere: skip this folder (pip install -e ".[gateway]")


class GatewayServer:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = from_dict(config)
        self.app = create_app(self.config)
        self.gateway = self.app.state.gateway
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="error", timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> GatewayServer:
        self.thread.start()
        deadline = time.monotonic() + 60  # generous: four vLLM servers may share the 2 cores with it
        while not self.server.started:
            assert time.monotonic() < deadline, "gateway did not start"
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()

    def metric(self, name: str, **labels: str) -> float:
        value = self.gateway.metrics.registry.get_sample_value(name, labels)
        return value or 0.0


def vllm_python_or_skip() -> str:
    """The Python that runs real vLLM servers for a test module: this one
    when it imports vllm, else ``$SHADOWPREFILL_VLLM_PYTHON``; without either
    the calling module is skipped (an error under ``CI=true``)."""
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.origin is not None:  # not the tests/vllm folder seen as a namespace package
        return sys.executable
    python = os.environ.get("SHADOWPREFILL_VLLM_PYTHON")
    if python is not None:
        return python
    if os.environ.get("CI") == "true":
        raise RuntimeError("CI=true but vLLM is not importable and SHADOWPREFILL_VLLM_PYTHON is not set")
    pytest.skip("vLLM not available (set SHADOWPREFILL_VLLM_PYTHON to a Python that imports vllm)",
                allow_module_level=True)


def wait_for(predicate, timeout_s: float = 30.0, what: str = "condition") -> None:
    """Poll until ``predicate()`` holds; fail after ``timeout_s`` (generous: a loaded 2-core CI machine
    runs the gateway, its fakes and other tests at once; a condition that never holds still fails)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def two_model_config(a: list[FakeUpstream], b: list[FakeUpstream], scheduler_b: str = "shadow",
                     **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "models": {
            "a": {"block_size": 16, "instances": [{"url": u.url} for u in a]},
            "b": {"block_size": 16, "instances": [{"url": u.url, "scheduler": scheduler_b} for u in b]},
        },
        "shadow": {"policy": "harvest-slo"},
        "health": {"interval_s": 0.1, "timeout_s": 0.5, "unhealthy_after": 1},
        "upstream": {"connect_timeout_s": 0.5, "read_timeout_s": 2.0, "retries": 1},
        "shadow_submit": {"timeout_s": 0.5, "connect_timeout_s": 0.2, "backoff_s": 0.1, "poll_interval_s": 0.02},
    }
    for k, v in extra.items():
        cfg[k] = v
    return cfg


@pytest.fixture
def upstreams() -> Iterator[Any]:
    made: list[FakeUpstream] = []

    def make(n: int = 1, **kw: Any) -> list[FakeUpstream]:
        out = [FakeUpstream(f"fake{len(made) + i}", **kw).start() for i in range(n)]
        made.extend(out)
        return out

    yield make
    for u in made:
        u.kill()


@pytest.fixture
def gateway() -> Iterator[Any]:
    made: list[GatewayServer] = []

    def make(config: dict[str, Any]) -> GatewayServer:
        g = GatewayServer(config).start()
        made.append(g)
        return g

    yield make
    for g in made:
        g.stop()


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=10.0) as c:
        yield c
