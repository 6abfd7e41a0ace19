"""Deferred instances (``EngineCluster.feed``, :mod:`shadowcore.engine.cluster`): an instance that takes its own
normal arrivals and holds no routed call runs in stretches, applied only when the router side observes it, and
the results do not move.

Each case runs one scenario two ways: with the per-instance feed and deferral (the default) and with the
driver's one global feed (a run whose ``start_normal`` is its own, so ``feeds_normal`` is false: the loop as it
was; an instance that holds a routed call takes its arrivals as the feed's events, so that path runs too). Everything a result is made of must be equal: every normal
request's id, instance and arrival, every placement the manager made, the routed calls' records, the normal
records in order, per instance its counters and final KV state, the simulated end time.
"""

from __future__ import annotations

import attrs
import pytest

from shadowcore.config import PluginRef, ShadowConfig
from shadowcore.engine.kinds import CALL
from shadowcore.engine.scenario import FakeRun, FakeScenario

from .test_speed_equivalence import _same

_FAKE = {"instances_per_model": 3, "duration_s": 40.0, "warmup_s": 5.0, "session_rate_per_s": 0.5,
         "calls_per_session": 5, "normal_rate_per_s": 3.0, "normal_output_median": 200, "seed": 5}
_SIM = {"models": ["Qwen2.5-7B", "Llama-3.1-8B"], "latency": "roofline", "instances_per_model": 3,
        "duration_s": 30.0, "warmup_s": 5.0, "session_rate_per_s": 0.4, "calls_per_session": 5,
        "switch_probability": 0.4, "input_tokens_median": 1500, "output_tokens_median": 150,
        "normal_rate_per_s": 4.0, "seed": 7}

#: name -> (backend, scenario fields, policy)
CASES = {
    "fake-no-shadow": ("fake", _FAKE, "no-shadow"),
    "fake-tight-kv": ("fake", {**_FAKE, "num_blocks": 900}, "no-shadow"),  # preemptions, evictions
    "fake-eager": ("fake", _FAKE, "eager"),  # hooks that plan: deferred while no job is pending on them
    "fake-harvest-slo-host": ("fake", _FAKE, "harvest-slo-host"),  # and their credit accrues there
    "sim-no-shadow": ("sim", _SIM, "no-shadow"),
    "sim-harvest-slo-host": ("sim", _SIM, "harvest-slo-host"),
}


def _placed(cls: type, global_feed: bool) -> type:
    """``cls`` keeping every placement the manager made (``placements``); with ``global_feed``, a
    ``start_normal`` of its own (the driver then feeds normal requests one by one)."""

    @attrs.define(eq=False)
    class Placed(cls):
        placements: list = attrs.field(init=False, factory=list)
        started: list = attrs.field(init=False, factory=list)  # (request id, instance, arrival) of normal requests

        def start_call(self, request_id, placement, *args, **kwargs):
            self.placements.append((request_id, self.loop.now_s, attrs.astuple(placement)))
            return super().start_call(request_id, placement, *args, **kwargs)

        def _fed_request(self, inst, request_id, r, arrival_s):
            self.started.append((request_id, inst.instance_id, arrival_s))
            return super()._fed_request(inst, request_id, r, arrival_s)

    if not global_feed:
        return Placed

    @attrs.define(eq=False)
    class GlobalFeed(Placed):
        def start_normal(self, request_id, instance_id, *args, **kwargs):
            self.started.append((request_id, instance_id, self.loop.now_s))
            return super().start_normal(request_id, instance_id, *args, **kwargs)

    return GlobalFeed


def _run(name: str, how: str) -> tuple[dict, object]:
    backend, fields, policy = CASES[name]
    shadow = ShadowConfig(PluginRef(policy), seed=11)
    if backend == "fake":
        cls, scenario = FakeRun, FakeScenario.from_dict(fields)
    else:
        from shadow_sim.simulator import SimRun, SimScenario

        cls, scenario = SimRun, SimScenario.from_dict(fields)
    run = _placed(cls, how == "global")(scenario, shadow)
    assert run.feeds_normal == (how != "global")
    result = run.run()
    instances = {
        i.instance_id: [i.num_iterations_run, i.iteration, i.busy_s, i.num_shadow_tokens, i.num_preemptions,
                        i.num_rejected, i.queued_prefill_tokens, i.kv.eviction_count, i.kv.num_free_blocks,
                        i.kv.num_cached_blocks, i.kv.num_shadow_blocks, i.kv.num_host_blocks]
        for i in run.cluster.by_id.values()}
    out = {"summary": dict(result.metrics), "calls": [attrs.astuple(c) for c in result.calls],
           "placements": run.placements, "started": sorted(run.started), "normal": list(run.normal), "normal_tokens": list(run.normal_tokens),
           "rejected": list(run.rejected), "instances": instances, "end_s": run.loop.now_s,
           "hooks": {i: (dict(h.step_counts), attrs.astuple(h.slack.credit) if hasattr(h.slack, "credit") else None)
                     for i, h in sorted(run.runtime.hooks.items())}}
    return out, run


@pytest.mark.parametrize("name", sorted(CASES))
def test_deferred_runs_change_nothing(name: str) -> None:
    deferred, run = _run(name, "deferred")
    plain, plain_run = _run(name, "global")
    assert plain_run.cluster.num_deferrals == 0
    assert run.cluster.num_deferrals > len(run.cluster.by_id)  # instances went back and forth
    if CASES[name][2] != "no-shadow":
        assert deferred["summary"]["shadow_tokens"] > 0 and sum(deferred["summary"][k] for k in deferred["summary"]
                                                                if k.startswith("steps_")) > 0
    assert len(deferred["placements"]) > 20 and len(deferred["normal"]) > 200
    for key in deferred:
        assert _same(_plain(deferred[key]), _plain(plain[key])), f"{name}: {key} differs (deferred)"


