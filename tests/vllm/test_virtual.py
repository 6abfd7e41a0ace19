"""Virtual-time mode: vLLM's real scheduler and KV cache manager on a virtual
clock, with iteration times from a latency model (no model, no GPU)."""

from __future__ import annotations

import pytest
from shadow_vllm import virtual  # vLLM itself is imported lazily; conftest guards the folder

from shadowcore.latency import BatchShape, LinearLatencyModel, PrefillChunk


def _engine(**limits):
    config = virtual.VirtualEngineConfig(**{"num_blocks": 256, "max_num_batched_tokens": 256, **limits})
    return virtual.VirtualEngine(virtual.build_scheduler(None, config), LinearLatencyModel())


def test_chunked_prefill_and_decode_follow_vllm_and_the_latency_model() -> None:
    eng = _engine()
    latency = LinearLatencyModel()
    done = []
    eng.add_request("a", list(range(10, 610)), 3, on_finish=done.append)
    eng.loop.run()
    (a,) = done
    chunks = [(r.num_scheduled_tokens, r.num_context_tokens, r.is_decode) for s in eng.steps for r in s.batch]
    # 600 prompt tokens in 256-token chunks, then two decodes (the first token comes with the last chunk)
    assert chunks == [(256, 0, False), (256, 256, False), (88, 512, False), (1, 600, True), (1, 601, True)]
    expected = [
        latency.predict_s(BatchShape((PrefillChunk(256, 0),))),
        latency.predict_s(BatchShape((PrefillChunk(256, 256),))),
        latency.predict_s(BatchShape((PrefillChunk(88, 512),))),
        latency.predict_s(BatchShape((), (600,))),
        latency.predict_s(BatchShape((), (601,))),
    ]
    assert [s.duration_s for s in eng.steps] == pytest.approx(expected)
    for prev, nxt in zip(eng.steps, eng.steps[1:], strict=False):  # back-to-back iterations on the virtual clock
        assert nxt.start_s == pytest.approx(prev.start_s + prev.duration_s)
    assert a.first_token_s == pytest.approx(sum(expected[:3]))
    assert a.finish_s == pytest.approx(sum(expected))
    assert len(a.output_token_ids) == 3 and a.finish_reason == "length"
    assert a.output_token_ids == [virtual.hashed_token("a", i) for i in range(3)]


def test_prefix_cache_hits_are_vllms_block_aligned_ones() -> None:
    eng = _engine()
    prompt = list(range(10, 330))  # 320 tokens = 20 blocks of 16
    first = eng.add_request("first", prompt, 1)
    eng.loop.run()
    assert first.num_cached_tokens == 0
    assert eng.cached_prefix_tokens(prompt) == 320
    again = eng.add_request("again", prompt, 1)  # the same prompt: at most num_tokens - 1, block aligned
    longer = eng.add_request("longer", [*prompt, 5, 6, 7], 1)
    eng.loop.run()
    assert again.num_cached_tokens == 304
    assert longer.num_cached_tokens == 320
    assert eng.cached_prefix_tokens([*prompt[:100], 9999 % 1000]) == 96


def test_arrivals_at_virtual_times_and_waiting_while_the_budget_is_full() -> None:
    eng = _engine(max_num_seqs=2)
    handles = {}
    for k, t in enumerate((0.0, 0.001, 0.002)):
        eng.loop.at(t, virtual.ARRIVAL, lambda now, k=k: handles.setdefault(
            k, eng.add_request(f"r{k}", [100 + k] * 40, 4)))
    eng.loop.run()
    assert [handles[k].arrival_s for k in range(3)] == [0.0, 0.001, 0.002]
    assert eng.scheduler.requests == {}  # all finished and freed
    # max_num_seqs=2: the third request waits until one of the first two finishes
    third_first_step = next(s for s in eng.steps if any(r.request_id == "r2" for r in s.batch))
    assert third_first_step.start_s >= min(handles[0].finish_s, handles[1].finish_s)
    assert any(s.num_waiting == 1 for s in eng.steps)


def test_stock_scheduler_preempts_under_kv_pressure() -> None:
    eng = _engine(num_blocks=24, max_num_batched_tokens=512)  # 24 blocks of 16 = 384 tokens
    for k in range(3):
        eng.add_request(f"r{k}", [10 + k] * 120, 60)
    eng.loop.run()
    assert any(s.preempted for s in eng.steps)
    assert all(eng.requests[f"r{k}"].finish_reason == "length" for k in range(3))


def test_async_scheduler_runs_in_virtual_time_too() -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    config = virtual.VirtualEngineConfig(num_blocks=256, max_num_batched_tokens=256)
    eng = virtual.VirtualEngine(virtual.build_scheduler(AsyncScheduler, config), LinearLatencyModel())
    sync = _engine()
    for e in (eng, sync):
        e.add_request("a", list(range(10, 610)), 3)
        e.loop.run()
    assert eng.requests["a"].output_token_ids == sync.requests["a"].output_token_ids
    assert [s.num_tokens for s in eng.steps] == [s.num_tokens for s in sync.steps]


def test_bad_inputs_fail_with_the_field_named() -> None:
    from shadowcore.errors import ConfigError

    with pytest.raises(ValueError, match="scheduling_policy"):
        virtual.VirtualEngineConfig(scheduling_policy="lifo")
    with pytest.raises(ConfigError, match="scheduler_cls"):
        virtual.check_scheduler_cls("shadow_vllm.nope.Scheduler")
    eng = _engine()
    with pytest.raises(ValueError, match="prompt_token_ids"):
        eng.add_request("x", [], 1)
    eng.add_request("x", [1, 2, 3], 1)
    with pytest.raises(ValueError, match="request_id = 'x'"):
        eng.add_request("x", [1, 2, 3], 1)


