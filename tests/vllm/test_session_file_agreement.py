"""One session-trace file, two engines: the simulator's and vLLM's scheduler in
virtual time replay the same calls with the same per-call models and token
counts (and, under no-shadow, the same cached tokens), compactions included
(vLLM virtual time prefills the summary's token ids)."""

from __future__ import annotations

import attrs
from shadow_vllm import virtual  # vLLM itself is imported lazily; conftest guards the folder
from test_virtual_agreement import MODELS, SCENARIO, RooflineRun

from shadow_traces.agent_loaders import load_call_csv
from shadow_traces.replay import trace_plans
from shadowcore.config import PluginRef, ShadowConfig


def test_a_session_file_replays_identically_in_the_simulator_and_in_vllm_virtual_time(tmp_path) -> None:
    rows = ["session_id,call_index,model,arrival_s,gap_s,input_tokens,output_tokens,compact_to_tokens"]
    for k in range(4):
        rows += [f"s{k},0,small,{1.0 + 2.5 * k},,{700 + 40 * k},30,",
                 f"s{k},1,large,,1.5,{200 + k},20,",
                 f"s{k},2,small,,0.5,{90 + k},25,",
                 f"s{k},3,small,,1.0,60,15,",
                 f"s{k},4,large,,1.0,{120 + k},10,256",  # compaction: a 256-token summary + the new input
                 f"s{k},5,large,,0.5,40,10,"]  # same model: it finds the new epoch cached
    (tmp_path / "calls.csv").write_text("\n".join(rows) + "\n")
    trace, _ = load_call_csv(tmp_path / "calls.csv")
    plans = tuple(trace_plans(trace, MODELS, session_models={"small": MODELS[0], "large": MODELS[1]}, start_s=0.5))
    scenario = attrs.evolve(SCENARIO, normal_rate_per_s=0.3)
    shadow = ShadowConfig(PluginRef("no-shadow"))
    sim = RooflineRun(scenario, shadow, sessions=plans)
    sim.run()
    configs = {m: virtual.VirtualEngineConfig(block_size=scenario.block_size, num_blocks=scenario.num_blocks + 1,
                                              max_num_batched_tokens=scenario.token_budget, max_num_seqs=256)
               for m in MODELS}
    vrun = virtual.VirtualScenarioRun(scenario, shadow, {m: sim.cluster.by_model[m][0].latency for m in MODELS},
                                      configs, sessions=plans)
    vrun.run()

    def per_call(calls):
        return sorted((c.session_id, c.call_index, c.model, c.is_switch, c.num_prompt_tokens, c.num_cached_tokens)
                      for c in calls)

    want = sorted((s.session_id, i, p) for s in trace.sessions for i, p in enumerate(s.prompt_lengths()))
    got_sim, got_vllm = per_call(sim.calls), per_call(vrun.calls)
    assert [(s, i, p) for s, i, _m, _w, p, _c in got_sim] == want  # the file's prompts, every call
    assert got_vllm == got_sim
    assert {c[2] for c in got_sim} == set(MODELS)
    assert sum(c[3] for c in got_sim) == 3 * 4  # three switches per session
    after = [c for c in got_vllm if c[1] == 5]  # the call after the compaction: the summary epoch is cached
    assert all(c[5] >= 256 for c in after), after
    assert all(c[5] < 256 for c in got_vllm if c[1] == 4)  # the compacting call itself finds nothing of it
