"""Effect-level agreement (issue 16 item 6), the small case: one session file
plus one normal-traffic draw, one instance per model, through the simulator and
through vLLM's scheduler in virtual time with the same roofline latency model:
switch-call TTFT reduction within 10% (relative), switch hit rate within 1
point, same-model TTFT ratio within 0.03, for no-shadow, request-level,
harvest-slo and benefit-host (:mod:`shadow_vllm.effects`). The full case:
``benchmarks/effect_agreement.py``."""

from __future__ import annotations

from shadow_sim.latency import latency_model
from shadow_vllm import effects

from shadow_traces.agent_loaders import load_call_csv
from shadow_traces.replay import trace_plans
from shadowcore.engine.scenario import FakeScenario

MODELS = ("Qwen2.5-7B", "Llama-3.1-8B")


def test_effects_agree_between_the_simulator_and_vllm_virtual_time(tmp_path) -> None:
    effects.write_session_file(tmp_path / "calls.csv", num_sessions=4, span_s=10.0)
    trace, _ = load_call_csv(tmp_path / "calls.csv")
    plans = trace_plans(trace, MODELS, session_models={"small": MODELS[0], "large": MODELS[1]}, start_s=0.5)
    scenario = FakeScenario(
        models=MODELS, latency_scale=(1.0, 1.0), instances_per_model=1, duration_s=12.0, warmup_s=0.0,
        input_tokens_median=1500, normal_rate_per_s=2.0, normal_prompt_median=800, normal_output_median=150,
        num_blocks=8192, block_size=16, token_budget=2048, seed=1,
    )
    latency = {m: latency_model(m, kind="roofline") for m in MODELS}

    def spec(m: str) -> dict:
        return {"name": "shadow_sim.latency:latency_model", "args": {"name": m, "kind": "roofline"}}

    sim = {arm: effects.run_sim(arm, scenario, plans, latency) for arm in effects.ARMS}
    vllm = {arm: effects.run_virtual(arm, scenario, plans, latency, spec) for arm in effects.ARMS}
    rows = effects.compare(sim, vllm)
    print("\n" + effects.table(rows))
    assert [r.misses for r in rows] == [()] * len(effects.ARMS), effects.table(rows)
    # the case exercises what it compares: every call finished in both engines, switches, shadows that help
    assert all(len(sim[a]) == len(vllm[a]) == 24 for a in effects.ARMS)
    by_arm = {r.arm: r for r in rows}
    assert by_arm["no-shadow"].sim["switch_calls"] >= 5
    for arm in ("request-level", "harvest-slo", "benefit-host"):
        assert by_arm[arm].sim["switch_ttft_reduction"] > 0.3, arm
        assert by_arm[arm].sim["switch_hit_rate"] > by_arm["no-shadow"].sim["switch_hit_rate"] + 0.3, arm
    # the comparison can fail: the simulator's harvest-slo against vLLM's no-shadow misses
    crossed = effects.ArmAgreement("harvest-slo", by_arm["harvest-slo"].sim, by_arm["no-shadow"].vllm)
    assert {"switch_ttft_reduction", "switch_hit_rate"} <= set(crossed.misses)
