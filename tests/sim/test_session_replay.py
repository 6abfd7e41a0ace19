"""Replaying a session-trace file in the simulator (``simulate --sessions``,
``Experiment.sessions``): every call is measured, with the file's own token
counts, gaps and per-call models; ``ExperimentRun(..., sessions=...)`` measures
scripted sessions too."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from shadow_sim.experiments.runner import Task, run_task
from shadow_sim.experiments.spec import Experiment, ExperimentRun

from shadow_traces.command import main as sessions_main
from shadow_traces.session_trace import read_session_trace
from shadowcore.cli import main as cli_main
from shadowcore.config import PluginRef, ShadowConfig
from shadowcore.engine.workload import session
from shadowcore.errors import ConfigError
from tests.test_session_trace import traj

SMALL = {"instances_per_model": 1, "warmup_s": 5.0, "drain_s": 5.0}  # the default pair: shipped capacities
CAPACITY = {"Qwen2.5-7B": 4.0, "Llama-3.1-70B": 2.0}


def test_simulate_sessions_from_swe_agent_trajectories(tmp_path: Path, capsys) -> None:
    steps, sessions = 4, 3
    paths = []
    for k in range(sessions):
        paths.append(tmp_path / f"astropy-{k}.traj")
        paths[-1].write_text(json.dumps(traj(steps)))
    out = tmp_path / "mine.jsonl"
    assert sessions_main(["convert", "--from", "swe-agent", *map(str, paths), "-o", str(out)]) == 0
    (tmp_path / "scenario.json").write_text(json.dumps({"experiment": SMALL}))
    capsys.readouterr()
    rc = cli_main(["simulate", "--sessions", str(out), "--scenario", str(tmp_path / "scenario.json"),
                   "--policies", "no-shadow,harvest-slo-host,oracle-host"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert re.search(r"matched calls per run: (\d+)", text).group(1) == str(steps * sessions)
    for policy in ("no-shadow", "harvest-slo-host", "oracle-host"):
        assert re.search(rf"^{policy}!?\s", text, re.MULTILINE), text  # "!": planned no shadow token


def switching_csv(path: Path) -> Path:
    path.write_text("session_id,call_index,model,arrival_s,gap_s,input_tokens,output_tokens,compact_to_tokens\n"
                    "a,0,small,100.0,,3000,200,\n"
                    "a,1,large,,4.0,500,100,\n"
                    "a,2,small,,0.5,700,50,\n"
                    "a,3,small,,1.0,100,20,1000\n"
                    "b,0,large,103.0,,1200,80,\n"
                    "b,1,small,,2.0,300,40,\n")
    return path


def test_replay_keeps_token_counts_models_and_gaps(tmp_path: Path, capsys) -> None:
    from shadow_traces.agent_loaders import load_call_csv
    from shadow_traces.session_trace import write_session_trace

    trace, _ = load_call_csv(switching_csv(tmp_path / "calls.csv"))
    path = tmp_path / "calls.jsonl"
    write_session_trace(trace, path)
    ex = Experiment.from_dict({**SMALL, "sessions": str(path),
                               "session_models": {"small": "Qwen2.5-7B", "large": "Llama-3.1-70B"}})
    assert ex.duration_s == 3.0 + 1.0  # the arrival span + 1 s
    prompts = {(s.session_id, i): p for s in read_session_trace(path).sessions for i, p in enumerate(s.prompt_lengths())}
    models = {"small": "Qwen2.5-7B", "large": "Llama-3.1-70B"}
    want_models = {(s.session_id, i): models[c.model] for s in trace.sessions for i, c in enumerate(s.calls)}
    rec = run_task(Task(ex, PluginRef("oracle-host"), 0, "peak", CAPACITY))
    got = {(c.session_id, c.call_index): c for c in rec.calls}
    assert set(got) == set(prompts) and len(rec.measured_sessions) == 2
    assert {k: c.num_prompt_tokens for k, c in got.items()} == prompts
    assert {k: c.model for k, c in got.items()} == want_models
    assert {k: c.num_output_tokens for k, c in got.items()} == \
        {(s.session_id, i): c.output_tokens for s in trace.sessions for i, c in enumerate(s.calls)}
    assert sum(c.is_switch for c in got.values()) == 3
    # the oracle finds the whole context of every switch call cached (the shadow is exact)
    assert all(c.num_cached_tokens > 0 for c in got.values() if c.is_switch)


def test_replay_errors_name_what_is_wrong(tmp_path: Path) -> None:
    path = tmp_path / "calls.jsonl"
    from shadow_traces.agent_loaders import load_call_csv
    from shadow_traces.session_trace import write_session_trace

    trace, _ = load_call_csv(switching_csv(tmp_path / "calls.csv"))
    write_session_trace(trace, path)
    with pytest.raises(ConfigError, match="session 'b' arrives 3 s after the first"):
        Experiment.from_dict({**SMALL, "sessions": str(path), "duration_s": 2.0})
    with pytest.raises(ConfigError, match="maps to"):
        Experiment.from_dict({**SMALL, "sessions": str(path), "session_models": {"small": "GPT-5"}})
    big = tmp_path / "big.csv"
    # beyond Qwen2.5-7B's 131,072 tokens (YaRN)
    big.write_text("session_id,call_index,model,arrival_s,input_tokens,output_tokens\ns,0,m,0,140000,10\n")
    trace, _ = load_call_csv(big)
    write_session_trace(trace, tmp_path / "big.jsonl")
    with pytest.raises(ConfigError, match="140010 tokens exceed the run's 131072-token context window"):
        Experiment.from_dict({**SMALL, "sessions": str(tmp_path / "big.jsonl")})
    with pytest.raises(ConfigError, match="--sessions"):
        from shadow_sim.experiments.sweep import simulate_table

        simulate_table({"models": ["Qwen2.5-7B", "Llama-3.1-70B"], "sessions": str(path)}, [])


def test_scripted_sessions_are_the_measured_plans() -> None:
    """ScenarioRun(..., sessions=...) on an ExperimentRun: the runner's metrics find
    every call's plan (it used to fail with KeyError ('t0', 0))."""
    ex = Experiment.from_dict({**SMALL, "duration_s": 20.0})
    plans = (session("t0", 6.0, ("Qwen2.5-7B", "Llama-3.1-70B"), (900, 100), (50, 20), (1.0, 0.0)),)
    run = ExperimentRun(ex.sim_scenario(0), ShadowConfig(PluginRef("no-shadow")), sessions=plans, experiment=ex,
                        capacity=dict(CAPACITY))
    result = run.run()
    assert run.workload.sessions == plans
    outputs = {(p.session_id, i): o for p in run.workload.sessions for i, o in enumerate(p.outputs)}
    assert [(c.session_id, c.call_index) for c in result.calls] == [("t0", 0), ("t0", 1)]
    assert [outputs[(c.session_id, c.call_index)] for c in result.calls] == [50, 20]


