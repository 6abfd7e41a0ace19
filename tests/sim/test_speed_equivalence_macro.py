"""Runs of steady iterations (``EngineInstance.run_steady``) change no result.

The golden file (``test_speed_equivalence.py``) pins multi-instance runs in
which ``run_steady`` takes many iterations; this file compares, run for run,
the same seeded scenario with ``steady_runs`` on and off, on configurations
that stress what a run of ticks must stop for or fold together: one instance
per model with dense normal traffic (long runs: few other events), a tight KV
pool (reservations that do not fit, preemptions, LRU evictions folded into one
``extend_private``), a host tier (evictions spilled in order), and the shadow
policies (credit earned per skipped iteration, pending jobs that stop a run).
Everything a result is made of is compared exactly: every normal request's
times, every call record, per instance its counters, busy time, KV state and
the idle LRU order, per hook the credit, the end time and (without lazy ticks)
the event count.

Lazy ticks (``EngineCluster.lazy_ticks``: a run's plain ends applied only
when something observes the instance) are compared the same way against the
eager loop; there only the event count may move (fewer events are popped).
"""

from __future__ import annotations

import functools

import attrs
import pytest
from shadow_sim.simulator import SimRun, SimScenario

from shadowcore.config import PluginRef, ShadowConfig
from shadowcore.engine.kinds import WAKE
from shadowcore.engine.scenario import FakeRun, FakeScenario
from shadowcore.kv import KVClass

from .test_speed_equivalence import _same

_FAKE_ONE = {"instances_per_model": 1, "duration_s": 50.0, "warmup_s": 5.0, "session_rate_per_s": 0.05,
             "calls_per_session": 4, "normal_rate_per_s": 6.0, "normal_output_median": 300, "seed": 5}
_SIM_ONE = {"models": ["Qwen2.5-7B", "Llama-3.1-8B"], "latency": "roofline", "instances_per_model": 1,
            "duration_s": 30.0, "warmup_s": 5.0, "session_rate_per_s": 0.1, "calls_per_session": 4,
            "normal_rate_per_s": 8.0, "normal_output_median": 300, "seed": 9}

CASES: dict[str, tuple[str, dict, str]] = {
    "fake-one-no-shadow": ("fake", _FAKE_ONE, "no-shadow"),
    "fake-one-no-shadow-tight-kv": ("fake", {**_FAKE_ONE, "num_blocks": 900}, "no-shadow"),
    "fake-one-harvest-slo-host-tight-kv": ("fake", {**_FAKE_ONE, "num_blocks": 1200}, "harvest-slo-host"),
    "fake-one-harvest": ("fake", _FAKE_ONE, "harvest"),
    "sim-one-no-shadow": ("sim", _SIM_ONE, "no-shadow"),
    "sim-one-harvest-slo-host": ("sim", _SIM_ONE, "harvest-slo-host"),
    # Vidur's tables: steady runs timed one span of equal steps at a time (predict_decode_span_s)
    "sim-one-vidur-no-shadow": ("sim", {**_SIM_ONE, "latency": "vidur"}, "no-shadow"),
    "sim-one-vidur-harvest-slo-host": ("sim", {**_SIM_ONE, "latency": "vidur"}, "harvest-slo-host"),
}


def _record(cls: type, private: bool = True) -> type:
    @attrs.define(eq=False)
    class Recorded(cls):
        normal_records: list = attrs.field(init=False, factory=list)
        private_normal_kv = private

        def _normal_done(self, req, now_s: float) -> None:
            super()._normal_done(req, now_s)
            self.normal_records.append((req.request_id, req.arrival_s, req.first_token_s, req.finish_s,
                                        req.rejected, req.num_cached_tokens, req.num_admissions))

    return Recorded


