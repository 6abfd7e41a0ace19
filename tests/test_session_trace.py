"""The session-trace format (shadow_traces.session_trace), its loaders
(SWE-agent, Copilot, CSV), and ``shadowprefill sessions`` (convert, stats)."""

from __future__ import annotations

import json
import math
import sys
import tomllib
from pathlib import Path

import pytest

from shadow_traces import session_trace as st
from shadow_traces.agent_loaders import load_call_csv, load_copilot_sessions, load_swe_agent
from shadow_traces.command import main as sessions_main
from shadow_traces.command import trace_stats
from shadow_traces.session_trace import (
    SessionTrace,
    TraceCall,
    TraceHeader,
    TraceSession,
    from_agent_sessions,
    model_map,
    read_session_trace,
    write_session_trace,
)
from shadowcore.errors import ConfigError
from shadowcore.workloads.sessions import TABLE1, generate, get_preset, session_stats
from shadowcore.workloads.traces import TraceError

ROOT = Path(__file__).resolve().parents[1]
HEADER = {"format": "shadowprefill-session-trace", "version": 1}


def lines(path: Path, *records: dict, header: dict | None = None) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in ((header or HEADER), *records)) + "\n")
    return path


def call(session: str = "a", index: int = 0, **fields) -> dict:
    base = {"session": session, "call": index, "input_tokens": 10, "output_tokens": 5}
    if index == 0:
        base["arrival_s"] = 1.0
    else:
        base["gap_s"] = 0.5
    base.update(fields)
    return {k: v for k, v in base.items() if v is not None}


# -- format -----------------------------------------------------------------------------------------


def test_round_trip_keeps_every_field(tmp_path: Path) -> None:
    c0 = TraceCall(8, 3, "m1", arrival_s=2.5, latency_s=1.25, prompt_tokens=8, cached_tokens=4,
                   token_ids=tuple(range(8)), block_hashes=(7, 9), metadata={"k": [1, "x"]})
    c1 = TraceCall(2, 1, "m2", arrival_s=4.0, gap_s=0.25, compact_to_tokens=5, prompt_tokens=7)
    trace = SessionTrace(TraceHeader(block_size=4, tokenizer="chars/4", source="test", metadata={"a": 1}),
                         (TraceSession("s0", (c0, c1), "task-1"), TraceSession("s1", (TraceCall(1, 1, arrival_s=3.0),))))
    path = tmp_path / "t.jsonl"
    write_session_trace(trace, path)
    assert read_session_trace(path) == trace
    assert json.loads(path.read_text().splitlines()[0]) == {**HEADER, "block_size": 4, "tokenizer": "chars/4",
                                                             "source": "test", "metadata": {"a": 1}}


def test_preset_sessions_survive_the_file_exactly(tmp_path: Path) -> None:
    sessions = generate(get_preset("ghcp-coding"), math.inf, 3, max_sessions=60)  # compacts sometimes
    assert any(s.num_compactions for s in sessions)
    path = tmp_path / "p.jsonl"
    write_session_trace(from_agent_sessions(sessions), path)
    back = read_session_trace(path).agent_sessions()
    # the tool result joins the new input; everything else is the same session
    assert [s.prompt_lengths() for s in back] == [s.prompt_lengths() for s in sessions]
    assert [(s.models, s.tool_gaps_s, s.arrival_s, s.task, s.session_id) for s in back] == \
        [(s.models, s.tool_gaps_s, s.arrival_s, s.task, s.session_id) for s in sessions]
    assert session_stats(back) == session_stats(sessions)


def test_gap_from_arrival_and_latency_and_session_order(tmp_path: Path) -> None:
    path = lines(tmp_path / "t.jsonl",
                 call("late", 0, arrival_s=5.0, latency_s=2.0),
                 call("early", 0, arrival_s=1.0),
                 call("late", 1, gap_s=None, arrival_s=7.75))
    t = read_session_trace(path)
    assert [s.session_id for s in t.sessions] == ["early", "late"]
    assert t.sessions[1].calls[1].gap_s == pytest.approx(0.75)


