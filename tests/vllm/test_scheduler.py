"""The shadow scheduler on the real vLLM CPU engine (tiny local model).

Each test drives an in-process engine step by step (``LLMEngine.step``) and
reads what vLLM itself reports: ``num_cached_tokens`` of a request, the
scheduler output of every step, the block pool.
"""

from __future__ import annotations

import pytest
from shadow_vllm.engine_config import engine_args
from shadow_vllm.scheduler import (
    STOP_BELOW_N_MIN,
    STOP_PREFILLED,
    STOP_SUPERSEDED,
    AsyncShadowScheduler,
    ShadowScheduler,
)

from shadowcore.wire import ShadowEnd, ShadowTag, TagKind, parse_stop

BLOCK = 32


def _tokens(seed: int, n: int) -> list[int]:
    """``n`` token ids of the tiny vocabulary, different per seed."""
    return [10 + (seed * 7919 + i * 104729) % 400 for i in range(n)]


def _shadow(session: str, p: float = 0.9) -> dict:
    return ShadowTag(TagKind.SHADOW, session, "tiny", 0, p).to_extra_args()


def _routed(session: str) -> dict:
    return ShadowTag(TagKind.ROUTED, session).to_extra_args()


def _params(max_tokens: int, extra_args: dict | None = None):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra_args)


