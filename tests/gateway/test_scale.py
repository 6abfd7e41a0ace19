"""Bounded state: the session cap (LRU), the idle timeout releasing every
per-session map (gateway, manager, predictor), and flat per-call work."""

from __future__ import annotations

import asyncio

import pytest
from shadow_gateway.config import from_dict
from shadow_gateway.gateway import Gateway

from .conftest import two_model_config, wait_for


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _offline_gateway(policy: str = "adaptive-host", scheduler_b: str = "shadow", **session) -> tuple[Gateway, _Clock]:
    class _U:  # URLs only: the gateway object is driven without its server
        def __init__(self, port: int) -> None:
            self.url = f"http://127.0.0.1:{port}"

    cfg = two_model_config([_U(9)], [_U(10)], scheduler_b=scheduler_b, shadow={"policy": policy},
                           session={"idle_timeout_s": 60.0, **session})
    clock = _Clock()
    return Gateway(from_dict(cfg), clock=clock), clock


def _call(gw: Gateway, sid: str, model: str, ids: list[int], task: str = "") -> None:
    """One routed call as the request path runs it (arrival, the upstream accepts it, prompt ids,
    output ids, end)."""
    ctx = gw.begin_routed(sid, model, task, {})
    assert ctx is not None
    gw.accept(ctx, ctx.instance)
    gw.on_prompt_ids(ctx, ids, None)
    gw.on_output_ids(ctx, [7, 8, 9])
    gw.end_routed(ctx, True)


def _entries(gw: Gateway) -> dict[str, int]:
    pred = gw.manager.predictor
    return {
        "manager sessions": gw.manager.num_sessions,
        "manager jobs": len(list(gw.manager.jobs())),
        "active jobs": sum(gw.manager.num_active_jobs(i) for i in gw.cluster.by_id),
        "last seen": len(gw.last_seen_s),
        "known prefixes": sum(len(i.known) for i in gw.cluster.by_id.values()),
        "dispatcher": gw.shadows.num_session_entries(),
        "predictor sessions": pred.num_sessions(),
    }


@pytest.mark.parametrize("policy", ["adaptive-host", "benefit-host"])
def test_20k_ended_sessions_leave_no_per_session_entry(policy):
    """b is a stock instance (request-level shadows keep the session's context
    per instance); the gateway object is driven in a loop that never yields,
    so no upstream is needed."""
    gw, clock = _offline_gateway(policy, scheduler_b="stock", max_tasks=100)

    async def run() -> tuple[dict[str, int], dict[str, int]]:
        gw.shadows.start()
        try:
            for i in range(20_000):
                ids = [i % 250 + 1] * 40
                _call(gw, f"s{i}", "a", ids, task=f"task{i}")
                _call(gw, f"s{i}", "b", ids + [7, 8, 9, 5], task=f"task{i}")  # a transition
            before = _entries(gw)
            assert gw.manager.predictor.num_tasks() == 100  # bounded by session.max_tasks even while live
            clock.now += 61
            assert gw.expire_idle() == 20_000
            return before, _entries(gw)
        finally:
            await gw.shadows.close()

    before, after = asyncio.run(run())
    assert before["manager sessions"] == 20_000 and before["predictor sessions"] == 20_000
    assert before["dispatcher"] > 0 and before["known prefixes"] > 0
    assert all(n == 0 for n in after.values()), after


def test_session_cap_ends_the_least_recently_seen_idle_session():
    gw, clock = _offline_gateway(max_sessions=3)
    for sid in ("s0", "s1", "s2"):
        _call(gw, sid, "a", [1] * 40)
        clock.now += 1
    _call(gw, "s0", "a", [1] * 40 + [7, 8, 9, 2])  # s0 is now the most recent
    busy = gw.begin_routed("s1", "a", "", {})  # s1 in a call: never evicted
    _call(gw, "s3", "a", [3] * 40)
    assert set(gw.last_seen_s) == {"s0", "s1", "s3"} and "s2" not in gw.manager
    assert gw.metrics.registry.get_sample_value("shadowprefill_gateway_fallbacks_total",
                                                {"reason": "session-evicted-lru"}) == 1
    gw.end_routed(busy, True)
    assert gw.manager.num_sessions == 3


def test_idle_timeout_over_http_ends_sessions(upstreams, gateway, client):
    (a,), (b,) = upstreams(1), upstreams(1)
    gw = gateway(two_model_config([a], [b], session={"idle_timeout_s": 0.2}))
    for i in range(5):
        r = client.post(gw.url + "/v1/completions", headers={"X-Session-Id": f"s{i}"},
                        json={"model": "a", "prompt": "x" * 40, "max_tokens": 4})
        assert r.status_code == 200
    assert gw.gateway.manager.num_sessions == 5
    wait_for(lambda: gw.gateway.manager.num_sessions == 0, timeout_s=5, what="idle sessions to end")
    assert not gw.gateway.last_seen_s and not any(i.known for i in gw.gateway.cluster.by_id.values())


def test_bad_caps_are_config_errors():
    for field in ("max_sessions", "max_tasks"):
        with pytest.raises(Exception, match=f"session.{field}"):
            from_dict({"models": {"a": {"instances": ["http://127.0.0.1:1"]}}, "session": {field: 0}})
