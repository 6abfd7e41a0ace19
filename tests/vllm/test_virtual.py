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
