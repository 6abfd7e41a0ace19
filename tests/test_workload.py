"""The Workload value and the one session driver: a given workload plays
exactly like the drawn one, scripted sessions keep the drawn normal traffic
and show up whole in ``run.workload``, bad workloads fail with one error."""

from __future__ import annotations

import pytest

from shadowcore.config import PluginRef, ShadowConfig
from shadowcore.engine.scenario import FakeRun, FakeScenario
from shadowcore.engine.workload import NormalRequest, PlannedCall, SessionPlan, Workload, draw_workload, session
from shadowcore.errors import ConfigError

SMALL = {"duration_s": 30.0, "warmup_s": 0.0, "session_rate_per_s": 0.3, "normal_rate_per_s": 1.0}


def _config() -> ShadowConfig:
    return ShadowConfig(PluginRef("harvest-slo", {"n_min": 16}))


def test_a_given_workload_plays_like_the_drawn_one() -> None:
    sc = FakeScenario.from_dict(SMALL)
    drawn = FakeRun(sc, _config())
    assert drawn.workload == draw_workload(sc)  # the run's workload is the scenario's draw
    given = FakeRun(sc, _config(), workload=draw_workload(sc))
    a, b = drawn.run(), given.run()
    assert a.calls and a.calls == b.calls and a.metrics == b.metrics


def test_scripted_sessions_are_the_workload_and_keep_normal_traffic() -> None:
    sc = FakeScenario.from_dict(SMALL)
    s = session("mine", 1.0, ("small", "large", "small"), (900, 300, 200), (50, 40, 30), gap_s=(1.0, 3.0, 0.0))
    run = FakeRun(sc, _config(), sessions=(s,))
    assert run.workload.sessions == (s,)
    assert run.workload.normal == draw_workload(sc).normal and run.workload.normal
    run.run()
    assert [(c.session_id, c.call_index) for c in run.calls] == [("mine", 0), ("mine", 1), ("mine", 2)]
    first, second = run.calls[0], run.calls[1]
    assert second.arrival_s == pytest.approx(first.arrival_s + first.latency_s + 1.0)  # its own tool gap
    assert len(run.normal) == len(run.workload.normal)


def test_normal_request_on_an_unknown_instance_is_one_error() -> None:
    sc = FakeScenario.from_dict(SMALL)
    run = FakeRun(sc, _config(), workload=Workload((), (NormalRequest("nowhere/0", 1.0, 100, 10),)))
    with pytest.raises(ConfigError) as info:
        run.run()
    assert info.value.field == "workload.normal.instance_id" and info.value.value == "nowhere/0"
    run = FakeRun(sc, _config(), sessions=(session("x", 0.0, ("small", "huge"), (10, 10), (5, 5)),))
    with pytest.raises(ConfigError) as info:
        run.run()
    assert info.value.field == "workload.sessions[x].calls[1].model" and info.value.value == "huge"
    assert not run.calls and run.loop.now_s == 0.0  # nothing ran


def test_workload_values_are_checked() -> None:
    s = session("a", 0.0, ("small",), (10,), (5,))
    with pytest.raises(ConfigError, match="unique"):
        Workload((s, s))
    with pytest.raises(ConfigError, match="at least one call"):
        SessionPlan("b", 0.0, ())
    with pytest.raises(ConfigError):
        PlannedCall("small", 10, 0)  # no output token
    with pytest.raises(ConfigError):
        PlannedCall("small", 10, 5, gap_after_s=float("inf"))
    with pytest.raises(ConfigError, match="one input, output"):
        session("c", 0.0, ("small", "large"), (10,), (5, 5))


def test_scripted_sessions_are_not_drawn(monkeypatch) -> None:
    """With ``sessions`` the scenario's own sessions are never drawn (a
    one-model trace replay has none to draw)."""

    def never(run):
        raise AssertionError("sessions drawn")

    monkeypatch.setattr(FakeRun, "session_plans", never)
    sc = FakeScenario.from_dict(SMALL)
    run = FakeRun(sc, _config(), sessions=())
    assert run.workload.sessions == () and run.workload.normal == draw_workload(sc, sessions=()).normal
