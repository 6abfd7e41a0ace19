"""The engine's shadow counters (``shadow_vllm.metrics``) add exactly what the
scheduler's counts grew by; off unless ``SHADOWPREFILL_ENGINE_METRICS=1``.
(The real engine's ``/metrics`` is checked in tests/gateway/test_e2e_vllm.py.)"""

from __future__ import annotations

import os

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from shadow_vllm.metrics import ENV, EngineMetrics, prepare_env

from shadowcore.kv import KVClass


class _Stats:
    num_planned_tokens = 0
    num_shadow_tokens = 0

    def __init__(self) -> None:
        self.num_ended: dict[str, int] = {}


class _Bridge:
    def __init__(self) -> None:
        self.num_evicted_blocks = {KVClass.SHADOW: 0, KVClass.NORMAL: 0}
        self.num_promoted_blocks = 0


def _value(name: str, **labels: str) -> float:
    return prometheus_client.REGISTRY.get_sample_value(name, labels) or 0.0


def test_counters_follow_the_scheduler_counts(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert EngineMetrics.from_env("unit-0", 16) is None  # off by default
    monkeypatch.setenv(ENV, "1")
    m = EngineMetrics.from_env("unit-0", 16)
    stats, bridge = _Stats(), _Bridge()
    for step in range(3):
        stats.num_planned_tokens += 64
        stats.num_shadow_tokens += 48
        bridge.num_evicted_blocks[KVClass.SHADOW] += 1
        bridge.num_evicted_blocks[KVClass.NORMAL] += 5  # normal evictions are not shadow evictions
        bridge.num_promoted_blocks += step
        stats.num_ended["prefilled"] = stats.num_ended.get("prefilled", 0) + 1
        m.sync(stats, bridge)
        m.sync(stats, bridge)  # nothing grew: nothing added
    stats.num_ended["superseded"] = 2
    m.sync(stats, bridge)
    p = "shadowprefill_engine_shadow_"
    assert _value(p + "tokens_planned_total", instance="unit-0") == 192
    assert _value(p + "tokens_computed_total", instance="unit-0") == 144
    assert _value(p + "tokens_evicted_total", instance="unit-0") == 3 * 16
    assert _value(p + "tokens_used_total", instance="unit-0") == (0 + 1 + 2) * 16
    assert _value(p + "requests_total", instance="unit-0", reason="prefilled") == 3
    assert _value(p + "requests_total", instance="unit-0", reason="superseded") == 2


def test_vllm_serve_environment():
    env: dict[str, str] = {}
    prepare_env(env)
    assert env[ENV] == "1" and os.path.isdir(env["PROMETHEUS_MULTIPROC_DIR"])
    os.rmdir(env["PROMETHEUS_MULTIPROC_DIR"])  # fresh and empty
    mine = {"PROMETHEUS_MULTIPROC_DIR": "/given", ENV: "0"}
    prepare_env(mine)
    assert mine == {"PROMETHEUS_MULTIPROC_DIR": "/given", ENV: "0"}  # the user's choice stands


def test_a_declared_gauge_without_sample_is_zero_waiting():
    from shadow_gateway.request_level import parse_num_waiting

    declared = "# HELP vllm:num_requests_waiting Number.\n# TYPE vllm:num_requests_waiting gauge\n"
    assert parse_num_waiting(declared) == 0
    assert parse_num_waiting(declared + 'vllm:num_requests_waiting{engine="0"} 3.0\n') == 3
    with pytest.raises(ValueError, match="no vllm:num_requests_waiting"):
        parse_num_waiting("# TYPE vllm:other gauge\n")
