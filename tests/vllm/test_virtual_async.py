"""AsyncShadowScheduler under async scheduling, in virtual time (issue 5).

The CPU engine forces async scheduling off, so the engine tests never run
vLLM's ``AsyncScheduler`` with a step in flight. Here the real
``AsyncShadowScheduler`` (vLLM's ``AsyncScheduler`` and KV cache manager,
no model) is driven as vLLM's engine core drives it with a batch queue of
two: the next step is scheduled while the previous one still runs, and the
previous step's output is fed back afterwards. A step is then reported to the
hook when the next one is scheduled, with the latency model's predicted
duration: for a skipped step (the engines' ``_fastpath.skip_step``) and a planned one
(``end_step``) alike.
"""

from __future__ import annotations

import contextlib
from collections import deque
from unittest import mock

import pytest
from shadow_vllm import virtual

from shadowcore.engine import _fastpath
from shadowcore.latency import BatchShape, LinearLatencyModel, PrefillChunk
from shadowcore.wire import ShadowTag, TagKind


class PipelinedDriver:
    """Two steps in flight (vLLM's ``step_with_batch_queue`` with a queue of
    two) on a virtual clock: schedule while the queue has room and something
    can be scheduled, else finish the oldest step (its duration: the latency
    model's for its batch) and feed fake sampled tokens to
    ``update_from_output``."""

    def __init__(self, scheduler, latency) -> None:
        self.scheduler = scheduler
        self.latency = latency
        self.clock = virtual.VirtualClock()
        scheduler.shadow_clock = self.clock
        self.hasher = virtual.block_hasher(scheduler.block_size)
        self.inflight: deque = deque()
        self.steps: list[tuple] = []
        self.busy_until_s = 0.0
        self.num_overlapped = 0  # steps scheduled while the previous one was still running

    def add(self, request_id: str, prompt: list[int], max_tokens: int, extra_args: dict | None = None) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args)
        self.scheduler.add_request(Request(request_id, prompt, params, None, arrival_time=self.clock.now_s,
                                           block_hasher=self.hasher))

    def _schedule(self) -> bool:
        out = self.scheduler.schedule()
        if out.total_num_scheduled_tokens == 0:
            from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

            self.scheduler.update_from_output(out, EMPTY_MODEL_RUNNER_OUTPUT)
            return False
        requests = self.scheduler.requests
        batch = []
        for rid, n in out.num_scheduled_tokens.items():
            before = requests[rid].num_computed_tokens - n
            batch.append((rid, n, before, requests[rid].is_prefill_chunk))
        prefills = [PrefillChunk(n, before) for _, n, before, partial in batch if partial or n > 1]
        decodes = [before for _, n, before, partial in batch if not partial and n == 1]
        duration_s = self.latency.predict_s(BatchShape(tuple(prefills), tuple(decodes)))
        self.num_overlapped += bool(self.inflight)
        start_s = max(self.clock.now_s, self.busy_until_s)
        self.busy_until_s = start_s + duration_s
        self.inflight.append((out, batch, self.busy_until_s))
        self.steps.append((round(start_s, 12), tuple((rid, n) for rid, n, *_ in batch)))
        return True

    def _finish_oldest(self) -> None:
        from vllm.v1.outputs import ModelRunnerOutput

        out, batch, end_s = self.inflight.popleft()
        self.clock.now_s = max(self.clock.now_s, end_s)
        ids = [rid for rid, *_ in batch]
        sampled = [[] if partial else [virtual.hashed_token(rid, before)] for rid, _, before, partial in batch]
        self.scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled))

    def run(self, limit: int = 20_000) -> None:
        for _ in range(limit):
            if len(self.inflight) < 2 and self.scheduler.has_requests() and self._schedule():
                continue
            if not self.inflight:
                if not self.scheduler.has_requests():
                    return
                if not self._schedule():  # only finished ids to flush, or shadows that cannot run yet
                    self.clock.now_s += 0.001
                continue
            self._finish_oldest()
        raise RuntimeError("the pipelined engine did not drain")


class _RecordingHook:
    """The scheduler's EngineHook, recording how each step is reported to it
    (skipped ones through :func:`_recording_skips`)."""

    def __init__(self, hook, closes: list) -> None:
        self._hook = hook
        self._closes = closes

    def __getattr__(self, name: str):
        return getattr(self._hook, name)

    def end_step(self, outcome) -> None:
        self._closes.append(("end", outcome.duration_s))
        self._hook.end_step(outcome)


@contextlib.contextmanager
def _recording_skips(closes: list):
    """The engines' skip_step (a private fast path), recording each skipped step's duration."""
    original = _fastpath.skip_step

    def recording(hook, duration_s: float, decode_only: bool, routed: bool) -> None:
        closes.append(("skip", duration_s))
        original(hook, duration_s, decode_only, routed)

    with mock.patch.object(_fastpath, "skip_step", recording):
        yield


