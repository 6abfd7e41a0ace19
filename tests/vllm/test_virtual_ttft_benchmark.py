"""The pieces of ``benchmarks/vllm_virtual_ttft.py`` (routed-call TTFT with and
without shadow load on vLLM's scheduler in virtual time) on a short scenario:
its three arms run the same calls, the shadow arms really do shadow work, and
that work reaches the switch calls. No timing is asserted (the script prints
the figures); this keeps the benchmark from rotting into a comparison of
nothing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "vllm_virtual_ttft.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("vllm_virtual_ttft", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def runs(bench):
    from shadow_sim.latency import latency_model

    args = bench.parse_args(["--seeds", "3", "--duration", "40", "--latency", "roofline", "--session-rate", "0.3"])
    latency = {m: latency_model(m, kind="roofline") for m in args.models}
    return {arm: bench.run_arm(args, 3, latency, arm) for arm in bench.ARMS}


def test_the_arms_run_the_same_calls_and_requests(bench, runs) -> None:
    ttft = {arm: bench.collect(run) for arm, run in runs.items()}
    base = ttft["no shadow"]
    assert len(base["same-model routed calls"]) >= 20 and len(base["switch calls"]) >= 5
    assert len(base["normal requests"]) >= 50
    for arm in bench.ARMS[1:]:
        for name in bench.CLASSES:
            assert set(ttft[arm][name]) == set(base[name]), (arm, name)


def test_only_the_shadow_arms_do_shadow_work_and_it_reaches_switch_calls(bench, runs) -> None:
    work = {arm: bench.shadow_work(run) for arm, run in runs.items()}
    assert work["no shadow"] == (0, 0)
    assert work["engine-level"][0] > 0 and work["request-level"][0] > 0

    def cached_in_switch_calls(run) -> int:
        return sum(c.num_cached_tokens for c in run.calls if c.is_switch)

    base = cached_in_switch_calls(runs["no shadow"])
    assert cached_in_switch_calls(runs["engine-level"]) > base
    assert cached_in_switch_calls(runs["request-level"]) > base


def test_report_verdicts(bench, capsys) -> None:
    within = [(0.1, 0.1)] * 50 + [(0.1, 0.105)] * 50
    slower = [(0.1, 0.13)] * 100
    empty = {c: [] for c in bench.CLASSES}
    assert bench.report({"engine-level": {**empty, bench.CLASSES[0]: within}, "request-level": empty})
    assert not bench.report({"engine-level": {**empty, bench.CLASSES[0]: slower}, "request-level": empty})
    out = capsys.readouterr().out
    assert "MET" in out and "NOT MET" in out


def test_host_tier_arms_store_to_and_load_from_vllms_offloading_connector(bench) -> None:
    from shadow_sim.latency import latency_model

    args = bench.parse_args(["--seeds", "3", "--duration", "30", "--latency", "roofline", "--session-rate", "0.3",
                             "--host-tier", "--policy", "harvest-slo-host", "--num-blocks", "2048"])
    latency = {m: latency_model(m, kind="roofline") for m in args.models}
    run = bench.run_arm(args, 3, latency, "engine-level")
    workers = [e.offload for e in run.cluster.by_id.values()]
    assert all(w is not None for w in workers)
    assert sum(w.num_stored_blocks for w in workers) > 0
    assert sum(w.num_loaded_blocks for w in workers) > 0  # evicted shadow or session blocks came back from host