BAD = [
    (call(arrival_s=None), "arrival_s", "first call"),
    (call(input_tokens=1.0), "input_tokens", "integer"),
    (call(output_tokens=-1), "output_tokens", "minimum"),
    (call(arrival_s=-0.5), "arrival_s", "minimum"),
    (call(extra=1), "extra", "unknown field"),
    (call(input_tokens=None), "input_tokens", "missing field"),
    (call(model=""), "model", "non-empty"),
    (call(prompt_tokens=11), "prompt_tokens", "must equal context + input_tokens = 10"),
    (call(cached_tokens=11), "cached_tokens", "exceeds the prompt"),
    (call(token_ids=[1, 2]), "token_ids", "one id per prompt token"),
    (call(block_hashes=[1]), "block_hashes", "needs block_size"),
    (call(compact_to_tokens=3), "compact_to_tokens", "no context to compact"),
    (call(metadata=[]), "metadata", "object"),
    ([1, 2], "$", "object"),
]


@pytest.mark.parametrize(("record", "field", "problem"), BAD)
def test_bad_lines_name_file_line_field(tmp_path: Path, record, field, problem) -> None:
    path = lines(tmp_path / "bad.jsonl", call("ok", 0), record)
    with pytest.raises(TraceError) as info:
        read_session_trace(path)
    e = info.value
    assert (e.path, e.line, e.column) == (str(path), 3, field), str(e)
    assert problem in e.problem, str(e)
    assert str(e).startswith(f"{path}:3:{field}: ")


BAD_LATER = [
    (call(index=2), "call", "expected call 1"),
    (call(index=1, gap_s=None), "gap_s", "needs gap_s"),
    (call(index=1, gap_s=None, arrival_s=1.5), "gap_s", "needs gap_s"),  # no latency_s before
    (call(index=1, prompt_tokens=25), "prompt_tokens", "= 25"),  # 10 + 5 + 10: fine ...
    (call(index=1, task="other"), "task", "has task 'T'"),
]


@pytest.mark.parametrize(("record", "field", "problem"), BAD_LATER)
def test_cross_line_rules(tmp_path: Path, record, field, problem) -> None:
    path = lines(tmp_path / "bad.jsonl", call("a", 0, task="T"), record)
    if field == "prompt_tokens":  # the consistent prompt reads; one token off does not
        read_session_trace(path)
        path = lines(tmp_path / "bad.jsonl", call("a", 0, task="T"), {**record, "prompt_tokens": 26})
        problem = "= 25"
    with pytest.raises(TraceError) as info:
        read_session_trace(path)
    assert (info.value.line, info.value.column) == (3, field), str(info.value)
    assert problem in info.value.problem


def test_negative_derived_gap_and_nan_and_header(tmp_path: Path) -> None:
    p = lines(tmp_path / "t.jsonl", call("a", 0, arrival_s=1.0, latency_s=2.0), call("a", 1, gap_s=None,
                                                                                     arrival_s=2.0))
    with pytest.raises(TraceError, match=r"t.jsonl:3:arrival_s: arrives 1 s before the previous call ended"):
        read_session_trace(p)
    p.write_text(json.dumps(HEADER) + '\n{"session": "a", "call": 0, "arrival_s": NaN, "input_tokens": 1, '
                 '"output_tokens": 1}\n')
    with pytest.raises(TraceError, match="NaN is not a JSON number"):
        read_session_trace(p)
    p = lines(tmp_path / "h.jsonl", call(), header={"format": "something-else", "version": 1})
    with pytest.raises(TraceError, match=r"h.jsonl:1:format: not a session trace"):
        read_session_trace(p)
    p = lines(tmp_path / "v.jsonl", call(), header={**HEADER, "version": 2})
    with pytest.raises(TraceError, match=r"v.jsonl:1:version"):
        read_session_trace(p)
    p = lines(tmp_path / "e.jsonl")
    with pytest.raises(TraceError, match="no calls"):
        read_session_trace(p)
    (tmp_path / "blank.jsonl").write_text(json.dumps(HEADER) + "\n\n" + json.dumps(call()) + "\n")
    with pytest.raises(TraceError, match=r"blank.jsonl:2:1: blank line"):
        read_session_trace(tmp_path / "blank.jsonl")


