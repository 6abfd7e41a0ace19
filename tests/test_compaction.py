"""Compaction at the model's window: the history restarts as a summary, every
shadow job restarts from the new epoch, and the next switch finds the summary
(not the old context) cached."""

from __future__ import annotations

from shadowcore.config import PluginRef, ShadowConfig
from shadowcore.engine.scenario import FakeRun, FakeScenario
from shadowcore.types import CallArrival, JobKey


def _run() -> FakeRun:
    sc = FakeScenario.from_dict({"models": ["A", "B"], "latency_scale": [1.0, 1.0], "instances_per_model": 1,
                                 "normal_rate_per_s": 0.0, "duration_s": 1.0})
    return FakeRun(sc, ShadowConfig(PluginRef("harvest-slo", {"n_min": 16})), sessions=())


def test_compaction_resets_history_and_jobs() -> None:
    run = _run()
    manager = run.runtime.manager
    manager.on_call_arrival(CallArrival("s", "A", 3000, 0.0))
    manager.on_output_tokens("s", 200)
    job = manager.job(JobKey("s", "B"))
    assert job is not None and job.num_target_tokens == 3200 // 16 * 16
    old_hashes = manager.history("s").block_hashes(16)
    manager.on_call_arrival(CallArrival("s", "A", 500, 1.0, compact_to_tokens=1000))
    history = manager.history("s")
    assert history.num_tokens == 1500 and history.epoch == 1
    assert not set(history.block_hashes(16)) & set(old_hashes)  # the summary shares no block
    job = manager.job(JobKey("s", "B"))
    assert job.num_missing_tokens == 1500 // 16 * 16  # the shadow restarts from the summary


def test_negative_compaction_is_rejected() -> None:
    import pytest

    from shadowcore.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        CallArrival("s", "A", 10, 0.0, compact_to_tokens=-1)
    assert info.value.field == "compact_to_tokens"


def test_compaction_with_token_ids_starts_a_token_history() -> None:
    """With real tokens (vLLM, gateway) the new epoch is the summary's ids then the
    call's new input: a history an engine can prefill, not counts only."""
    run = _run()
    manager = run.runtime.manager
    manager.on_call_arrival(CallArrival("s", "A", 40, 0.0, new_token_ids=tuple(range(40))))
    manager.on_output_tokens("s", 8, list(range(100, 108)))
    summary, new = tuple(range(500, 532)), tuple(range(900, 920))
    manager.on_call_arrival(CallArrival("s", "A", 20, 1.0, new_token_ids=new, compact_to_tokens=32,
                                        summary_token_ids=summary))
    history = manager.history("s")
    assert history.epoch == 1 and history.num_tokens == 52
    assert history.token_ids.tolist() == [*summary, *new]
    manager.on_output_tokens("s", 4, [1, 2, 3, 4])  # the epoch goes on as a token history
    assert history.token_ids.tolist()[-4:] == [1, 2, 3, 4]


def test_compaction_of_a_token_history_needs_summary_ids() -> None:
    import pytest

    from shadowcore.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        CallArrival("s", "A", 2, 0.0, new_token_ids=(1, 2), compact_to_tokens=3)
    assert info.value.field == "summary_token_ids"
    with pytest.raises(ConfigError, match="must hold compact_to_tokens = 3"):
        CallArrival("s", "A", 2, 0.0, new_token_ids=(1, 2), compact_to_tokens=3, summary_token_ids=(7, 8))
    with pytest.raises(ConfigError, match="without compact_to_tokens"):
        CallArrival("s", "A", 2, 0.0, new_token_ids=(1, 2), summary_token_ids=(7, 8))