class _CountPlans:
    """An observer: makes the hook plan every step (the engines' _fastpath.can_skip is False with one)."""

    def __init__(self) -> None:
        self.num_plans = 0

    def on_plan(self, snapshot, plan) -> None:
        self.num_plans += 1


@pytest.mark.parametrize("policy", ["harvest-slo", "harvest"])
def test_no_shadow_fast_path_decides_as_the_planned_path(policy: str) -> None:
    """With no shadow request the scheduler skips the snapshot and plan
    (the engines' ``_fastpath.skip_step``); the controller's credit, and so every later
    decision, is what planning every step gives: a decode-heavy phase, then a
    shadow and a routed call, on two engines that differ only in an observer."""
    from shadow_vllm.engine_config import engine_args
    from shadow_vllm.scheduler import ShadowScheduler

    from shadowcore.wire import ShadowTag, TagKind

    def run(observed: bool):
        extra = engine_args(policy, slo={"ttft_s": 1.0, "tpot_s": 0.05})["additional_config"]
        config = virtual.VirtualEngineConfig(num_blocks=256, max_num_batched_tokens=256, additional_config=extra)
        eng = virtual.VirtualEngine(virtual.build_scheduler(ShadowScheduler, config), LinearLatencyModel())
        scheduler = eng.scheduler
        counter = _CountPlans()
        if observed:
            scheduler.shadow_hook.observers.add(counter)
        snapshots = []
        build = scheduler._shadow_snapshot
        scheduler._shadow_snapshot = lambda *a: snapshots.append(a) or build(*a)
        for k in range(6):  # two routed calls, shorter: decode-only steps with and without one (the credit's)
            routed = {"extra_args": ShadowTag(TagKind.ROUTED, f"s{k}").to_extra_args()} if k < 2 else {}
            eng.add_request_at(0.002 * k, f"n{k}", [10 + k] * (40 + 30 * k), 12 if k < 2 else 24, **routed)
        eng.loop.run()
        phase1 = (len(eng.steps), len(snapshots), counter.num_plans, scheduler.shadow_hook.slack.credit.balance_s)
        eng.add_request("shadow", [7 + i % 300 for i in range(900)], 1,
                        extra_args=ShadowTag(TagKind.SHADOW, "s", "m", 0, 0.9).to_extra_args())
        eng.add_request("n-late", [500 + i % 50 for i in range(70)], 30)
        eng.add_request_at(eng.loop.now_s + 0.02, "routed", [300 + i % 90 for i in range(120)], 8,
                           extra_args=ShadowTag(TagKind.ROUTED, "s").to_extra_args())
        eng.loop.run()
        steps = [(s.start_s, s.duration_s, tuple((r.request_id, r.num_scheduled_tokens) for r in s.batch))
                 for s in eng.steps]
        return phase1, steps, scheduler.shadow_stats, scheduler.shadow_hook.slack.credit

    (fast_steps, fast_snaps, _, fast_credit), fast_all, fast_stats, fast_end = run(observed=False)
    (slow_steps, slow_snaps, slow_plans, slow_credit), slow_all, slow_stats, slow_end = run(observed=True)
    assert fast_steps == slow_steps > 20
    assert fast_snaps == 0 and slow_snaps == slow_plans >= slow_steps  # the fast path built nothing (the slow
    # one plans empty iterations too)
    assert fast_credit == slow_credit > 0  # decode-only steps earned the same credit, bit for bit
    assert fast_all == slow_all  # every later step: same time, batch and shadow chunks
    assert fast_stats == slow_stats and fast_stats.num_shadow_tokens > 0
    assert (fast_end.balance_s, fast_end.earned_s, fast_end.spent_s) == (slow_end.balance_s, slow_end.earned_s,
                                                                         slow_end.spent_s)


def test_no_shadow_fast_path_under_preemption() -> None:
    """Preempted requests are recomputed in prefill chunks after their first
    token; the fast path's decode-only test must see those steps as prefills
    (no credit), exactly as the planned path does."""
    from shadow_vllm.engine_config import engine_args
    from shadow_vllm.scheduler import ShadowScheduler

    from shadowcore.wire import ShadowTag, TagKind

    def run(observed: bool):
        extra = engine_args("harvest-slo", slo={"ttft_s": 1.0, "tpot_s": 0.05})["additional_config"]
        config = virtual.VirtualEngineConfig(num_blocks=16, max_num_batched_tokens=512, additional_config=extra)
        eng = virtual.VirtualEngine(virtual.build_scheduler(ShadowScheduler, config), LinearLatencyModel())
        if observed:
            eng.scheduler.shadow_hook.observers.add(_CountPlans())
        for k in range(3):  # distinct prompts: a preempted request's blocks get evicted, so it recomputes
            eng.add_request(f"r{k}", [(k * 131 + i * 17) % 400 + 5 for i in range(90)], 60,
                            extra_args=ShadowTag(TagKind.ROUTED, f"s{k}").to_extra_args())  # routed: they earn
        eng.loop.run()
        credit = eng.scheduler.shadow_hook.slack.credit
        return [(s.start_s, s.num_tokens, s.preempted) for s in eng.steps], (credit.balance_s, credit.earned_s)

    fast_steps, fast_credit = run(observed=False)
    slow_steps, slow_credit = run(observed=True)
    assert any(preempted for *_, preempted in fast_steps)
    assert fast_steps == slow_steps
    assert fast_credit == slow_credit and fast_credit[1] > 0