def test_finishing_order_is_restored() -> None:
    """Deferred instances finish their requests in stretches; the run's records are in finishing order after."""
    _, run = _run("fake-no-shadow", "deferred")
    times = list(run._normal_finish_s)
    assert times == sorted(times) and len(times) == len(run.normal)


def _plain(value):
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _probed(how: str, times: list[float], waiting_first: bool = False, cached_first: bool = False) -> list:
    """Reads of every instance at ``times`` (events of the router's class): the placement estimate alone, then the
    eviction count, as a port user may ask them; with ``waiting_first``, ``EngineCluster.num_waiting`` before
    them (as the request-level shadower reads it); with ``cached_first``, before them the cached prefix of every
    session the manager knows (as a placement reads it, before the estimate)."""
    _, fields, policy = CASES["fake-tight-kv"]
    run = _placed(FakeRun, how == "global")(FakeScenario.from_dict(fields), ShadowConfig(PluginRef(policy), seed=11))
    probes = []
    manager = run.runtime.manager

    def probe(t: float) -> None:
        for inst_id, inst in run.cluster.by_id.items():
            if waiting_first:
                probes.append((t, inst_id, run.cluster.num_waiting(inst_id), len(inst.waiting)))
            if cached_first:
                probes.append((t, inst_id, [run.cluster.cached_prefix_tokens(inst_id, manager.history(sid))
                                            for sid in sorted(manager.session_ids())]))
            probes.append((t, inst_id, run.cluster.estimated_prefill_completion_s(inst_id, 0),
                           inst.queued_prefill_tokens, inst.eviction_count(), inst.num_iterations_run))

    for t in times:
        run.loop.at(t, CALL, probe)
    run.run()
    assert (run.cluster.num_deferrals > 0) == (how == "deferred")
    return probes


def test_reads_of_deferred_instances_are_exact() -> None:
    """Every read of a deferred instance sees what the loop as it was shows at that time."""
    grid = [k * 0.05 for k in range(1, int(CASES["fake-tight-kv"][1]["duration_s"] / 0.05))]
    deferred = _probed("deferred", grid)
    assert len({p[3] for p in deferred}) > 3 and len({p[4] for p in deferred}) > 10  # the reads change
    assert deferred == _probed("global", grid)


def test_cached_prefix_reads_of_deferred_instances_are_exact() -> None:
    """A deferred instance's cached prefix of a session, read before anything else brings it up to now (as a
    placement reads it), is what the loop as it was shows: its own normal requests since may have evicted the
    session's blocks (the tight pool), never added one."""
    grid = [k * 0.05 for k in range(1, int(CASES["fake-tight-kv"][1]["duration_s"] / 0.05))]
    deferred = _probed("deferred", grid, cached_first=True)
    reads = [p[2] for p in deferred if len(p) == 3]
    assert sum(1 for r in reads for n in r if n) > 100 and len({n for r in reads for n in r}) > 10  # prefixes held
    assert deferred == _probed("global", grid, cached_first=True)


def _foreign(how: str) -> tuple[list, object]:
    """``fake-no-shadow`` with requests of a harness's own (as the effect harness's request-level shadows) put
    on fed instances now and then: callbacks not the feed's, which record the loop's clock when they run."""
    from shadowcore.engine.instance import EngineRequest, RequestKind
    from shadowcore.job import SessionHistory

    _, fields, policy = CASES["fake-no-shadow"]
    run = _placed(FakeRun, how == "global")(FakeScenario.from_dict(fields), ShadowConfig(PluginRef(policy), seed=11))
    seen = []

    def submit(t: float, k: int) -> None:
        inst = run.cluster.by_id[sorted(run.cluster.by_id)[k % len(run.cluster.by_id)]]
        req = EngineRequest(f"harness-{k}", RequestKind.NORMAL, SessionHistory(f"harness-{k}", num_tokens=300),
                            300, 20, t, 10.0, 1.0,
                            on_token=lambda r, now, k=k: seen.append(("token", k, now, run.loop.now_s)),
                            on_finish=lambda r, now, k=k: seen.append(("finish", k, now, run.loop.now_s)))
        inst.enqueue(req)
        run.cluster.kick(inst)

    for k in range(12):
        run.loop.at(2.0 + 3.0 * k, CALL, lambda t, k=k: submit(t, k))
    run.run()
    return seen, run


def test_requests_of_a_harness_keep_an_instance_eager() -> None:
    """A request whose callbacks are not the feed's (a harness's, the router side's) keeps its instance off the
    deferred path until it finishes: its callbacks run at their own times, in the loop's order, as before."""
    deferred, run = _foreign("deferred")
    plain, plain_run = _foreign("global")
    assert run.cluster.num_deferrals > 0 and plain_run.cluster.num_deferrals == 0
    assert sum(1 for s in deferred if s[0] == "finish") == 12
    assert all(now == clock for _, _, now, clock in deferred)  # each callback ran at its own event
    assert deferred == plain


def test_waiting_counts_of_deferred_instances_are_exact() -> None:
    """``EngineCluster.num_waiting`` (the request-level shadower's read) brings a deferred instance up to now."""
    grid = [k * 0.05 for k in range(1, int(CASES["fake-tight-kv"][1]["duration_s"] / 0.05))]
    deferred = _probed("deferred", grid, waiting_first=True)
    assert len({p[2] for p in deferred if len(p) == 4}) > 2  # the counts change
    assert deferred == _probed("global", grid, waiting_first=True)