class _CountPlans:
    """An observer: the hook then plans every step (the engines' ``_fastpath.can_skip`` is False with one)."""

    def __init__(self) -> None:
        self.num_plans = 0

    def on_plan(self, snapshot, plan) -> None:
        self.num_plans += 1


def _run(policy: str, observed: bool):
    from shadow_vllm.engine_config import engine_args
    from shadow_vllm.scheduler import AsyncShadowScheduler
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    extra = engine_args(policy, asynchronous=True, slo={"ttft_s": 1.0, "tpot_s": 0.05})["additional_config"]
    config = virtual.VirtualEngineConfig(num_blocks=256, max_num_batched_tokens=256, additional_config=extra)
    scheduler = virtual.build_scheduler(AsyncShadowScheduler, config)
    assert isinstance(scheduler, AsyncScheduler)  # (the CPU platform clears the config flag; the class is what runs)
    latency = LinearLatencyModel()
    driver = PipelinedDriver(scheduler, latency)
    hook = scheduler.shadow_hook
    counter = _CountPlans()
    if observed:
        hook.observers.add(counter)
    closes: list[tuple[str, float]] = []  # how each step reached the hook: skip_step / end_step, with its duration
    scheduler.shadow_hook = _RecordingHook(hook, closes)

    with _recording_skips(closes):
        for k in range(6):  # a decode-heavy phase without shadows; two shorter routed calls (credit: Harvest-SLO's)
            routed = ShadowTag(TagKind.ROUTED, f"s{k}").to_extra_args() if k < 2 else None
            driver.add(f"n{k}", [10 + k] * (40 + 30 * k), 12 if k < 2 else 24, routed)
        driver.run()
        phase1 = (list(driver.steps), counter.num_plans, hook.slack.credit.balance_s, hook.slack.credit.earned_s)
        driver.add("shadow", [7 + i % 300 for i in range(900)], 1,
                   ShadowTag(TagKind.SHADOW, "s", "m", 0, 0.9).to_extra_args())
        driver.add("n-late", [500 + i % 50 for i in range(70)], 30)
        driver.run()
        driver.add("routed", [300 + i % 90 for i in range(120)], 8, ShadowTag(TagKind.ROUTED, "s").to_extra_args())
        driver.run()
    credit = hook.slack.credit
    return (phase1, driver.steps, scheduler.shadow_stats, (credit.balance_s, credit.earned_s, credit.spent_s), closes,
            driver.num_overlapped)


@pytest.mark.parametrize("policy", ["harvest-slo", "harvest"])
def test_async_skipped_steps_report_predicted_durations_and_decide_as_planned_ones(policy: str) -> None:
    """Two AsyncShadowSchedulers differing only in an observer (which makes the
    hook plan every step): the one that skips steps without shadows reports
    them with their predicted durations (the next step is scheduled before the
    previous one's output is in) and ends with the same credit, bit for bit,
    and the same steps and shadow chunks afterwards."""
    (fast_p1, fast_plans, fast_balance, fast_earned), fast_steps, fast_stats, fast_credit, fast_closes, _ = \
        _run(policy, observed=False)
    (slow_p1, slow_plans, slow_balance, slow_earned), slow_steps, slow_stats, slow_credit, slow_closes, _ = \
        _run(policy, observed=True)

    assert len(fast_p1) > 20 and fast_p1 == slow_p1
    assert fast_plans == 0 and slow_plans >= len(slow_p1)
    # The skipped steps of phase 1 reached the hook through skip_step, with predicted durations:
    # every one but the last was closed by the next schedule() before its output came back.
    num_skips = sum(1 for kind, _ in fast_closes[:len(fast_p1)] if kind == "skip")
    assert num_skips == len(fast_p1)
    assert [d for _, d in fast_closes[:len(fast_p1)]] == [d for _, d in slow_closes[:len(slow_p1)]]
    assert fast_earned == slow_earned > 0 and fast_balance == slow_balance  # bit for bit
    assert fast_steps == slow_steps  # every later step: same time, batch and shadow chunks
    assert fast_stats == slow_stats and fast_stats.num_shadow_tokens > 0
    assert fast_credit == slow_credit


def test_async_driver_overlaps_steps() -> None:
    """The driver really pipelines: most steps are scheduled while the previous one still runs, and
    each of those is reported to the hook before its own output is in, with its predicted (positive)
    duration; only empty steps (finished ids to flush) report zero."""
    _, steps, _, _, closes, num_overlapped = _run("harvest-slo", observed=False)
    assert num_overlapped > len(steps) // 2
    assert sum(1 for _, d in closes if d > 0) >= len(steps) - 1
    assert all(d >= 0 for _, d in closes)