class Recorder:
    """Wraps a scheduler's ``schedule`` and keeps every step's scheduled tokens
    (by the caller's request id: vLLM appends a suffix to ids internally)."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler
        self.steps: list[dict[str, int]] = []
        self.hooks: list = []
        inner = scheduler.schedule

        def schedule(*args, **kwargs):
            out = inner(*args, **kwargs)
            self.steps.append({_user_id(r): n for r, n in out.num_scheduled_tokens.items()})
            for hook in self.hooks:
                hook(out)
            return out

        scheduler.schedule = schedule


def _user_id(internal_id: str) -> str:
    return internal_id.rsplit("-", 1)[0] if "-" in internal_id else internal_id


def _run(llm, requests: list[tuple[str, list[int], object]], until_done: bool = True, max_steps: int = 500) -> dict:
    """Add ``requests`` and step the engine until all finish; outputs by id."""
    engine = llm.llm_engine
    for rid, ids, params in requests:
        engine.add_request(rid, {"prompt_token_ids": ids}, params)
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    else:
        raise AssertionError("engine did not finish in time")
    return done


@pytest.fixture(scope="module")
def shadow_llm(engines):
    return engines.start(**engine_args("harvest-slo", slo={"ttft_s": 1.0, "tpot_s": 0.025}))


def test_switch_call_finds_shadowed_context_cached(shadow_llm, engines) -> None:
    context = _tokens(1, 1000)  # 31 full blocks + 8 tokens
    out = _run(shadow_llm, [("shadow-1", context, _params(1, _shadow("s1")))])["shadow-1"]
    assert out.outputs[0].stop_reason == STOP_PREFILLED
    assert list(out.outputs[0].token_ids) == []  # prefill only: it never decodes
    switch = _run(shadow_llm, [("switch-1", context + _tokens(2, 20), _params(2, _routed("s1")))])["switch-1"]
    assert switch.num_cached_tokens == (len(context) // BLOCK) * BLOCK
    # The same call shape without a shadow before it: nothing cached.
    other = _tokens(3, 1000)
    cold = _run(shadow_llm, [("cold-1", other + _tokens(4, 20), _params(2, _routed("s2")))])["cold-1"]
    assert cold.num_cached_tokens == 0
    bridge = engines.scheduler(shadow_llm).shadow_bridge
    assert bridge.num_promoted_blocks >= len(context) // BLOCK  # the switch used the shadow's blocks


def test_block_aligned_shadow_finishes_after_its_last_block(shadow_llm) -> None:
    context = _tokens(5, 10 * BLOCK)
    out = _run(shadow_llm, [("shadow-2", context, _params(16, _shadow("s5")))])["shadow-2"]
    assert out.outputs[0].stop_reason == STOP_PREFILLED
    assert len(out.outputs[0].token_ids) <= 1  # vLLM samples once when the prompt completes; no decode
    switch = _run(shadow_llm, [("switch-2", context + _tokens(6, 5), _params(1, _routed("s5")))])["switch-2"]
    assert switch.num_cached_tokens == len(context)


def test_newer_shadow_supersedes_older(shadow_llm, engines) -> None:
    engine = shadow_llm.llm_engine
    first, second = _tokens(7, 900), _tokens(7, 900) + _tokens(8, 156)  # 33 blocks: 3 idle-step chunks
    engine.add_request("old", {"prompt_token_ids": first}, _params(1, _shadow("s7")))
    engine.add_request("new", {"prompt_token_ids": second}, _params(1, _shadow("s7")))
    done = _run(shadow_llm, [])
    assert done["old"].outputs[0].stop_reason == STOP_SUPERSEDED
    assert done["new"].outputs[0].stop_reason == STOP_PREFILLED
    assert engines.scheduler(shadow_llm).shadow_stats.num_superseded >= 1


def test_tail_below_n_min_finishes_the_shadow(shadow_llm, engines) -> None:
    """harvest-slo never plans fewer than n_min=256 tokens: once less than that
    is missing, the shadow is done and the call computes the tail itself."""
    stats = engines.scheduler(shadow_llm).shadow_stats
    before = stats.num_shadow_tokens
    context = _tokens(11, 37 * BLOCK + 5)
    out = _run(shadow_llm, [("shadow-t", context, _params(1, _shadow("s11")))])["shadow-t"]
    stop = parse_stop(out.outputs[0].stop_reason)
    assert stop.end is ShadowEnd.BELOW_N_MIN
    computed = stats.num_shadow_tokens - before
    assert 0 < 37 * BLOCK - computed < 256
    assert stop.num_held_tokens == computed  # the gateway counts this, not the whole prompt
    switch = _run(shadow_llm, [("switch-t", context, _params(1, _routed("s11")))])["switch-t"]
    assert switch.num_cached_tokens == computed


def test_routed_arrival_gets_prefill_next_step_while_long_shadow_runs(engines, tiny_model_dir) -> None:
    llm = engines.start(**engine_args("harvest-slo", slo={"ttft_s": 1.0, "tpot_s": 0.025}))
    rec = Recorder(engines.scheduler(llm))
    engine = llm.llm_engine
    engine.add_request("long-shadow", {"prompt_token_ids": _tokens(9, 1900)}, _params(1, _shadow("s9")))
    engine.step()
    engine.step()
    assert rec.steps[-1].get("long-shadow", 0) > 0  # the shadow is running in idle slack
    routed = _tokens(10, 200)
    engine.add_request("routed", {"prompt_token_ids": routed}, _params(4, _routed("s10")))
    engine.step()
    assert rec.steps[-1].get("routed") == len(routed)  # its whole prefill, in the very next step
    while engine.has_unfinished_requests():
        engine.step()
    routed_steps = [s for s in rec.steps if "routed" in s]
    assert all(s.get("long-shadow", 0) == 0 for s in routed_steps[:1])  # no shadow work beside its prefill
    engines.stop(llm)


def test_shadow_held_back_while_an_admission_is_blocked(engines) -> None:
    """The hold-back gate: four decoding requests fill the KV pool so that a
    fifth waits for memory (budget and seats are free); a shadow arriving with
    it must get no token while it waits, though the pool still has free blocks
    a shadow chunk would fit in."""
    policy = {"name": "harvest-slo", "args": {"cold_age_s": 0.0}}  # may reuse the big ones' idle blocks at once
    llm = engines.start(**engine_args(policy, slo={"ttft_s": 5.0, "tpot_s": 0.5}))
    sched = engines.scheduler(llm)
    rec = Recorder(sched)
    waited: list[bool] = []
    rec.hooks.append(lambda out: waited.append(len(sched.waiting) > 0))
    engine = llm.llm_engine
    for i in range(4):  # 60 blocks each once prefilled, 61 after 40 decode steps
        engine.add_request(f"big{i}", {"prompt_token_ids": _tokens(20 + i, 1900)}, _params(40))
    while any(not r.num_output_tokens for r in sched.requests.values()):
        engine.step()
    free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    assert 8 < free < 16  # room for a shadow chunk (>= n_min), not for the fifth request's first chunk
    engine.add_request("fifth", {"prompt_token_ids": _tokens(30, 1000)}, _params(2))
    engine.add_request("sh", {"prompt_token_ids": _tokens(31, 1200)}, _params(1, _shadow("s31")))
    done = _run(llm, [])
    assert done["sh"].outputs[0].stop_reason.startswith((STOP_PREFILLED, STOP_BELOW_N_MIN))
    steps_waiting = [s for s, w in zip(rec.steps, waited, strict=True) if w]
    assert len(steps_waiting) >= 3, "the fifth request must have waited for memory"
    assert all(s.get("sh", 0) == 0 for s in steps_waiting)
    assert sum(s.get("sh", 0) for s in rec.steps) > 0  # it ran once nothing waited
    assert sched.shadow_stats.num_shadow_tokens > 0
    engines.stop(llm)


def _stock_vs_shadow_steps(engines, scheduler_cls) -> tuple[list, list, dict, dict]:
    requests = [(f"r{i}", _tokens(40 + i, 60 + 97 * i), _params(3 + i)) for i in range(6)]
    late = [(f"late{i}", _tokens(50 + i, 300 + 41 * i), _params(5)) for i in range(3)]
    runs = []
    for cls in (None, scheduler_cls):
        extra = engine_args("harvest-slo") if cls is not None else {}
        if cls is not None:
            extra["scheduler_cls"] = cls
        llm = engines.start(**extra)
        rec = Recorder(engines.scheduler(llm))
        engine = llm.llm_engine
        for rid, ids, params in requests:
            engine.add_request(rid, {"prompt_token_ids": ids}, params)
        outs = {}
        for step in range(300):
            if step == 3:
                for rid, ids, params in late:
                    engine.add_request(rid, {"prompt_token_ids": ids}, params)
            if step > 3 and not engine.has_unfinished_requests():
                break
            outs.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.step() if o.finished})
        runs.append((rec.steps, outs))
        engines.stop(llm)
    (stock_steps, stock_outs), (shadow_steps, shadow_outs) = runs
    return stock_steps, shadow_steps, stock_outs, shadow_outs


def test_no_shadow_jobs_schedules_exactly_as_stock(engines) -> None:
    stock_steps, shadow_steps, stock_outs, shadow_outs = _stock_vs_shadow_steps(
        engines, "shadow_vllm.scheduler.ShadowScheduler")
    assert len(stock_steps) > 5
    assert shadow_steps == stock_steps
    assert shadow_outs == stock_outs and len(stock_outs) == 9


def test_kv_bridge_attaches_at_the_first_shadow(engines) -> None:
    """Until a shadow request arrives, vLLM's block pool and free queue keep
    their own classes (no per-block hook costs a stock workload anything);
    the first shadow attaches the bridge, and the switch then finds the
    shadow's context cached as usual."""
    from vllm.v1.core.block_pool import BlockPool

    llm = engines.start(**engine_args("harvest-slo", slo={"ttft_s": 1.0, "tpot_s": 0.025}))
    sched = engines.scheduler(llm)
    pool = sched.kv_cache_manager.block_pool
    _run(llm, [("plain", _tokens(70, 300), _params(3))])
    assert not sched.shadow_bridge.attached and type(pool) is BlockPool
    context = _tokens(71, 20 * BLOCK)
    out = _run(llm, [("sh", context, _params(1, _shadow("s71")))])["sh"]
    assert out.outputs[0].stop_reason == STOP_PREFILLED
    assert sched.shadow_bridge.attached and type(pool) is not BlockPool and isinstance(pool, BlockPool)
    switch = _run(llm, [("switch", context + _tokens(72, 8), _params(1, _routed("s71")))])["switch"]
    assert switch.num_cached_tokens == 20 * BLOCK
    engines.stop(llm)


