"""P/D disaggregation in the simulator (§3.5, Appendix C): prefill-only and
decode instances per model, KV transfers over each decode instance's inbound
link, shadow KV pushed from the sticky prefill instance of the other model.

Roofline latency, two small models, short runs: the whole file runs in seconds.
"""

from __future__ import annotations

import itertools
import math

import attrs
import pytest
from shadow_policies.building import prefill_slack_for
from shadow_sim.backend import SimBackend
from shadow_sim.disagg import DecodeInstance, KVFabric, PDRun, PrefillInstance, _held_blocks
from shadow_sim.simulator import PDConfig, SimScenario

from shadowcore.config import PluginRef, ShadowConfig
from shadowcore.engine.workload import SessionPlan, draw_sessions
from shadowcore.engine.workload import session as scripted_session
from shadowcore.errors import ConfigError
from shadowcore.pd import ShadowPushPolicy
from shadowcore.policy import Component
from shadowcore.slack import (
    EagerController,
    HarvestController,
    NoShadowController,
    PrefillInstanceController,
    SloSlackController,
)
from shadowcore.testing.conformance import InvariantObserver
from shadowcore.types import BudgetReason

MODELS = ("Qwen2.5-7B", "Llama-3.1-8B")
A, B = MODELS
PD = {"num_prefill": 2, "num_decode": 1, "link_bytes_per_s": 50e9}
BUSY = {
    "models": MODELS, "latency": "roofline", "duration_s": 60.0, "warmup_s": 0.0, "session_rate_per_s": 0.2,
    "calls_per_session": 5, "switch_probability": 0.4, "input_tokens_median": 1500, "output_tokens_median": 100,
    "normal_rate_per_s": 1.0, "pd": PD,
}
QUIET = {**BUSY, "normal_rate_per_s": 0.0, "duration_s": 30.0, "tool_gap_s": 5.0}


def _run(policy: str | PluginRef, scenario: dict, sessions=None, observe: bool = True) -> tuple[PDRun, dict]:
    ref = policy if isinstance(policy, PluginRef) else PluginRef(policy)
    run = PDRun(SimScenario.from_dict(scenario), ShadowConfig(ref), sessions=sessions)
    checker = InvariantObserver(run.cluster.by_id)
    if observe:
        run.runtime.observers.add(checker)
    result = run.run()
    assert not run.runtime.observers.errors, run.runtime.observers.errors
    assert not checker.violations, checker.violations[:5]
    return run, dict(result.metrics)


def _transfer(run: PDRun, session_id: str, index: int):
    return run.fabric.transfers[f"{session_id}#{index}"]


def _kv_bytes(run: PDRun, model: str) -> float:
    return run.cluster.decode[model][0].kv.kv_bytes_per_token


# -- configuration ----------------------------------------------------------------------


def test_pd_config_validated_and_dispatched() -> None:
    with pytest.raises(ConfigError, match=r"scenario\.pd\.num_prefill"):
        SimScenario.from_dict({"pd": {"num_prefill": 0}})
    with pytest.raises(ConfigError, match=r"scenario\.pd\.bogus"):
        SimScenario.from_dict({"pd": {"bogus": 1}})
    assert SimScenario().pd is None  # default: colocated
    assert SimScenario.from_dict({"pd": {}}).pd == PDConfig()
    result = SimBackend().run({**QUIET, "duration_s": 20.0}, ShadowConfig(PluginRef("no-shadow")))
    assert result.metrics["kv_bytes_normal"] > 0 and result.metrics["calls"] > 0


def test_cluster_shape_and_controllers() -> None:
    """The router sees only P instances; P hooks of a harvesting policy run
    the prefill-instance controller; D instances have no hook."""
    run = PDRun(SimScenario.from_dict(BUSY), ShadowConfig(PluginRef("harvest-slo", {"n_min": 64})))
    for m in MODELS:
        assert run.cluster.instances(m) == [f"{m}/p0", f"{m}/p1"]
        assert [d.instance_id for d in run.cluster.decode[m]] == [f"{m}/d0"]
    for inst in run.cluster.by_id.values():
        if isinstance(inst, PrefillInstance):
            assert isinstance(inst.hook.slack, PrefillInstanceController)
            assert inst.hook.slack.n_min == 64 and inst.hook.slack.max_iteration_s == 0.1
        else:
            assert isinstance(inst, DecodeInstance) and inst.hook is None
    assert prefill_slack_for(Component(NoShadowController)) is None  # P instances run the policy's own
    assert prefill_slack_for(Component(EagerController)) is None
    recipe = prefill_slack_for(Component(SloSlackController, {"margin": 0.2}))
    assert recipe.cls is PrefillInstanceController and recipe.kwargs == {"margin": 0.2, "n_min": 256,
                                                                        "chunk_tokens": 2048}
    assert prefill_slack_for(Component(HarvestController, {"n_min": 32})).kwargs["n_min"] == 32