@functools.cache
def run_case(name: str, steady_runs: bool, lazy_ticks: bool = True, private: bool = True) -> tuple[dict, dict]:
    backend, fields, policy = CASES[name]
    shadow = ShadowConfig(PluginRef(policy), seed=4)
    if backend == "fake":
        run = _record(FakeRun, private)(FakeScenario.from_dict(fields), shadow)
    else:
        run = _record(SimRun, private)(SimScenario.from_dict(fields), shadow)
    for inst in run.cluster.by_id.values():
        inst.steady_runs = steady_runs
    run.cluster.lazy_ticks = lazy_ticks
    result = run.run()
    insts = run.cluster.by_id.values()
    out = {
        "summary": dict(result.metrics),
        "calls": [attrs.astuple(c) for c in result.calls],
        "normal": sorted(run.normal_records),
        "instances": {
            i.instance_id: (i.num_iterations_run, i.iteration, i.num_fast_iterations, i.busy_s,
                            i.num_shadow_tokens, i.num_preemptions, i.num_rejected, i.kv.eviction_count,
                            dict(i.kv.num_evicted_blocks), i.kv.num_free_blocks, i.kv.num_cached_blocks,
                            i.kv.num_shadow_blocks, i.kv.num_reloaded_blocks, i.kv.num_host_blocks,
                            i.kv.idle_order(KVClass.NORMAL), i.kv.idle_order(KVClass.SHADOW))
            for i in insts
        },
        "credit": {k: (h.slack.credit.balance_s, h.slack.credit.earned_s, h.slack.credit.spent_s)
                   for k, h in sorted(run.runtime.hooks.items()) if getattr(h.slack, "credit", None) is not None},
        "end_s": run.loop.now_s,
        "num_events": run.loop.num_events,
    }
    diag = {"ticks": sum(i.num_steady_ticks for i in insts), "iterations": sum(i.num_iterations_run for i in insts),
            "preemptions": sum(i.num_preemptions for i in insts), "evictions": sum(i.kv.eviction_count for i in insts),
            "shadow_tokens": sum(i.num_shadow_tokens for i in insts),
            "lazy_runs": run.cluster.num_lazy_runs, "lazy_cuts": run.cluster.num_lazy_cuts,
            "private_held": sum(i.kv._num_private_held for i in insts),
            "private_runs": sum(len(i.kv._private_runs) for i in insts)}
    return out, diag


@pytest.mark.parametrize("name", ["fake-one-no-shadow-tight-kv", "fake-one-harvest-slo-host-tight-kv",
                                  "sim-one-harvest-slo-host"])
def test_private_normal_kv_changes_nothing(name: str) -> None:
    """Normal requests' fresh prompts as the KV manager's private blocks
    (``ScenarioRun.private_normal_kv``) change nothing at all against the
    same run with every block in the block map: under preemption (the
    request's own blocks hit again), evictions, a host tier and shadow
    allocations (which name the private blocks first)."""
    private, diag = run_case(name, True)
    named, diag_named = run_case(name, True, private=False)
    assert diag["private_held"] + diag["private_runs"] > 0, diag  # the private path ran (not vacuous)
    assert diag_named["private_held"] + diag_named["private_runs"] == 0, diag_named
    for key in private:
        assert _same(_lists(private[key]), _lists(named[key])), f"{name}: {key} differs"


@pytest.mark.parametrize("name", sorted(CASES))
def test_steady_runs_change_nothing(name: str) -> None:
    with_runs, diag = run_case(name, True)
    without, diag_off = run_case(name, False)
    assert diag_off["ticks"] == 0 and diag_off["lazy_runs"] == 0
    # The run actually took iterations in runs, many of them, lazily (not a vacuous comparison).
    assert diag["ticks"] > 1000 and diag["lazy_runs"] > 50, diag
    for key in with_runs:
        if key != "num_events":  # lazy ticks pop fewer events, by design
            assert _same(_lists(with_runs[key]), _lists(without[key])), f"{name}: {key} differs"
    assert with_runs["num_events"] < without["num_events"]


@pytest.mark.parametrize("name", ["fake-one-harvest", "sim-one-no-shadow", "sim-one-vidur-no-shadow",
                                  "sim-one-vidur-harvest-slo-host"])
