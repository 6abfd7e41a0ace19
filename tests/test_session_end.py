"""Session ends reach the predictor: per-session state is dropped, task state
is bounded by ``max_tasks``, and a predictor can learn P(another call)."""

from __future__ import annotations

import pytest
from one_instance_cluster import OneInstanceCluster
from shadow_policies.adaptive import SessionAwarePredictor
from shadow_policies.benefit import PopulationBackoffPredictor

from shadowcore.manager import ShadowManager
from shadowcore.switch import AllOthers, EmpiricalSwitchPredictor, SwitchPredictor, TaskMemory
from shadowcore.types import CallArrival


class _Recorder(EmpiricalSwitchPredictor):
    def __init__(self) -> None:
        super().__init__()
        self.ended: list[tuple[str, str]] = []

    def observe_session_end(self, session_id: str, task: str) -> None:
        self.ended.append((session_id, task))
        super().observe_session_end(session_id, task)


def _calls(manager: ShadowManager, sid: str, task: str, models: str) -> None:
    for t, m in enumerate(models):
        manager.on_call_arrival(CallArrival(sid, m, 32, float(t), task))


def test_manager_tells_the_predictor_once_per_known_session():
    predictor = _Recorder()
    manager = ShadowManager(OneInstanceCluster(), ("A", "B"), predictor, AllOthers())
    _calls(manager, "s1", "fix", "AB")
    manager.on_session_end("s1")
    manager.on_session_end("s1")  # unknown now: no second report
    manager.on_session_end("never")
    assert predictor.ended == [("s1", "fix")]
    assert manager.num_sessions == 0 and not list(manager.jobs())


@pytest.mark.parametrize("make", [lambda: SessionAwarePredictor(), lambda: PopulationBackoffPredictor()])
def test_session_state_dropped_and_others_unchanged(make):
    predictor = make()
    manager = ShadowManager(OneInstanceCluster(), ("A", "B", "C"), predictor, AllOthers())
    for i in range(200):
        _calls(manager, f"s{i}", "fix", "ABAC")
    _calls(manager, "live", "fix", "ABA")
    before = predictor.next_model_distribution("live", "fix", "A", ("A", "B", "C"))
    assert predictor.num_sessions() == 201
    for i in range(200):
        manager.on_session_end(f"s{i}")
    assert predictor.num_sessions() == 1  # only the live session's own counts remain
    assert predictor.next_model_distribution("live", "fix", "A", ("A", "B", "C")) == before
    manager.on_session_end("live")
    assert predictor.num_sessions() == 0


def test_max_tasks_keeps_the_most_recent_tasks_only():
    predictor = EmpiricalSwitchPredictor(1.0, max_tasks=3)
    manager = ShadowManager(OneInstanceCluster(), ("A", "B"), predictor, AllOthers())
    for i in range(50):
        _calls(manager, f"s{i}", f"task{i}", "AB")
        manager.on_session_end(f"s{i}")
    assert predictor.num_tasks() == 3
    assert {k[0] for k in predictor._counts} <= {"task47", "task48", "task49"}
    # a forgotten task predicts from the prior again; a kept one from its counts
    assert predictor.switch_probability("x", "task0", "A") == 0.5
    assert predictor.switch_probability("x", "task49", "A") == pytest.approx(2 / 3)


def test_fitted_tasks_are_never_forgotten():
    predictor = EmpiricalSwitchPredictor(1.0, max_tasks=1).fit([("p0", "old", ["A", "B", "B"])])
    for i in range(5):
        predictor.observe_transition(f"s{i}", f"new{i}", "A", "B")
        predictor.observe_transition("s", "old", "A", "B")
    assert ("old", "A") in predictor._counts
    assert predictor.switch_probability("p0", "old", "A") == pytest.approx((5 + 1) / (5 + 2))


def test_another_call_probability_learns_session_length():
    predictor = EmpiricalSwitchPredictor(1.0)
    manager = ShadowManager(OneInstanceCluster(), ("A", "B"), predictor, AllOthers())
    assert predictor.another_call_probability("t") == 0.5
    for i in range(10):
        _calls(manager, f"s{i}", "t", "ABAB")  # 3 transitions, then the end
        manager.on_session_end(f"s{i}")
    assert predictor.another_call_probability("t") == pytest.approx((30 + 1) / (40 + 2))


def test_default_hook_is_a_no_op():
    class Fixed(SwitchPredictor):
        def switch_probability(self, session_id, task, current_model):
            return 0.5

        def next_model_distribution(self, session_id, task, current_model, models):
            return {m: 1.0 for m in models if m != current_model}

    assert Fixed().observe_session_end("s", "t") is None


def test_task_memory_rejects_bad_bound():
    with pytest.raises(Exception, match="max_tasks"):
        TaskMemory(0)


def test_jobs_are_imminent_exactly_during_the_tool_gap():
    """With track_imminence a session's jobs are imminent from the end of its call (on_call_done) to
    the next call's arrival; a job opened at that arrival starts not imminent; without it never."""
    for track in (True, False):
        manager = ShadowManager(OneInstanceCluster(), ("A", "B"), EmpiricalSwitchPredictor(), AllOthers(),
                                track_imminence=track)
        manager.on_call_arrival(CallArrival("s", "A", 32, 0.0, "fix"))
        (job,) = manager.jobs()
        assert job.key.target_model == "B" and not job.imminent
        manager.on_call_done("s")
        assert job.imminent is track
        manager.on_call_arrival(CallArrival("s", "A", 32, 1.0, "fix"))  # same model: the gap is over
        assert manager.job(job.key) is job and not job.imminent
        manager.on_call_done("s")
        manager.on_call_arrival(CallArrival("s", "B", 32, 2.0, "fix"))  # the switch: B's job closed, A's opened
        assert [j.key.target_model for j in manager.jobs()] == ["A"] and not any(j.imminent for j in manager.jobs())
    with pytest.raises(KeyError, match="nope"):
        manager.on_call_done("nope")