def test_pd_slots_come_from_the_policy() -> None:
    """P/D's prefill controller and push policy are the policy's slots: the
    fabric asks the ``push`` recipe (built with the deployment's push size), a
    spec without ``prefill_slack`` keeps its controller on P instances, and a
    recipe may not set what the deployment owns."""
    run = PDRun(SimScenario.from_dict({**BUSY, "pd": {**PD, "push_tokens": 512}}),
                ShadowConfig(PluginRef("harvest-slo")))
    assert run.fabric.push_policy == ShadowPushPolicy(512, run.scenario.block_size)
    spec = attrs.evolve(run.runtime.policy, prefill_slack=None)
    run.runtime.policy = spec
    p0 = run.cluster.by_id[f"{A}/p0"]
    assert type(run.runtime.attach("another", p0, p0.latency, prefill_iteration_s=0.1).slack) is SloSlackController
    with pytest.raises(ConfigError, match=r"push\.push_tokens"):
        attrs.evolve(spec, push=Component(ShadowPushPolicy, {"push_tokens": 8}))
    with pytest.raises(ConfigError, match=r"prefill_slack\.max_iteration_s"):
        attrs.evolve(spec, prefill_slack=Component(PrefillInstanceController, {"max_iteration_s": 0.2}))


# -- end to end -------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["no-shadow", "harvest-slo", "oracle"])
def test_requests_all_complete(policy: str) -> None:
    """Every routed call and normal request finishes; nothing is left on a
    queue, a link or pinned on a decode instance."""
    run, metrics = _run(policy, BUSY)
    sc = run.scenario
    sessions = draw_sessions(sc)
    assert len(run.calls) == sum(len(s.models) for s in sessions) > 20
    arrivals = len(run.workload.normal)
    assert len(run.normal) == arrivals > 50
    assert not run.rejected
    for inst in run.cluster.by_id.values():
        assert not inst.waiting and not inst.running and not inst.busy
    for link in run.fabric.links.values():
        assert link.busy is None and not link.queue and not link.decode.pins
    for c in run.calls:  # TTFT from P's first token; the call ends on D
        assert 0 < c.ttft_s <= c.latency_s
        assert run.fabric.transfers[f"{c.session_id}#{c.call_index}"].end_s <= c.arrival_s + c.latency_s
    assert metrics["kv_bytes_normal"] > 0
    assert (metrics["kv_bytes_shadow"] > 0) == (policy == "harvest-slo")


def test_second_call_transfers_only_the_delta() -> None:
    """No Shadow, A then A: D keeps the session's context (prompt and output),
    so the second transfer sends only the tokens after its last full block."""
    session = scripted_session("s0", 1.0, (A, A), (2000, 500), (100, 100), gap_s=5.0)
    run, _ = _run("no-shadow", QUIET, sessions=(session,))
    bs, kvb = run.scenario.block_size, _kv_bytes(run, A)
    first, second = _transfer(run, "s0", 0), _transfer(run, "s0", 1)
    assert first.num_tokens == 2000 and first.num_bytes == 2000 * kvb
    held = (2000 + 100) // bs * bs  # D cached the full blocks of prompt + output
    assert second.num_prompt_tokens == 2600
    assert second.num_tokens == 2600 - held == 504
    assert second.num_bytes == 504 * kvb
    assert run.fabric.num_normal_bytes == (2000 + 504) * kvb


def _ab_session() -> SessionPlan:
    return scripted_session("s0", 1.0, (A, B), (3000, 300), (150, 100), gap_s=5.0)


def test_switch_transfer_smaller_with_shadow() -> None:
    """A -> B: with Harvest-SLO the shadow on B's P instance was pushed to B's
    D instance during the tool gap, so the switch prefills and transfers only
    the new input (plus the partial last block); No Shadow sends everything."""
    session = _ab_session()
    cold, _ = _run("no-shadow", QUIET, sessions=(session,))
    warm, metrics = _run(PluginRef("harvest-slo", {"n_min": 16}), QUIET, sessions=(session,))
    bs = warm.scenario.block_size
    before = 3000 + 150  # history when the switch call arrives
    c_cold, c_warm = _transfer(cold, "s0", 1), _transfer(warm, "s0", 1)
    assert c_cold.num_tokens == before + 300
    assert c_warm.num_tokens == before + 300 - before // bs * bs
    assert c_warm.num_bytes < c_cold.num_bytes / 5
    switch = {r.session_id: r for r in warm.calls if r.is_switch}["s0"]
    assert switch.num_cached_tokens == before // bs * bs  # P prefilled only the tail
    cold_switch = {r.session_id: r for r in cold.calls if r.is_switch}["s0"]
    assert switch.ttft_s < cold_switch.ttft_s and switch.latency_s < cold_switch.latency_s
    assert metrics["pushed_tokens"] >= before // bs * bs and metrics["pushed_tokens_used"] > 0