def test_eager_runs_count_every_event(name: str) -> None:
    """Without lazy ticks, runs of ticks change nothing at all, the event count included
    (inline-run ends count as the events the loop would have popped). The Vidur cases time
    these runs by spans (``predict_decode_span_s``), not plain_ends' look-ahead."""
    eager_runs, diag = run_case(name, True, lazy_ticks=False)
    without, _ = run_case(name, False)
    assert diag["ticks"] > 1000 and diag["lazy_runs"] == 0, diag
    for key in eager_runs:
        assert _same(_lists(eager_runs[key]), _lists(without[key])), f"{name}: {key} differs"


def _lists(value):
    """Tuples as lists, dicts keyed by strings (for ``_same``, which compares floats exactly, NaN equal)."""
    if isinstance(value, (list, tuple)):
        return [_lists(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _lists(v) for k, v in value.items()}
    return value


def test_cases_exercise_what_they_claim() -> None:
    """The tight pools preempt and evict; the shadow case computes shadows."""
    _, tight = run_case("fake-one-no-shadow-tight-kv", True)
    assert tight["preemptions"] > 0 and tight["evictions"] > 0, tight
    _, host = run_case("fake-one-harvest-slo-host-tight-kv", True)
    assert host["evictions"] > 0 and host["shadow_tokens"] > 0, host
    _, harvest = run_case("fake-one-harvest", True)  # lazy runs cut by arrivals and by jobs becoming pending
    assert harvest["lazy_cuts"] > 50, harvest


def _probed(name: str, lazy_ticks: bool, times: list[float]) -> tuple[list, list, int]:
    """The run of ``name`` with a probe at each of ``times`` (a ``WAKE`` event: after every iteration end
    at its time) reading on every instance, by turns, the eviction count or the cached prefix of the
    last normal requests that finished there (their blocks idle in the pool, evicted LRU as decodes
    grow): reads only, so they do not cut a lazy run but make it catch up, each touch point on its own.
    (probes, the next pending end of every lazy instance after each probe, lazy runs)"""
    backend, fields, policy = CASES[name]
    base = FakeRun if backend == "fake" else SimRun

    @attrs.define(eq=False)
    class Probed(base):
        done: dict = attrs.field(init=False, factory=dict)  # instance -> histories of its finished normal requests

        def _normal_done(self, req, now_s: float) -> None:
            super()._normal_done(req, now_s)
            self.done.setdefault(req.request_id.split(":", 1)[1], []).append(req.history)

    run = Probed((FakeScenario if backend == "fake" else SimScenario).from_dict(fields),
                 ShadowConfig(PluginRef(policy), seed=4))
    run.cluster.lazy_ticks = lazy_ticks
    probes, pending = [], []

    def probe(t: float, k: int) -> None:
        for inst_id, inst in run.cluster.by_id.items():
            if k % 2:
                probes.append((t, inst_id, inst.eviction_count()))
            else:
                probes.append((t, inst_id, [run.cluster.cached_prefix_tokens(inst_id, h)
                                            for h in run.done.get(inst_id, [])[-5:]]))
        pending.extend(r.pending_s for r in run.cluster._lazy.values())

    for k, t in enumerate(times):
        run.loop.at(t, WAKE, lambda t, k=k: probe(t, k))
    run.run()
    return probes, pending, run.cluster.num_lazy_runs


def test_observations_equal_the_eager_loops() -> None:
    """Every read of a lazily running instance sees exactly what the eager loop shows at that time
    (the pending ends at or before it applied first), under KV pressure (evictions by decode
    growth): at times between iteration ends, and at times an iteration ends exactly (a read comes
    after the iteration ends at its time)."""
    name = "fake-one-no-shadow-tight-kv"
    grid = [k * 0.02 for k in range(1, int(CASES[name][1]["duration_s"] / 0.02))]
    lazy, pending, runs = _probed(name, True, grid)
    eager, _, none = _probed(name, False, grid)
    assert runs > 50 and none == 0
    assert len({repr(p[2]) for p in lazy}) > 100  # the reads change over the run: a real comparison
    assert lazy == eager
    ties = sorted(set(pending))[::3]  # exact iteration ends of lazy runs (reads change nothing: the same run)
    lazy, _, _ = _probed(name, True, ties)
    eager, _, _ = _probed(name, False, ties)
    assert len(ties) > 100 and lazy == eager
