"""Agreement: one seeded call sequence through the simulator's engine
(``shadowcore.engine.instance.EngineInstance``, fake backend) and through
vLLM's real scheduler in virtual time (``shadow_vllm.virtual``) with the
shadow scheduler, the same policy and the same H100 latency model (the
simulator's roofline of each model).

Where the two engines see the same batch, queue, token budget, shadow KV room
and pending jobs, the shadow decisions (budget reason, tokens per grant, order
of jobs) must be identical. ``pytest -s`` prints how many steps that covered
and where the engines first differ. With ``n_min=0``, and with
``keep_tails_below_n_min`` at the paper's ``n_min``, the two run in lockstep on
every planned step; with the engine's default the shadow scheduler finishes
shadows whose missing tokens together are below ``n_min`` where the simulator
keeps them pending (``docs/vllm.md``, "Tails below n_min";
``benchmarks/README.md``, vLLM section). Earlier causes, now fixed: the fake
engine cached the block completed by a request's last sampled token, whose KV
vLLM never computes; a superseding shadow request took a new place among equal
switch probabilities.
"""

from __future__ import annotations

import json

import attrs
import pytest
from shadow_sim.latency import latency_model
from shadow_vllm import virtual  # vLLM itself is imported lazily; conftest guards the folder

from shadowcore.config import PluginRef, ShadowConfig
from shadowcore.engine.instance import EngineInstance, EngineLimits
from shadowcore.engine.scenario import FakeRun, FakeScenario
from shadowcore.kv import KVClassManager
from shadowcore.latency import BatchShape
from shadowcore.testing import agreement

MODELS = ("Qwen2.5-7B", "Llama-3.1-70B")
SCENARIO = FakeScenario(
    models=MODELS, latency_scale=(1.0, 1.0), instances_per_model=1, duration_s=20.0, warmup_s=0.0,
    session_rate_per_s=0.3, calls_per_session=4, switch_probability=0.3, input_tokens_median=600,
    output_tokens_median=40, normal_rate_per_s=0.5, normal_prompt_median=400, normal_output_median=30,
    num_blocks=2048, block_size=16, token_budget=2048, seed=1,
)


@attrs.define(eq=False)
class RooflineRun(FakeRun):
    """The fake backend's run with the simulator's H100 roofline latency per model."""

    def build_instance(self, instance_id: str, model: str, kv_policy) -> EngineInstance:
        sc = self.scenario
        latency = latency_model(model, kind="roofline")
        kv = KVClassManager(sc.num_blocks, sc.block_size, kv_policy, sc.kv_bytes_per_token)
        tpot = max(sc.slo.tpot_s, 5 * latency.predict_s(BatchShape((), (sc.input_tokens_median,))))
        return EngineInstance(instance_id, model, kv, latency, tpot, EngineLimits(sc.token_budget))


def _run_both(policy: str, scheduler_cls, keep_tails: bool = False, scenario: FakeScenario = SCENARIO,
              **policy_args):
    """The simulator's run (done) and the virtual vLLM run (built, not run)."""
    shadow = ShadowConfig(PluginRef(policy, policy_args))
    sim_rec = agreement.PlanRecorder(lambda i: [j for j in sim.runtime.manager.jobs() if j.instance_id == i])
    sim = RooflineRun(scenario, shadow, (sim_rec,))
    sim.run()
    configs = {}
    for m in MODELS:
        inst = sim.cluster.by_model[m][0]
        extra = {}
        if scheduler_cls is not None:  # the engine rebuilds the same policy, SLOs and latency model
            extra = {"shadowprefill": {
                "shadow": json.loads(shadow.to_json()),
                "slo": {"ttft_s": scenario.slo.ttft_s, "tpot_s": inst.tpot_slo_s},
                "latency": {"name": "shadow_sim.latency:latency_model", "args": {"name": m, "kind": "roofline"}},
                "keep_tails_below_n_min": keep_tails,
            }}
        configs[m] = virtual.VirtualEngineConfig(
            block_size=scenario.block_size, num_blocks=scenario.num_blocks + 1,  # + vLLM's null block
            max_num_batched_tokens=scenario.token_budget, max_num_seqs=256, additional_config=extra)
    vrun = virtual.VirtualScenarioRun(
        scenario, shadow, {m: sim.cluster.by_model[m][0].latency for m in MODELS}, configs,
        scheduler_cls=scheduler_cls, shadow_feeder=virtual.TaggedShadowFeeder() if scheduler_cls else None)
    return sim, vrun


def _report(a) -> str:
    lines = [(f"{a.instance_id}: planned steps sim/vLLM {a.num_steps}, lockstep {a.num_lockstep}, "
             f"same batch {a.num_same_batch}, same batch and jobs {a.num_compared} "
             f"({a.num_compared_with_grants} with grants, {a.num_compared_multi_job} with several jobs), "
             f"decision mismatches {len(a.mismatches)}")]
    x, y = a.first_divergence
    if x is not None or y is not None:
        lines.append(f"  first divergence at t={x.now_s if x else y.now_s:.6f}:")
        for name, s in (("sim ", x), ("vLLM", y)):
            if s is not None:
                lines.append(f"    {name} batch={s.batch[:2]} waiting={s.num_waiting} room={s.num_shadow_room_tokens} "
                             f"jobs={s.jobs} -> {s.decision}")
    return "\n".join(lines)


