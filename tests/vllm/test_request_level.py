"""Request-level shadow prefill (Appendix D.1) on vLLM's real priority
scheduler in virtual time, and its admission rules as a state machine."""

from __future__ import annotations

import pytest
from shadow_gateway import request_level as rl
from shadow_vllm import virtual  # vLLM itself is imported lazily; conftest guards the folder
from shadow_vllm.backend import virtual_submitter

from shadowcore.events import EventLoop
from shadowcore.latency import LinearLatencyModel
from shadowcore.wire import parse_tag


class Recorder:
    """A submit port that records (the state-machine tests); the engine tests use real vLLM."""

    def __init__(self) -> None:
        self.sent = []

    def __call__(self, shadow) -> None:
        self.sent.append(shadow)


def _dest(i: str) -> rl.Destination:
    return rl.Destination(i, f"model-{i}")


def test_one_in_flight_per_instance_and_newer_calls_supersede_pending() -> None:
    sent, waiting = Recorder(), {"B": 0, "C": 0}
    sh = rl.RequestLevelShadower(sent, waiting.__getitem__)
    first = sh.on_call_complete("s1", [1, 2, 3], [4], [_dest("B")])
    assert [s.prompt_token_ids for s in first] == [(1, 2, 3, 4)]
    assert sh.inflight("B") is first[0]
    assert first[0].priority == rl.LOWEST_PRIORITY and first[0].max_tokens == 1
    assert parse_tag(first[0].extra_args).session_id == "s1"
    # B is busy: s2's shadow waits; s2's next call supersedes it; s3 queues behind
    assert sh.on_call_complete("s2", [5], [6], [_dest("B")]) == []
    sh.on_call_complete("s2", [5, 6, 7], [8], [_dest("B")])
    sh.on_call_complete("s3", [9], [10], [_dest("B")])
    assert [p.prompt_token_ids for p in sh.pending("B")] == [(5, 6, 7, 8), (9, 10)]
    assert sh.stats.num_superseded == 1
    nxt = sh.on_shadow_finished(first[0].submission_id)
    assert [s.session_id for s in nxt] == ["s3"]  # newest first
    sh.on_call_arrival("s2", "B")  # the routed call takes over: s2's pending shadow is dropped
    assert sh.pending("B") == () and sh.stats.num_dropped == 1
    assert sh.on_shadow_finished(nxt[0].submission_id) == []
    assert sh.stats.num_completed == 2 and len(sent.sent) == 2


def test_admission_only_when_the_destination_waiting_queue_is_empty() -> None:
    sent, waiting = Recorder(), {"B": 2}
    sh = rl.RequestLevelShadower(sent, waiting.__getitem__)
    assert sh.on_call_complete("s", [1], [2], [_dest("B")]) == []
    assert sh.stats.num_deferred == 1 and len(sh.pending("B")) == 1
    waiting["B"] = 0
    assert [s.session_id for s in sh.pump()] == ["s"]


def test_failures_never_raise_and_are_counted() -> None:
    def broken_submit(shadow) -> None:
        raise ConnectionError("instance down")

    def broken_probe(instance: str) -> int:
        raise TimeoutError("metrics timed out")

    sh = rl.RequestLevelShadower(broken_submit, lambda i: 0)
    assert sh.on_call_complete("s", [1], [2], [_dest("B")]) == []
    assert sh.stats.num_failed == 1 and sh.inflight("B") is None
    sh2 = rl.RequestLevelShadower(Recorder(), broken_probe)
    assert sh2.on_call_complete("s", [1], [2], [_dest("B")]) == []
    assert sh2.stats.num_failed == 1 and len(sh2.pending("B")) == 1
    sh3 = rl.RequestLevelShadower(Recorder(), lambda i: 1, max_pending_per_instance=2)
    for k in range(4):
        sh3.on_call_complete(f"s{k}", [k], [k], [_dest("B")])
    assert [p.session_id for p in sh3.pending("B")] == ["s2", "s3"] and sh3.stats.num_dropped == 2