def test_block_hashes_count_partial_last_block(tmp_path: Path) -> None:
    header = {**HEADER, "block_size": 4}
    read_session_trace(lines(tmp_path / "ok.jsonl", call(block_hashes=[1, 2, 3]), header=header))  # 10 tokens
    with pytest.raises(TraceError, match="needs one hash per 4-token block of the prompt \\(3\\)"):
        read_session_trace(lines(tmp_path / "no.jsonl", call(block_hashes=[1, 2]), header=header))


def test_schema_ships_in_the_package_and_is_declared() -> None:
    schema = st.schema()
    assert set(schema["$defs"]) >= {"header", "call"}
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "*.schema.json" in data["tool"]["setuptools"]["package-data"]["shadow_traces"]
    assert data["project"]["entry-points"]["shadowprefill.commands"]["sessions"] == "shadow_traces.command:main"
    assert any(d.startswith("jsonschema") for d in data["project"]["optional-dependencies"]["traces"])


def test_without_jsonschema_reading_says_what_to_install(tmp_path: Path, monkeypatch) -> None:
    path = lines(tmp_path / "t.jsonl", call())
    st._validators.cache_clear()
    monkeypatch.setitem(sys.modules, "jsonschema", None)
    try:
        with pytest.raises(ConfigError, match=r"needs jsonschema: pip install 'shadowprefill\[traces\]'"):
            read_session_trace(path)
    finally:
        st._validators.cache_clear()


def test_model_map() -> None:
    assert model_map(["gpt-4o", "b"], ["b", "c"]) == {"b": "b", "gpt-4o": "c"}
    assert model_map(["x", "y"], ["b", "c"], {"y": "b"}) == {"y": "b", "x": "c"}
    with pytest.raises(ConfigError, match="the trace has 3 models but the run has 2"):
        model_map(["x", "y", "z"], ["b", "c"])
    with pytest.raises(ConfigError, match="not among"):
        model_map(["x"], ["b"], {"x": "q"})


# -- SWE-agent ----------------------------------------------------------------------------------------


def traj(steps: int = 3, timed: bool = True) -> dict:
    """A trajectory in SWE-agent's ``.traj`` shape (history with role/content/tool_calls)."""
    history = [
        {"role": "system", "content": "You are a helpful assistant." * 4, "agent": "main",
         "message_type": "system_prompt"},
        {"role": "user", "content": [{"type": "text", "text": "<uploaded_files>/repo</uploaded_files> Fix bug."}],
         "agent": "main", "message_type": "observation"},
    ]
    trajectory = []
    for k in range(steps):
        args = json.dumps({"command": f"grep -n foo{k} src/*.py"})
        history.append({"role": "assistant", "content": f"Let me look at step {k}.", "agent": "main",
                        "message_type": "action", "thought": f"step {k}", "action": f"grep foo{k}",
                        "tool_calls": [{"id": f"call_{k}", "type": "function",
                                        "function": {"name": "bash", "arguments": args}}]})
        history.append({"role": "tool", "content": [{"type": "text", "text": "OBSERVATION:\n" + "x" * (37 * k)}],
                        "agent": "main", "message_type": "observation", "tool_call_ids": [f"call_{k}"]})
        trajectory.append({"action": f"grep foo{k}", "observation": "...", "response": "...", "thought": "...",
                           "state": {}, "execution_time": 0.5 + k} if timed else {"action": "a"})
    return {"trajectory": trajectory, "history": history,
            "info": {"exit_status": "submitted", "submission": "diff",
                     "model_stats": {"instance_cost": 0.1, "tokens_sent": 1234, "tokens_received": 56,
                                     "api_calls": steps}},
            "replay_config": json.dumps({"agent": {"model": {"name": "gpt-4o"}}}), "environment": "swe_main"}