def test_async_class_covers_the_same_hooks() -> None:
    """The CPU engine forces async scheduling off, so the async class is
    checked structurally: the mixin comes first and every hook resolves to it."""
    from shadow_vllm.scheduler import ShadowSchedulerMixin
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    mixins = ShadowSchedulerMixin.__mro__[:-1]  # the mixin and its parts (snapshot, connector loads), not object
    k = 1 + len(mixins)
    assert AsyncShadowScheduler.__mro__[1:k] == mixins and ShadowScheduler.__mro__[1:k] == mixins
    assert AsyncShadowScheduler.__mro__[k] is AsyncScheduler
    assert ShadowScheduler.__mro__[k] is Scheduler
    hooks = [n for m in mixins for n, v in vars(m).items() if callable(v) and not n.startswith("__")]
    assert {"schedule", "update_from_output", "add_request", "_shadow_update_request_with_output", "_free_request",
            "get_num_unfinished_requests"} <= set(hooks)
    # vLLM's per-request update is left alone (no per-request cost without shadows); while shadows
    # exist, update_from_output installs the mixin's wrapper, which calls the base's through super().
    assert all("_update_request_with_output" not in vars(m) for m in mixins)
    for name in hooks:
        assert getattr(AsyncShadowScheduler, name) is getattr(ShadowSchedulerMixin, name)
        assert getattr(ShadowScheduler, name) is getattr(ShadowSchedulerMixin, name)
    # AsyncScheduler's own overrides still run under the mixin (super() chain).
    for name in ("_update_after_schedule", "_update_request_with_output"):
        assert name in vars(AsyncScheduler)