def test_oracle_switch_transfers_only_new_input() -> None:
    """Oracle: the switch call's prefix is on both P and D for free."""
    run, _ = _run("oracle", QUIET, sessions=(_ab_session(),))
    bs = run.scenario.block_size
    assert _transfer(run, "s0", 1).num_tokens == 3150 + 300 - 3150 // bs * bs


# -- link and push invariants -----------------------------------------------------------


def test_no_push_while_link_carries_normal_transfer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pushes start only on a link with no normal transfer on it or waiting;
    uses of a link never overlap; each push is whole blocks, at most 4K tokens
    and D's shadow room, starts where D's held prefix ends and never beyond
    what P holds."""
    problems: list[str] = []
    original = KVFabric._start_push

    def checked(self, link, grant, hashes, epoch):
        d, bs = link.decode, link.decode.kv.block_size
        if link.busy is not None or link.queue:
            problems.append(f"push on a busy link at {self.loop.now_s}")
        if _held_blocks(d.kv, hashes) * bs != grant.start_token:
            problems.append(f"push at {grant.start_token}, D holds {_held_blocks(d.kv, hashes) * bs}")
        job = self.manager.job(grant.job)
        p_held = _held_blocks(self.cluster.by_id[job.instance_id].kv, hashes, device_only=True) * bs
        if grant.start_token + grant.num_tokens > p_held:
            problems.append("push beyond what P holds")
        room = d.kv.shadow_room_blocks(self.loop.now_s) * bs
        if grant.num_tokens > min(4096, room) or grant.num_tokens % bs or grant.num_tokens <= 0:
            problems.append(f"push of {grant.num_tokens} tokens (room {room})")
        original(self, link, grant, hashes, epoch)

    monkeypatch.setattr(KVFabric, "_start_push", checked)
    run, metrics = _run("harvest-slo", BUSY)
    assert not problems, problems[:5]
    pushes = normals = 0
    for link in run.fabric.links.values():
        recs = sorted(link.records, key=lambda r: (r.start_s, r.end_s))
        for a, b in itertools.pairwise(recs):
            assert b.start_s >= a.end_s - 1e-12, (a, b)  # serialized
        for r in recs:
            if r.kind == "push":
                pushes += 1
                assert r.num_waiting_normal == 0
            else:
                normals += 1
        d = link.decode
        assert d.kv.num_shadow_blocks <= d.kv.cap_blocks
    assert pushes > 10 and normals > 50
    assert metrics["kv_bytes_shadow"] > 0


def test_normal_transfer_waits_at_most_one_push() -> None:
    """A normal transfer queued behind a push starts when that push ends."""
    run, _ = _run("harvest-slo", BUSY, observe=False)
    assert any(t.start_s > t.ready_s for t in run.fabric.transfers.values())
    for link in run.fabric.links.values():
        ends = {r.end_s for r in link.records}
        for t in run.fabric.transfers.values():
            if t.decode_id == link.decode.instance_id and t.start_s > t.ready_s:
                assert t.start_s in ends  # it started the moment the link freed


def test_lost_pushes_back_off_under_memory_pressure() -> None:
    """Small decode pools under normal traffic: D reclaims pushed (shadow)
    blocks first; a job whose pushed KV D lost is pushed again no sooner than
    ``cold_age_s`` after its previous push, so pushes cannot churn the link."""
    run, metrics = _run("harvest-slo", {**BUSY, "memory_utilization": 0.3, "normal_rate_per_s": 2.0})
    assert run.fabric.num_backoffs > 0 and metrics["pushed_tokens"] > 0
    cold_age = run.policy.kv.cold_age_s
    for link in run.fabric.links.values():
        last: dict = {}
        for r in (r for r in link.records if r.kind == "push"):
            key = (r.job, r.start_token)
            if key in last:
                assert r.start_s >= last[key] + cold_age - 1e-9, (r, last[key])
            last[key] = r.end_s
    for inst in run.cluster.by_id.values():
        assert inst.kv.num_shadow_blocks <= inst.kv.cap_blocks


def test_prefill_plans_follow_section_3_5() -> None:
    """Shadow plans on P instances: prefill-slack budgets of at most 0.1 s,
    none while a request waits; D instances plan nothing."""
    plans = []

    class Log:
        def on_plan(self, snapshot, plan):
            plans.append((snapshot, plan))

    run = PDRun(SimScenario.from_dict(BUSY), ShadowConfig(PluginRef("harvest-slo")), observers=(Log(),))
    run.run()
    shadow = [(s, p) for s, p in plans if p.grants]
    assert len(shadow) > 20
    for s, p in shadow:
        assert p.budget.reason is BudgetReason.PREFILL_SLACK and p.budget.budget_s <= 0.1 + 1e-12
        assert p.predicted_s <= 0.1 + 1e-9 and s.num_waiting == 0
        assert isinstance(run.cluster.by_id[s.instance_id], PrefillInstance)


def test_deterministic() -> None:
    a = _run("harvest-slo", QUIET, observe=False)[1]
    b = _run("harvest-slo", QUIET, observe=False)[1]
    assert a.keys() == b.keys()
    assert all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)
