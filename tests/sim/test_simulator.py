"""The simulator backend: every registered policy passes the core's
conformance check on a multi-model catalog cluster; same seed, same result;
bad scenarios fail with one error naming the field and the valid choices."""

from __future__ import annotations

import pytest
from shadow_sim.backend import SimBackend
from shadow_sim.models import get_model
from shadow_sim.simulator import SimRun, SimScenario

from shadowcore.config import PluginRef, ShadowConfig
from shadowcore.errors import ConfigError
from shadowcore.registry import policies
from shadowcore.testing.conformance import InvariantObserver

SMALL = {
    "latency": "roofline",  # the Vidur model is covered by its own tests; this one checks the engine
    "instances_per_model": 1,
    "duration_s": 60.0,
    "warmup_s": 0.0,
    "session_rate_per_s": 0.2,
    "calls_per_session": 5,
    "switch_probability": 0.4,
    "normal_rate_per_s": 2.0,
}


def _conformance(policy: str, scenario: dict) -> tuple[SimRun, InvariantObserver]:
    run = SimRun(SimScenario.from_dict(scenario), ShadowConfig(PluginRef(policy)))
    checker = InvariantObserver(run.cluster.by_id)
    run.runtime.observers.add(checker)
    run.run()
    assert not run.runtime.observers.errors
    return run, checker


@pytest.mark.parametrize("policy", policies.names())
def test_every_registered_policy_conforms_on_the_simulator(policy: str) -> None:
    run, checker = _conformance(policy, {**SMALL, "models": ["Qwen2.5-7B", "Llama-3.1-8B", "Mistral-7B"]})
    assert not checker.violations, checker.violations[:5]
    assert checker.num_plans > 100
    assert run.calls and all(c.latency_s > 0 for c in run.calls)


def test_shadow_policy_warms_switches_on_the_simulator() -> None:
    base = SimBackend().run(SMALL, ShadowConfig(PluginRef("no-shadow")))
    shadow = SimBackend().run(SMALL, ShadowConfig(PluginRef("harvest-slo-host")))
    oracle = SimBackend().run(SMALL, ShadowConfig(PluginRef("oracle-host")))
    assert shadow.metrics["shadow_tokens"] > 0
    assert shadow.metrics["switch_hit_rate"] > base.metrics["switch_hit_rate"]
    assert oracle.metrics["switch_hit_rate"] >= shadow.metrics["switch_hit_rate"]
    assert shadow.metrics["energy_j"] > 0


def test_same_seed_same_result() -> None:
    a = SimBackend().run(SMALL, ShadowConfig(PluginRef("harvest-slo-host"), seed=3))
    b = SimBackend().run(SMALL, ShadowConfig(PluginRef("harvest-slo-host"), seed=3))
    assert a.calls == b.calls and a.metrics == b.metrics
    c = SimBackend().run({**SMALL, "seed": 1}, ShadowConfig(PluginRef("harvest-slo-host"), seed=3))
    assert c.calls != a.calls


def test_tensor_parallel_and_pool_follow_the_catalog() -> None:
    run = SimRun(SimScenario.from_dict({**SMALL, "models": ["Qwen2.5-7B", "Llama-3.1-70B"]}),
                 ShadowConfig(PluginRef("no-shadow")))
    small, large = run.cluster.by_id["Qwen2.5-7B/0"], run.cluster.by_id["Llama-3.1-70B/0"]
    assert (small.num_gpus, large.num_gpus) == (1, 4)
    # KV pool: 90% of the instance's HBM minus the weights, in 16-token blocks
    for inst, name in ((small, "Qwen2.5-7B"), (large, "Llama-3.1-70B")):
        m = get_model(name)
        expected = int((0.9 * 80e9 * inst.num_gpus - m.serving_weight_bytes) // (16 * m.kv_bytes_per_token()))
        assert inst.kv.num_blocks == expected > 0


@pytest.mark.parametrize(
    ("scenario", "field", "needle"),
    [
        ({"models": ["Qwen2.5-7B", "NoSuchModel-3B"]}, "models[1]", "Llama-3.1-8B"),
        ({"device": "TPUv9"}, "device", "H100-80GB"),
        ({"latency": "magic"}, "latency", "roofline"),
        ({"tp": [3, 1]}, "tp[0]", "1, 2, 4 or 8"),
        ({"slo": {"ttft_s": -1}}, "scenario.slo.ttft_s", "-1"),
        ({"instances_per_model": 0}, "scenario.instances_per_model", "0"),
        ({"bogus": 1}, "scenario.bogus", "unknown field"),
    ],
)
def test_bad_scenarios_name_field_and_choices(scenario: dict, field: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        SimScenario.from_dict({**SMALL, **scenario})
    assert field in str(info.value) and needle in str(info.value)


def test_model_that_fits_no_device_fails_before_running() -> None:
    with pytest.raises(ConfigError) as info:
        SimScenario.from_dict({**SMALL, "models": ["Qwen2.5-7B", "DeepSeek-R1"]})
    assert info.value.field == "scenario.models[1]" and "H100-80GB" in str(info.value)


def test_table1_preset_sessions_run_to_completion() -> None:
    scenario = {**SMALL, "preset": "fusionbench", "models": ["Llama-3.1-8B", "Llama-3.1-70B"], "duration_s": 120.0}
    run = SimRun(SimScenario.from_dict(scenario), ShadowConfig(PluginRef("harvest-slo-host")))
    plans = run.workload.sessions
    result = run.run()
    assert plans and all(c.gap_after_s > 0 for p in plans for c in p.calls[:-1])  # the preset's tool gaps
    assert {m for p in plans for m in p.models} <= {"Llama-3.1-8B", "Llama-3.1-70B"}
    assert len(run.calls) == sum(len(p.models) for p in plans)  # every call of every session completed
    assert result.metrics["switch_calls"] > 0


def test_unknown_preset_lists_valid_ones() -> None:
    with pytest.raises(ConfigError) as info:
        SimScenario.from_dict({**SMALL, "preset": "nonesuch"})
    assert "nonesuch" in str(info.value) and "fusionbench" in str(info.value)