def test_metrics_parsing_and_http_body() -> None:
    text = ('# HELP vllm:num_requests_waiting x\nvllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_waiting_by_reason{reason="a"} 9.0\n')
    assert rl.parse_num_waiting(text) == 3
    with pytest.raises(ValueError, match="http://b/metrics"):
        rl.parse_num_waiting("vllm:num_requests_running 1.0\n", "http://b/metrics")
    shadow = rl.ShadowSubmission("x", "s", _dest("B"), [1, 2, 3], 0)
    body = rl.completions_body(shadow, "served")
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 1 and body["priority"] == rl.LOWEST_PRIORITY
    assert parse_tag(body["vllm_xargs"]).target_model == "model-B"


def _pair():
    config = virtual.VirtualEngineConfig(num_blocks=512, max_num_batched_tokens=256, scheduling_policy="priority")
    loop = EventLoop()
    clock = virtual.VirtualClock()
    engines = {i: virtual.VirtualEngine(virtual.build_scheduler(None, config), LinearLatencyModel(), loop, clock,
                                        name=i) for i in ("A", "B")}
    holder = {}
    sh = rl.RequestLevelShadower(virtual_submitter(engines, lambda: holder["sh"]),
                                 lambda i: len(engines[i].scheduler.waiting))
    holder["sh"] = sh
    return loop, engines, sh


def test_switch_call_finds_the_request_level_shadow_cached_on_real_vllm() -> None:
    loop, engines, sh = _pair()
    prompt = list(range(10, 410))  # 400 tokens
    call = engines["A"].add_request("s#0", prompt, 20, on_finish=lambda r: sh.on_call_complete(
        "s", r.prompt_token_ids, r.output_token_ids, [_dest("B")]))
    loop.run()
    assert sh.stats.num_submitted == 1 and sh.stats.num_completed == 1
    shadow_req = next(r for rid, r in engines["B"].requests.items() if rid.startswith("shadow-"))
    assert len(shadow_req.output_token_ids) == 1  # one output token
    context = [*prompt, *call.output_token_ids]
    switch = engines["B"].add_request("s#1", [*context, 7, 8, 9], 5)
    loop.run()
    assert switch.num_cached_tokens == len(context) // 16 * 16  # every whole block of prompt + response
    cold = engines["A"].add_request("cold", [3] * 419 + [4, 5, 6], 1)
    loop.run()
    assert cold.num_cached_tokens == 0


def test_stock_priority_runs_routed_before_a_waiting_shadow_but_not_before_a_running_one() -> None:
    """The flaw the engine-level scheduler fixes: stock vLLM never preempts a
    running low-priority prefill for a routed call's budget."""
    loop, engines, _ = _pair()
    b = engines["B"]
    b.add_request("busy", [13] * 40, 1)  # an iteration is running: the next two arrivals both wait
    b.add_request("shadow-long", [11] * 3000, 1, priority=rl.LOWEST_PRIORITY)
    b.add_request("routed", [12] * 100, 1)
    loop.run()
    first = next(s for s in b.steps if any(r.request_id == "routed" for r in s.batch))
    # both waited: priority puts the routed call first ...
    assert first.iteration == 1 and first.batch[0].request_id == "routed"
    loop2, engines2, _ = _pair()
    b2 = engines2["B"]
    b2.add_request("shadow-long", [11] * 3000, 1, priority=rl.LOWEST_PRIORITY)
    loop2.run(until_s=0.02)  # the shadow is running (chunked prefill)
    late = b2.add_request("routed", [12] * 100, 1)
    loop2.run()
    late_step = next(s for s in b2.steps if any(r.request_id == "routed" for r in s.batch))
    # ... but once the shadow runs it keeps the whole token budget: the routed
    # prefill starts only with the shadow's last chunk (here ~8 steps later)
    between = [s for s in b2.steps if late.arrival_s <= s.start_s < late_step.start_s]
    assert len(between) >= 5
    assert all([(r.request_id, r.num_scheduled_tokens) for r in s.batch] == [("shadow-long", 256)] for s in between)
    assert late_step.batch[0].request_id == "shadow-long"
    assert late_step.start_s + late_step.duration_s >= b2.requests["shadow-long"].finish_s
    assert late.ttft_s > 5 * (late_step.duration_s + b2.steps[-1].duration_s)
