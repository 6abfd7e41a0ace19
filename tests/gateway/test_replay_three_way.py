"""One session-trace file, three ways (issue 14's last done-when line): the
simulator, vLLM's scheduler in virtual time and ``shadowprefill replay``
through the gateway give the same per-call routing (model, switch) and token
counts (prompt as sent, output) for every call of the file."""

from __future__ import annotations

import importlib.util

import pytest
from shadow_gateway.replay import replay

from shadow_traces.agent_loaders import load_call_csv
from shadow_traces.replay import trace_plans
from shadowcore.config import PluginRef, ShadowConfig
from shadowcore.engine.scenario import FakeRun, FakeScenario

from .conftest import two_model_config

MODELS = ("small", "large")


def test_simulate_virtual_time_and_gateway_replay_agree_per_call(upstreams, gateway, tmp_path) -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed: virtual time needs it (docs/vllm.md)")
    from shadow_vllm import virtual

    rows = ["session_id,call_index,model,arrival_s,gap_s,input_tokens,output_tokens"]
    for k in range(3):  # no compaction: virtual time would need the summary's token ids
        rows += [f"s{k},0,a,{0.5 * k},,{300 + 10 * k},12", f"s{k},1,b,,0.2,{40 + k},6",
                 f"s{k},2,b,,0.1,25,5", f"s{k},3,a,,0.3,10,4"]
    (tmp_path / "calls.csv").write_text("\n".join(rows) + "\n")
    trace, _ = load_call_csv(tmp_path / "calls.csv")
    want = [(s.session_id, i, c.model, i > 0 and c.model != s.calls[i - 1].model, p, c.output_tokens)
            for s in trace.sessions for i, (c, p) in enumerate(zip(s.calls, s.prompt_lengths()))]

    (a,), (b,) = upstreams(1), upstreams(1)
    report = replay(trace, gateway(two_model_config([a], [b])).url, time_scale=0.0)
    assert report.failures == ()
    got_gateway = sorted((c.session_id, c.call_index, c.model, c.is_switch, c.num_prompt_tokens, c.num_output_tokens)
                         for c in report.calls)

    names = {"a": MODELS[0], "b": MODELS[1]}
    plans = tuple(trace_plans(trace, MODELS, session_models=names, start_s=0.5))
    outputs = {(p.session_id, i): c.num_output_tokens for p in plans for i, c in enumerate(p.calls)}
    scenario = FakeScenario(models=MODELS, instances_per_model=1, duration_s=10.0, warmup_s=0.0,
                            normal_rate_per_s=0.0, block_size=16, num_blocks=1024)
    shadow = ShadowConfig(PluginRef("no-shadow"))
    sim = FakeRun(scenario, shadow, sessions=plans)
    sim.run()
    configs = {m: virtual.VirtualEngineConfig(block_size=16, num_blocks=1025, max_num_batched_tokens=2048,
                                              max_num_seqs=256) for m in MODELS}
    vrun = virtual.VirtualScenarioRun(scenario, shadow, {m: sim.cluster.by_model[m][0].latency for m in MODELS},
                                      configs, sessions=plans)
    vrun.run()
    back = {v: k for k, v in names.items()}

    def per_call(calls):
        return sorted((c.session_id, c.call_index, back[c.model], c.is_switch, c.num_prompt_tokens,
                       outputs[(c.session_id, c.call_index)]) for c in calls)

    assert got_gateway == sorted(want)
    assert per_call(sim.calls) == got_gateway
    assert per_call(vrun.calls) == got_gateway
