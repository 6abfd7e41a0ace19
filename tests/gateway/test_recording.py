"""Recording what the gateway serves as a session trace (shadow_gateway.recording),
against fake upstreams on loopback, and replaying the recording in the simulator."""

from __future__ import annotations

import json

import pytest
from shadow_gateway.config import from_dict
from shadow_gateway.fake_upstream import encode
from shadow_gateway.recording import RecordConfig, Recorder, block_hashes

from shadow_traces.session_trace import read_session_trace
from shadowcore.errors import ConfigError

from .conftest import two_model_config, wait_for


def _call(client, gw, session: str, model: str, prompt: str, *, stream: bool = False, task: str | None = None):
    headers = {"X-Session-Id": session, **({"X-Session-Task": task} if task else {})}
    body = {"model": model, "prompt": prompt, "max_tokens": 8}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
        r = client.post(gw.url + "/v1/completions", headers=headers, json=body)
        assert r.status_code == 200, r.text
        chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
        return "".join(c["choices"][0]["text"] for c in chunks if c["choices"]), chunks[-1]["usage"]
    r = client.post(gw.url + "/v1/completions", headers=headers, json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    return data["choices"][0]["text"], data["usage"]


def _session(client, gw, sid: str, models: list[str], *, stream: bool, task: str) -> list[tuple[str, dict]]:
    prompt, out = f"You are agent {sid}. Fix the bug in module {sid}. " * 3, []
    for k, model in enumerate(models):
        text, usage = _call(client, gw, sid, model, prompt, stream=stream, task=task)
        out.append((prompt, usage))
        prompt = prompt + text + f" Tool result {k}: ok."
    return out


def test_gateway_records_its_sessions_and_the_simulator_replays_them(upstreams, gateway, client, tmp_path):
    (a,), (b,) = upstreams(1), upstreams(1)
    path = tmp_path / "recorded.jsonl"
    gw = gateway(two_model_config([a], [b], record={"path": str(path)}))
    s1 = _session(client, gw, "s1", ["a", "b", "b"], stream=False, task="issue-1")
    s2 = _session(client, gw, "s2", ["b", "a"], stream=True, task="issue-2")
    _call(client, gw, "s1", "a", "A different conversation entirely.")  # does not extend s1's prompt
    wait_for(lambda: gw.gateway.recorder.num_recorded == 6, what="six recorded calls")
    trace = read_session_trace(path)  # the schema and every cross-line rule hold
    assert trace.header.source == "shadowprefill gateway"
    by_task = {s.task: s for s in trace.sessions}
    assert set(by_task) == {"issue-1", "issue-2"}
    for sid, calls in (("issue-1", s1), ("issue-2", s2)):
        rec = by_task[sid]
        assert [c.prompt_tokens for c in rec.calls[:len(calls)]] == [len(encode(p)) for p, _ in calls]
        assert [c.prompt_tokens for c in rec.calls[:len(calls)]] == [u["prompt_tokens"] for _, u in calls]
        assert [c.cached_tokens for c in rec.calls[:len(calls)]] == \
            [u["prompt_tokens_details"]["cached_tokens"] for _, u in calls]
        assert all(c.output_tokens == 8 for c in rec.calls)
        assert rec.calls[1].input_tokens == len(encode(calls[1][0])) - len(encode(calls[0][0])) - 8
        assert all(c.gap_s is not None and c.latency_s is not None for c in rec.calls[1:])
    assert by_task["issue-1"].models == ("a", "b", "b", "a") and by_task["issue-2"].models == ("b", "a")
    last = by_task["issue-1"].calls[3]
    assert (last.compact_to_tokens, last.input_tokens) == (len(encode("A different conversation entirely.")), 0)
    assert "does not extend" in last.metadata["compaction"]
    text = path.read_text()
    assert "You are agent" not in text and '"s1"' not in text and "token_ids" not in text  # not asked for
    # ... and the recording replays in the simulator, every call of it
    from shadow_sim.experiments.runner import Task, run_task
    from shadow_sim.experiments.spec import Experiment

    from shadowcore.config import PluginRef

    ex = Experiment.from_dict({"instances_per_model": 1, "warmup_s": 5.0, "drain_s": 5.0, "sessions": str(path),
                               "session_models": {"a": "Qwen2.5-7B", "b": "Llama-3.1-70B"}})
    rec = run_task(Task(ex, PluginRef("harvest-slo-host"), 0, "peak", {"Qwen2.5-7B": 4.0, "Llama-3.1-70B": 2.0}))
    assert len(rec.calls) == trace.num_calls == 6
    assert sorted(c.num_prompt_tokens for c in rec.calls) == \
        sorted(p for s in trace.sessions for p in s.prompt_lengths())


def test_recording_options_and_refusals(upstreams, gateway, client, tmp_path):
    (a,), (b,) = upstreams(1), upstreams(1)
    path = tmp_path / "full.jsonl"
    gw = gateway(two_model_config([a], [b], record={"path": str(path), "token_ids": True, "block_hashes": True,
                                                    "block_size": 16, "prompt_text": True,
                                                    "hash_session_ids": False}))
    calls = _session(client, gw, "s9", ["a", "b"], stream=False, task="t")
    wait_for(lambda: gw.gateway.recorder.num_recorded == 2, what="two recorded calls")
    (s,) = read_session_trace(path).sessions
    assert s.session_id == "s9-1"
    for c, (prompt, _) in zip(s.calls, calls):
        assert c.token_ids == tuple(encode(prompt))
        assert c.block_hashes == tuple(block_hashes(encode(prompt), 16))
        assert c.metadata["request"] == prompt
    # equal prefixes, equal hashes; a changed token changes its block and every later one
    h1, h2 = block_hashes(list(range(40)), 16), block_hashes([*range(20), 99, *range(21, 40)], 16)
    assert h1[0] == h2[0] and h1[1] != h2[1] and h1[2] != h2[2] and len(h1) == 3
    with pytest.raises(ConfigError, match="record.path.*exists"):
        Recorder(RecordConfig(str(path)), 0.0)
    with pytest.raises(ConfigError, match="record.block_size"):
        from_dict(two_model_config([a], [b], record={"path": str(tmp_path / "x.jsonl"), "block_size": 0}))
    with pytest.raises(ConfigError, match="record.colour"):
        from_dict(two_model_config([a], [b], record={"path": str(tmp_path / "x.jsonl"), "colour": "red"}))