# -- caps of replayed normal traffic are options and never silent ----------------------------------------


def azure_csv(path: Path) -> Path:
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(40):
        prompt = 9000 if i % 10 == 3 else 500 + i  # 4 prompts over 8,192
        output = 2000 if i % 20 == 7 else 50  # 2 outputs over 1,024
        rows.append(f"2023-11-16 18:00:{i:02d}.0000000,{prompt},{output}")
    path.write_text("\n".join(rows) + "\n")
    return path


def test_normal_trace_caps_are_counted_and_optional(tmp_path: Path, capsys) -> None:
    from shadow_sim.experiments.normal import NormalTraffic
    from shadow_sim.experiments.sweep import main as sweep_main

    src = str(azure_csv(tmp_path / "azure.csv"))
    rep = NormalTraffic(kind="trace", source=src).cap_report()
    assert (rep.num_requests, rep.num_prompt_capped, rep.num_output_capped) == (40, 4, 2)
    uncapped = NormalTraffic(kind="trace", source=src, max_prompt_tokens=None, max_output_tokens=None)
    assert (uncapped.cap_report().num_prompt_capped, uncapped.cap_report().num_output_capped) == (0, 0)
    assert max(p for _, p, _ in uncapped.arrivals(1.0, 30.0, 0, 0, 1)) == 9000
    assert max(p for _, p, _ in NormalTraffic(kind="trace", source=src).arrivals(1.0, 30.0, 0, 0, 1)) == 8192
    with pytest.raises(ConfigError, match="other caps need a trace file"):
        NormalTraffic(max_prompt_tokens=4096)
    out = tmp_path / "out"
    rc = sweep_main(["--pairs", "Q7/L70", "--policies", "no-shadow", "--latency", "roofline", "--duration", "10",
                     "--warmup", "2", "--instances", "1", "--capacity", "Qwen2.5-7B=2,Llama-3.1-70B=1", "--jobs", "1",
                     "--format", "csv", "--out", str(out), "--normal-trace", src, "--max-output", "none"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "40 requests; 4 prompts > 8192 capped (10.00%), outputs uncapped" in text
    caps = json.loads((out / "summary.json").read_text())["comparisons"]["Q7/L70"]["normal_caps"]
    assert (caps["num_prompt_capped"], caps["num_output_capped"], caps["max_output_tokens"]) == (4, 0, None)


# -- one definition of "shadow tokens used" ----------------------------------------------------------------


def test_shadow_tokens_used_reconciles_with_the_switch_calls_extra_hits() -> None:
    """The table's "unused shadow" is 1 - the engine's used / computed shadow tokens
    (host-tier hits included); on a run where only switch calls hit shadow blocks
    that equals what the switch calls found cached beyond the baseline, exactly."""
    from shadow_sim.experiments.metrics import compare_runs

    ex = Experiment.from_dict({"instances_per_model": 1, "duration_s": 60.0, "warmup_s": 10.0, "drain_s": 5.0,
                               "session_rate_per_s": 0.2})
    cap = {"Qwen2.5-7B": 3.0, "Llama-3.1-70B": 1.5}
    runs = [run_task(Task(ex, PluginRef(p), 0, "peak", cap)) for p in ("no-shadow", "harvest-slo-host")]
    m = compare_runs(runs, "no-shadow", None)["harvest-slo-host"]
    assert 0 < m["shadow_tokens_used"] < m["shadow_tokens"]
    assert m["shadow_unused_share"] == pytest.approx(1 - m["shadow_tokens_used"] / m["shadow_tokens"])
    assert 1 - m["shadow_unused_share"] == pytest.approx(m["switch_extra_cached_share"], rel=1e-12)


def test_a_host_tier_hit_on_a_shadow_block_counts_as_used() -> None:
    from shadowcore.kv import HostTierParams, KVClass, KVClassManager, KVClassPolicy

    kv = KVClassManager(8, 16, KVClassPolicy(shadow_cap_fraction=0.5, host=HostTierParams(capacity_bytes=1 << 20)),
                        64.0)
    assert kv.allocate("shadow", [1, 2], 0, KVClass.SHADOW, 0.0) is not None
    kv.release("shadow", 1.0)
    assert kv.allocate("other", list(range(20, 28)), 0, KVClass.NORMAL, 2.0) is not None  # spills 1, 2 to the host
    kv.release("other", 3.0)
    assert kv.in_host(1) and kv.in_host(2)
    a = kv.allocate("routed", [1, 2], 0, KVClass.NORMAL, 4.0)
    assert (a.num_host_hit_blocks, a.num_shadow_blocks_used, kv.num_shadow_blocks_used) == (2, 2, 2)


# -- re-routing a replayed file ------------------------------------------------------------------------------


def always_large(models, tasks, max_steps, rng, model="Llama-3.1-70B"):
    """A third-party session-router factory (by ``module:function`` reference)."""
    from shadowcore.workloads.sessions import MarkovRouter

    class Fixed(MarkovRouter):
        def route(self, rng, step, task, previous_model):
            return model

    return Fixed(models, 0.0)


def test_reroute_keeps_tokens_and_is_seeded() -> None:
    import math

    from shadowcore.workloads.reroute import reroute
    from shadowcore.workloads.sessions import generate, get_preset

    sessions = generate(get_preset("fusionbench"), math.inf, 0, max_sessions=20)
    models = ("x", "y")
    flip = reroute(sessions, PluginRef("markov", {"p_switch": 1.0}), models, seed=5)
    for a, b in zip(sessions, flip):
        assert [attrs_tokens(c) for c in a.calls] == [attrs_tokens(c) for c in b.calls]
        assert a.tool_gaps_s == b.tool_gaps_s and a.arrival_s == b.arrival_s
        assert all(m != n for m, n in zip(b.models, b.models[1:]))  # p = 1: every step switches
    assert reroute(sessions, PluginRef("markov", {"p_switch": 0.5}), models, 5) == \
        reroute(sessions, PluginRef("markov", {"p_switch": 0.5}), models, 5)
    assert reroute(sessions, PluginRef("markov", {"p_switch": 0.5}), models, 5) != \
        reroute(sessions, PluginRef("markov", {"p_switch": 0.5}), models, 6)
    apc = reroute(sessions, PluginRef("accuracy-per-cost", {"rho": 0.5}), models, 0)
    assert {m for s in apc for m in s.models} == {"x", "y"}
    fixed = reroute(sessions, PluginRef(f"{__name__}:always_large", {"model": "y"}), models, 0)
    assert {m for s in fixed for m in s.models} == {"y"}
    assert reroute(sessions, PluginRef("replay"), models, 0) == list(sessions)
    with pytest.raises(ConfigError, match="session_router.args"):
        reroute(sessions, PluginRef("markov", {"p": 1.0}), models, 0)
    with pytest.raises(ConfigError, match="built-in: replay, markov, accuracy-per-cost"):
        reroute(sessions, PluginRef("no-such-router"), models, 0)


def attrs_tokens(c) -> tuple:
    return c.num_new_input_tokens, c.num_tool_tokens, c.num_output_tokens, c.compact_to_tokens


def test_a_single_model_trajectory_rerouted_switches_and_shadows_help(tmp_path: Path, capsys) -> None:
    paths = []
    for k in range(3):
        paths.append(tmp_path / f"t{k}.traj")
        paths[-1].write_text(json.dumps(traj(5)))
    out = tmp_path / "mine.jsonl"
    assert sessions_main(["convert", "--from", "swe-agent", *map(str, paths), "-o", str(out)]) == 0
    assert cli_main(["simulate", "--router", "markov"]) == 2
    assert "re-routes the sessions of --sessions FILE" in capsys.readouterr().err
    ex = Experiment.from_dict({**SMALL, "sessions": str(out), "session_router": {"name": "markov",
                                                                                 "args": {"p_switch": 1.0}}})
    recs = {p: run_task(Task(ex, PluginRef(p), 0, "peak", CAPACITY)) for p in ("no-shadow", "oracle-host")}
    for rec in recs.values():
        assert len(rec.calls) == 15 and sum(c.is_switch for c in rec.calls) == 12  # 4 switches per session
    base = {(c.session_id, c.call_index): c.num_cached_tokens for c in recs["no-shadow"].calls if c.is_switch}
    assert sum(c.num_cached_tokens for c in recs["oracle-host"].calls if c.is_switch) > sum(base.values())
    with pytest.raises(ConfigError, match="re-routes a session file"):
        Experiment.from_dict({**SMALL, "session_router": "markov"})


def test_an_edited_session_file_is_a_different_experiment(tmp_path: Path) -> None:
    from shadow_sim.experiments.distributed import task_key

    from shadow_traces.agent_loaders import load_call_csv
    from shadow_traces.session_trace import write_session_trace

    trace, _ = load_call_csv(switching_csv(tmp_path / "calls.csv"))
    path = tmp_path / "calls.jsonl"
    write_session_trace(trace, path)
    data = {**SMALL, "sessions": str(path), "session_models": {"small": "Qwen2.5-7B", "large": "Llama-3.1-70B"}}
    before = task_key(Task(Experiment.from_dict(data), PluginRef("no-shadow"), 0, "peak", CAPACITY))
    assert before == task_key(Task(Experiment.from_dict(data), PluginRef("no-shadow"), 0, "peak", CAPACITY))
    path.write_text(path.read_text().replace('"output_tokens":200', '"output_tokens":201'))
    after = task_key(Task(Experiment.from_dict(data), PluginRef("no-shadow"), 0, "peak", CAPACITY))
    assert after != before
