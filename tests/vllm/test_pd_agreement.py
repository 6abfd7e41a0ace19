"""P/D agreement: one seeded P/D call sequence through the simulator's P/D
cluster (``shadow_sim.disagg.PDRun``) and through vLLM virtual time
(``shadow_vllm.virtual.pd.PDVirtualRun``: ``PrefillShadowScheduler`` and
``DecodeShadowScheduler`` with the real ``NixlConnector`` scheduler side),
same policy, workload, pools, budgets, SLOs, H100 roofline on P.

Where the P engines see the same batch, queue, budget, shadow room and jobs,
the shadow decisions are identical; where a D engine's push policy is asked
with the same link state, free room and candidates, the grant is identical;
and the first pushes of each D come in the same order with the same sizes.
``pytest -s`` prints the coverage. The test's choices that make the engines
comparable: D instances get one context-free latency model in both runs (vLLM's
D recomputes the last prompt token, context one shorter than the
simulator's first D decode), and the fake link charges a read by its tokens
(the simulator's accounting; ``NixlConnector`` moves whole blocks).

Where they part, by design (docs/vllm.md, "P/D engines"): on vLLM a shadow
prefix is pushable once its shadow request ends on P (the connector hands
over a finished request's blocks), while the simulator pushes after every
chunk, so vLLM pushes later and less; and vLLM's D starts a transfer at its
next scheduling step, the simulator at P's first token.
"""

from __future__ import annotations

from shadow_vllm.virtual import pd_compare  # vLLM itself is imported lazily; conftest guards the folder

from shadowcore.latency import LinearLatencyModel
from shadowcore.testing import agreement

MODELS = ("Qwen2.5-7B", "Llama-3.1-8B")
SCENARIO = {
    "models": MODELS, "latency": "roofline", "duration_s": 30.0, "warmup_s": 0.0, "tool_gap_s": 5.0,
    "session_rate_per_s": 0.2, "calls_per_session": 5, "switch_probability": 0.4, "input_tokens_median": 1500,
    "output_tokens_median": 4, "normal_rate_per_s": 0.0, "seed": 1,
    "pd": {"num_prefill": 1, "num_decode": 1, "link_bytes_per_s": 50e9},
}
#: D's step time independent of context, the same in both runs (see the module docstring).
DECODE_LATENCY = LinearLatencyModel(overhead_s=0.004, prefill_s_per_token=5e-5, attention_s_per_token_pair=0.0,
                                    decode_s_per_seq=5e-5, decode_s_per_context_token=0.0)


def test_p_shadow_and_d_push_decisions_agree_where_the_engines_see_the_same_inputs() -> None:
    sim_rec = agreement.PlanRecorder(lambda i: [j for j in sim.runtime.manager.jobs() if j.instance_id == i])
    push_rec = None

    def wrap(policy, clock):
        nonlocal push_rec
        push_rec = agreement.PushRecorder(policy, clock)
        return push_rec

    sim = pd_compare.sim_run(SCENARIO, observers=(sim_rec,), decode_latency=DECODE_LATENCY, push_wrapper=wrap,
                             run=False)
    sim.run()
    vllm_rec = None

    def observe(vrun):
        nonlocal vllm_rec
        vllm_rec = agreement.PlanRecorder(
            lambda i: [e.job for e in vrun.cluster.by_id[i].scheduler.shadow_jobs.entries()])
        return vllm_rec

    vrun = pd_compare.virtual_run(sim, decode_latency=DECODE_LATENCY, observer=observe)
    n_min = sim.runtime.hooks[f"{MODELS[0]}/p0"].slack.n_min
    lines = []
    plans, pushes = [], []
    for m in MODELS:
        a = agreement.compare_steps(f"{m}/p0", sim_rec.steps[f"{m}/p0"], vllm_rec.steps[f"{m}/p0"], n_min)
        d = f"{m}/d0"
        p = agreement.compare_pushes(d, push_rec.decisions.get(d, []),
                                      vrun.fabric.engines[d].scheduler.shadow_push_decisions)
        plans.append(a)
        pushes.append(p)
        lines.append(f"{m}/p0: planned steps sim/vLLM {a.num_steps}, lockstep {a.num_lockstep}, same batch and "
                     f"jobs {a.num_compared} ({a.num_compared_with_grants} with grants), mismatches {len(a.mismatches)}")
        lines.append(f"{d}: push decisions sim/vLLM {p.num_decisions}, grants {p.num_grants}, same inputs "
                     f"{p.num_matched} ({p.num_matched_with_grants} with grants), mismatches {len(p.mismatches)}, "
                     f"leading grants identical {p.num_same_grant_sequence}")
    print("\n" + "\n".join(lines))
    for a in plans:
        assert a.mismatches == (), a.mismatches[:1]
        assert a.num_lockstep >= 10 and a.num_compared >= 0.5 * a.num_steps[0], lines
    assert sum(a.num_compared_with_grants for a in plans) >= 15
    for p in pushes:
        assert p.mismatches == (), p.mismatches[:1]
        assert p.num_same_grant_sequence >= 1, lines
    assert sum(p.num_matched_with_grants for p in pushes) >= 6
    # Same calls; nothing read from blocks P had already let go of.
    assert sorted((c.session_id, c.call_index) for c in vrun.calls) == \
        sorted((c.session_id, c.call_index) for c in sim.calls) and len(sim.calls) >= 20
    assert vrun.fabric.num_stale_reads == 0
    side = pd_compare.summary(sim, vrun)
    assert side["vllm_virtual"]["switch_transfer_MB"] == side["simulator"]["switch_transfer_MB"]
    assert side["vllm_virtual"]["pushed_tokens"] > 0