def expected_swe(doc: dict) -> list[tuple[int, int]]:
    """(input, output) per call with ceil(chars / 4) per message, written out independently."""
    out, pending = [], 0
    for m in doc["history"]:
        c = m["content"]
        text = c if isinstance(c, str) else "".join(p["text"] for p in c)
        if m["role"] == "assistant":
            text += "".join(t["function"]["name"] + t["function"]["arguments"] for t in m["tool_calls"])
            out.append((pending, -(-len(text) // 4)))
            pending = 0
        else:
            pending += -(-len(text) // 4)
    return out


def test_swe_agent_trajectory(tmp_path: Path) -> None:
    doc = traj(3)
    (tmp_path / "django-1.traj").write_text(json.dumps(doc))
    (tmp_path / "django-2.traj").write_text(json.dumps(traj(2, timed=False)))
    trace, notes = load_swe_agent([tmp_path / "django-1.traj", tmp_path / "django-2.traj"], session_interval_s=30)
    a, b = trace.sessions
    assert (a.session_id, a.task, a.arrival_s, b.arrival_s) == ("django-1", "django-1", 0.0, 30.0)
    assert [(c.input_tokens, c.output_tokens) for c in a.calls] == expected_swe(doc)
    assert [c.gap_s for c in a.calls] == [None, 0.5, 1.5]  # execution_time of the step before
    assert [c.gap_s for c in b.calls] == [None, 2.0]  # the default, and a note says so
    assert {c.model for c in a.calls} == {"gpt-4o"}
    assert trace.header.tokenizer == "chars/4"
    assert any("token counts: chars/4 (estimate" in n for n in notes)
    assert any("django-2.traj: no per-step execution_time" in n for n in notes)
    assert any("tokens after the last assistant message" in n for n in notes)  # the last observation
    out = tmp_path / "out.jsonl"
    write_session_trace(trace, out)
    assert read_session_trace(out) == trace  # prompts are consistent by construction


def test_swe_agent_with_a_local_tokenizer(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = tokenizers.Tokenizer(WordLevel({"[UNK]": 0, "step": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    doc = {"history": [{"role": "user", "content": "fix the bug now"},
                       {"role": "assistant", "content": "ok then", "tool_calls": []},
                       {"role": "tool", "content": "a b c"},
                       {"role": "assistant", "content": "done"}]}
    (tmp_path / "t.traj").write_text(json.dumps(doc))
    trace, _notes = load_swe_agent([tmp_path / "t.traj"], tokenizer=str(tmp_path), model="m")
    assert [(c.input_tokens, c.output_tokens) for c in trace.sessions[0].calls] == [(4, 2), (3, 1)]
    assert trace.header.tokenizer == str(tmp_path)
    with pytest.raises(ConfigError, match="no such file"):
        load_swe_agent([tmp_path / "t.traj"], tokenizer=str(tmp_path / "missing"))


def test_swe_agent_errors(tmp_path: Path) -> None:
    (tmp_path / "x.traj").write_text(json.dumps({"trajectory": []}))
    with pytest.raises(TraceError, match="no 'history' list"):
        load_swe_agent([tmp_path / "x.traj"])
    (tmp_path / "y.traj").write_text(json.dumps({"history": [{"role": "user", "content": "hi"}]}))
    with pytest.raises(TraceError, match="no assistant message"):
        load_swe_agent([tmp_path / "y.traj"])
    (tmp_path / "z.traj").write_text(json.dumps({"history": [{"role": "user", "content": 5}]}))
    with pytest.raises(TraceError, match=r"z.traj:0:history\[0\].content"):
        load_swe_agent([tmp_path / "z.traj"])


# -- Copilot and CSV ----------------------------------------------------------------------------------


def copilot_session(sid: str, calls: list[tuple[str, str, int, int, int]]) -> dict:
    return {"session_id": sid, "date": "2026-06-01", "turns": [{"turn_id": 0, "llm_calls": [
        {"timestamp": ts, "model": m, "tokens": {"prompt": p, "completion": c, "cached": k, "total": p + c}}
        for ts, m, p, c, k in calls]}]}


def test_copilot_sessions(tmp_path: Path) -> None:
    path = tmp_path / "shard-0000.jsonl"
    path.write_text("\n".join(json.dumps(s) for s in [
        copilot_session("A", [("2026-06-01T00:00:00Z", "gpt-5", 1000, 50, 0),
                              ("2026-06-01T00:00:04Z", "claude", 1200, 30, 512),
                              ("2026-06-01T00:00:09Z", "claude", 900, 10, 0)]),  # shorter: compaction
        copilot_session("B", [("2026-06-01T00:00:02Z", "gpt-5", 300, 20, 0)]),
    ]) + "\n")
    trace, notes = load_copilot_sessions(path)
    a = next(s for s in trace.sessions if s.session_id == "A")
    assert [(c.input_tokens, c.compact_to_tokens, c.model, c.cached_tokens) for c in a.calls] == \
        [(1000, None, "gpt-5", 0), (150, None, "claude", 512), (0, 900, "claude", 0)]
    assert a.prompt_lengths() == (1000, 1200, 900)
    assert [c.gap_s for c in a.calls] == [None, 4.0, 5.0]
    assert any("start-to-start" in n for n in notes) and any("1 calls have a prompt shorter" in n for n in notes)
    out = tmp_path / "c.jsonl"
    write_session_trace(trace, out)
    assert read_session_trace(out) == trace


def test_call_csv(tmp_path: Path) -> None:
    path = tmp_path / "calls.csv"
    path.write_text("session_id,call_index,model,arrival_s,gap_s,input_tokens,output_tokens,cached_tokens\n"
                    "s1,0,big,0.5,,100,10,\n"
                    "s1,1,small,,1.5,20,5,64\n"
                    "s2,0,small,0.25,,30,3,0\n")
    trace, _ = load_call_csv(path)
    assert [s.session_id for s in trace.sessions] == ["s2", "s1"]
    assert trace.sessions[1].models == ("big", "small") and trace.sessions[1].calls[1].cached_tokens == 64
    path.write_text("session_id,call_index,input_tokens,output_tokens\ns1,0,x,1\n")
    with pytest.raises(TraceError, match=r"calls.csv:2:input_tokens: not an integer"):
        load_call_csv(path)
    path.write_text("session_id,call_index,input_tokens,output_tokens,arrival_s\ns1,0,1,1,0\ns1,1,1,1,\n")
    with pytest.raises(TraceError, match=r"calls.csv:3:gap_s: a later call needs gap_s"):
        load_call_csv(path)
    path.write_text("session_id,call_index,input_tokens,tokens_out\n")
    with pytest.raises(TraceError, match="missing output_tokens"):
        load_call_csv(path)


# -- stats and the command ------------------------------------------------------------------------------


def test_ideal_cache_hit_rates_by_hand() -> None:
    # one session: A(100 in, 25 out) -> B(+10) -> A(+10) -> compact to 50, A(+10); block size 10
    calls = (TraceCall(100, 25, "A", arrival_s=0.0), TraceCall(10, 5, "B", gap_s=1.0),
             TraceCall(10, 5, "A", gap_s=1.0), TraceCall(10, 5, "A", gap_s=1.0, compact_to_tokens=50))
    s = TraceSession("s", calls)
    assert s.prompt_lengths() == (100, 135, 150, 60)
    stats = trace_stats(SessionTrace(TraceHeader(), (s,)), block_size=10)
    # cached: 0; B never served: 0; A served 125 of its 150 -> 120 (whole blocks); after the compaction 0
    assert stats.ideal_hit_rate == pytest.approx(120 / (100 + 135 + 150 + 60))
    assert stats.ideal_switch_hit_rate == pytest.approx(120 / (135 + 150))
    assert (stats.num_switch_calls, stats.compactions_per_session, stats.observed_hit_rate) == (2, 1.0, None)


@pytest.mark.parametrize("name", sorted(TABLE1))
def test_sessions_stats_of_an_exported_preset_are_the_generators(name: str, tmp_path: Path, capsys) -> None:
    """Exact: the file carries every statistic the generator's sessions have (the
    generator's fit to Table 1 at 2,000 sessions is tests/test_sessions.py's, and the
    fitted size through the command is the next test's)."""
    out = tmp_path / f"{name}.jsonl"
    assert sessions_main(["convert", "--from", "preset", name, "--num-sessions", "300", "-o", str(out)]) == 0
    assert sessions_main(["stats", str(out), "--json"]) == 0
    got = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    want = session_stats(generate(get_preset(name), math.inf, 0, max_sessions=300))
    assert (got["num_calls"], got["switch_rate"], got["switches_per_session"], got["mean_prompt"],
            got["p99_prompt"], got["compactions_per_session"]) == \
        (want.num_calls, want.switch_rate, want.switches_per_session, want.mean_prompt, want.p99_prompt,
         want.compactions_per_session)
    assert sessions_main(["stats", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"Table 1 {name}: {TABLE1[name].switch_rate:.1%}" in text


def test_sessions_stats_reproduce_table1_at_the_fitted_size(tmp_path: Path, capsys) -> None:
    from tests.test_sessions import MEAN_PROMPT_REL, P99_PROMPT_REL, SWITCH_RATE_POINTS, SWITCHES_PER_SESSION_REL

    out = tmp_path / "fusionbench.jsonl"
    assert sessions_main(["convert", "--from", "preset", "fusionbench", "-o", str(out)]) == 0  # 2,000
    assert sessions_main(["stats", str(out), "--json"]) == 0
    got = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    t = TABLE1["fusionbench"]
    assert got["num_sessions"] == 2000
    assert abs(got["switch_rate"] - t.switch_rate) <= SWITCH_RATE_POINTS
    assert abs(got["switches_per_session"] / t.switches_per_session - 1) <= SWITCHES_PER_SESSION_REL
    assert abs(got["mean_prompt"] / t.mean_prompt - 1) <= MEAN_PROMPT_REL
    assert abs(got["p99_prompt"] / t.p99_prompt - 1) <= P99_PROMPT_REL


def test_sessions_command_errors(tmp_path: Path, capsys) -> None:
    assert sessions_main(["stats", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    (tmp_path / "a.traj").write_text(json.dumps(traj(2)))
    out = tmp_path / "a.jsonl"
    assert sessions_main(["convert", "--from", "swe-agent", str(tmp_path / "a.traj"), "-o", str(out)]) == 0
    captured = capsys.readouterr()
    assert "2 calls" in captured.out and "chars/4" in captured.err
    assert sessions_main(["convert", "--from", "preset", "nope", "-o", str(out)]) == 2


def test_swe_agent_prompts_from_the_steps_query(tmp_path: Path) -> None:
    """SWE-agent >= 1.1 stores every message shown to the LM per step ('query'): those are the prompts;
    a query that changes an earlier message (a history processor elided it) is recorded as a compaction."""
    doc = traj(3)
    history, steps = doc["history"], doc["trajectory"]
    assistant = [k for k, m in enumerate(history) if m["role"] == "assistant"]
    for step, k in zip(steps, assistant):
        step["query"] = json.loads(json.dumps(history[:k]))
    steps[2]["query"][3]["content"] = [{"type": "text", "text": "(omitted)"}]  # observation 0 elided
    steps[1]["query"][3]["content"] = [{"type": "text", "text": "OBSERVATION:\n" + "y" * 20}]  # the newest: fine
    (tmp_path / "q.traj").write_text(json.dumps(doc))
    trace, notes = load_swe_agent([tmp_path / "q.traj"])
    (s,) = trace.sessions
    sizes = [sum(-(-len(m["content"] if isinstance(m["content"], str) else "".join(p["text"] for p in m["content"]))
                 // 4) if m["role"] != "assistant" else expected_swe({"history": [m]})[0][1]
                 for m in st["query"]) for st in steps]
    assert s.prompt_lengths() == tuple(sizes)
    assert [c.compact_to_tokens for c in s.calls] == [None, None, sizes[2]]
    assert any("1 calls' queries rewrite earlier messages" in n for n in notes)
    write_session_trace(trace, tmp_path / "q.jsonl")
    assert read_session_trace(tmp_path / "q.jsonl") == trace