def test_no_shadow_traffic_is_scheduled_identically_by_vllm_and_the_simulator() -> None:
    """Routed and normal traffic alone: the fake engine's batches are vLLM's, step for step."""
    sim, vrun = _run_both("no-shadow", None)
    vrun.run()
    for m in MODELS:
        inst = f"{m}/0"
        ref = [(round(s.now_s, 9), s.batch) for s in sim.observers[0].steps[inst] if s.batch]
        got = [(round(st.start_s, 9), tuple(sorted((r.request_id, "decode" if r.is_decode else "prefill",
                                                      r.num_scheduled_tokens, r.num_context_tokens)
                                                     for r in st.batch)))
               for st in vrun.cluster.by_id[inst].steps]
        assert len(ref) > 500
        assert got == ref
        print(f"\nno-shadow {inst}: {len(ref)} iterations identical")
    sim_calls = sorted((c.session_id, c.call_index, c.num_prompt_tokens, c.num_cached_tokens) for c in sim.calls)
    v_calls = sorted((c.session_id, c.call_index, c.num_prompt_tokens, c.num_cached_tokens) for c in vrun.calls)
    assert v_calls == sim_calls and len(v_calls) >= 20


@pytest.mark.parametrize(("policy_args", "keep_tails", "min_compared", "min_with_grants"), [
    ({"n_min": 0}, False, 0.9, 30),  # every tail plannable: both engines keep the same jobs
    ({}, False, 0.15, 4),  # the paper's n_min=256: the engine finishes tails the simulator keeps pending
    ({}, True, 0.9, 20),  # ... unless it keeps them too (keep_tails_below_n_min)
])
def test_shadow_decisions_agree_where_the_engines_see_the_same_batch(policy_args, keep_tails, min_compared,
                                                                     min_with_grants) -> None:
    from shadow_vllm.scheduler import ShadowScheduler

    sim, vrun = _run_both("harvest-slo", ShadowScheduler, keep_tails, **policy_args)
    vllm_rec = agreement.PlanRecorder(
        lambda i: [e.job for e in vrun.cluster.by_id[i].scheduler.shadow_jobs.entries()])
    for engine in vrun.cluster.by_id.values():
        engine.scheduler.shadow_hook.observers.add(vllm_rec)
    vrun.run()
    n_min = sim.runtime.hooks[f"{MODELS[0]}/0"].slack.n_min
    agreements = [agreement.compare_steps(f"{m}/0", sim.observers[0].steps[f"{m}/0"], vllm_rec.steps[f"{m}/0"], n_min)
                  for m in MODELS]
    print(f"\nharvest-slo {policy_args}, keep_tails_below_n_min={keep_tails}:\n"
          + "\n".join(_report(a) for a in agreements))
    for a in agreements:
        assert a.mismatches == (), _report(a)
        assert a.num_compared >= min_compared * a.num_steps[0], _report(a)
    assert sum(a.num_compared_with_grants for a in agreements) >= min_with_grants
    if policy_args or keep_tails:
        assert sum(a.num_compared_multi_job for a in agreements) >= 1  # the order of jobs was checked
    shadow_tokens = sum(e.scheduler.shadow_stats.num_shadow_tokens for e in vrun.cluster.by_id.values())
    assert shadow_tokens > 5000


def test_one_lru_eviction_agrees_under_kv_pressure() -> None:
    """``eviction_order="lru"`` in both engines (the simulator's KVClassManager,
    the vLLM bridge) on a 400-block pool where both classes get evicted: no
    decision differs where the engines see the same batch and jobs. Under this
    pressure the engines part more often than with room (vLLM preempts), for
    either eviction order alike (shadow-first compares about as many steps)."""
    from shadow_vllm.scheduler import ShadowScheduler

    small = attrs.evolve(SCENARIO, num_blocks=400)
    sim, vrun = _run_both("harvest-slo", ShadowScheduler, False, small, n_min=0, eviction_order="lru")
    vllm_rec = agreement.PlanRecorder(
        lambda i: [e.job for e in vrun.cluster.by_id[i].scheduler.shadow_jobs.entries()])
    for engine in vrun.cluster.by_id.values():
        engine.scheduler.shadow_hook.observers.add(vllm_rec)
    vrun.run()
    agreements = [agreement.compare_steps(f"{m}/0", sim.observers[0].steps[f"{m}/0"], vllm_rec.steps[f"{m}/0"], 0)
                  for m in MODELS]
    print("\nharvest-slo lru, 400 blocks:\n" + "\n".join(_report(a) for a in agreements))
    for a in agreements:
        assert a.mismatches == (), _report(a)
        assert a.num_compared >= 0.2 * a.num_steps[0], _report(a)
    assert sum(a.num_compared_with_grants for a in agreements) >= 10
    for engine in vrun.cluster.by_id.values():
        evicted = engine.scheduler.shadow_bridge.num_evicted_blocks
        assert min(evicted.values()) > 0, evicted  # both classes were evicted: the order mattered
    for inst in sim.cluster.by_id.values():
        assert min(inst.kv.num_evicted_blocks.values()) > 0
