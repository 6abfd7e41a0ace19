"""``shadowprefill replay``: a session trace played against the gateway (fake
upstreams on loopback) reaches the engines with the trace's token counts and
models, the same per-call routing and token counts the simulator replays."""

from __future__ import annotations

import itertools
import json

from shadow_gateway.replay import main as replay_main
from shadow_gateway.replay import replay, synthetic_ids

from shadow_traces.agent_loaders import load_call_csv
from shadow_traces.session_trace import read_session_trace, write_session_trace

from .conftest import two_model_config


def _trace(tmp_path):
    rows = ["session_id,call_index,model,task,arrival_s,gap_s,input_tokens,output_tokens,compact_to_tokens"]
    for k in range(3):
        rows += [f"s{k},0,a,task{k},{0.01 * k},,{300 + 10 * k},12,",
                 f"s{k},1,b,,,0.0,{40 + k},6,",
                 f"s{k},2,b,,,0.0,25,5,",
                 f"s{k},3,a,,,0.0,10,4,{100 + k}"]
    (tmp_path / "calls.csv").write_text("\n".join(rows) + "\n")
    trace, _ = load_call_csv(tmp_path / "calls.csv")
    write_session_trace(trace, tmp_path / "calls.jsonl")
    return trace


def test_replay_reaches_the_engines_with_the_traces_tokens_and_models(upstreams, gateway, tmp_path, capsys):
    (a,), (b,) = upstreams(1), upstreams(1)
    # no fault injected here: timeouts generous for a loaded 2-core machine (the defaults' 0.5 s connect and 2 s
    # read timed out, and ejected the instance, at load average 13)
    gw = gateway(two_model_config([a], [b], upstream={"connect_timeout_s": 10.0, "read_timeout_s": 30.0,
                                                      "retries": 1},
                                  health={"interval_s": 0.1, "timeout_s": 5.0, "unhealthy_after": 3}))
    trace = _trace(tmp_path)
    report = replay(trace, gw.url, max_sessions=2, time_scale=0.0)
    assert report.failures == ()
    got = [(c.session_id, c.call_index, c.model, c.is_switch, c.num_prompt_tokens, c.num_output_tokens)
           for c in report.calls]
    want = [(s.session_id, i, c.model, i > 0 and c.model != s.calls[i - 1].model, p, c.output_tokens)
            for s in trace.sessions for i, (c, p) in enumerate(zip(s.calls, s.prompt_lengths()))]
    assert got == want
    # the engines saw token-id prompts that extend the session's context (a prefix the fake caches)
    routed = [body for _, body in a.requests + b.requests if body.get("vllm_xargs", {}).get("shadowprefill_kind")
              != "shadow" and body.get("priority", 0) == 0]
    s0 = [body["prompt"] for body in routed if body["prompt"][:5] == synthetic_ids("s0", 0, 5, 1000)]
    assert len(s0) == 3 and all(len(x) < len(y) and y[:len(x)] == x for x, y in itertools.pairwise(s0))
    assert report.summary()["calls"] == 12 and report.summary()["switch_calls"] == 6
    # the same file in the simulator: the same per-call routing and token counts
    from shadow_sim.experiments.runner import Task, run_task
    from shadow_sim.experiments.spec import Experiment

    from shadowcore.config import PluginRef

    models = {"a": "Qwen2.5-7B", "b": "Llama-3.1-70B"}
    ex = Experiment.from_dict({"instances_per_model": 1, "warmup_s": 5.0, "drain_s": 5.0,
                               "sessions": str(tmp_path / "calls.jsonl"), "session_models": models})
    rec = run_task(Task(ex, PluginRef("no-shadow"), 0, "peak", {"Qwen2.5-7B": 4.0, "Llama-3.1-70B": 2.0}))
    sim = sorted((c.session_id, c.call_index, c.model, c.is_switch, c.num_prompt_tokens) for c in rec.calls)
    assert sim == sorted((s, i, models[m], w, p) for s, i, m, w, p, _ in got)
    # the command: table, observed trace, exit status
    out = tmp_path / "observed.jsonl"
    assert replay_main(["--sessions", str(tmp_path / "calls.jsonl"), "--gateway", gw.url, "--time-scale", "0",
                        "--session-prefix", "again-", "--out", str(out)]) == 0
    assert "12 (6 switch calls)" in capsys.readouterr().out
    observed = read_session_trace(out)
    assert [s.prompt_lengths() for s in observed.sessions] == [s.prompt_lengths() for s in trace.sessions]
    assert all(c.latency_s is not None and c.cached_tokens is not None for s in observed.sessions for c in s.calls)


def test_a_failed_call_ends_its_session_and_is_reported(upstreams, gateway, tmp_path, capsys):
    (a,), (b,) = upstreams(1), upstreams(1)
    # no fault injected here: timeouts generous for a loaded 2-core machine (the defaults' 0.5 s connect and 2 s
    # read timed out, and ejected the instance, at load average 13)
    gw = gateway(two_model_config([a], [b], upstream={"connect_timeout_s": 10.0, "read_timeout_s": 30.0,
                                                      "retries": 1},
                                  health={"interval_s": 0.1, "timeout_s": 5.0, "unhealthy_after": 3}))
    trace = _trace(tmp_path)
    report = replay(trace, gw.url, model_map={"b": "no-such-model"}, time_scale=0.0)
    assert len(report.failures) == 3 and all("#1: status 4" in f for f in report.failures)
    assert sorted((c.session_id, c.call_index) for c in report.calls) == [("s0", 0), ("s1", 0), ("s2", 0)]
    assert replay_main(["--sessions", str(tmp_path / "calls.jsonl"), "--gateway", gw.url, "--time-scale", "0",
                        "--model-map", "b=no-such-model", "--json"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["failed_calls"] == 3 and "failed: s0#1" in captured.err
    assert replay_main(["--sessions", str(tmp_path / "calls.jsonl"), "--gateway", gw.url,
                        "--model-map", "b"]) == 2
