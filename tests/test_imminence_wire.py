"""A job's imminence (its session is in its tool gap) from the router side's manager to the
engine-side job the hook reads: the virtual-time feeder re-sends a shadow when it changes, and the
engine's job table takes it from the tag (no vLLM needed: the feeder runs against recording fakes)."""

from __future__ import annotations

from types import SimpleNamespace

from one_instance_cluster import OneInstanceCluster
from shadow_vllm.virtual.feeder import TaggedShadowFeeder

from shadowcore.engine_jobs import EngineJobs
from shadowcore.manager import ShadowManager
from shadowcore.switch import AllOthers, EmpiricalSwitchPredictor
from shadowcore.types import CallArrival
from shadowcore.wire import parse_tag


class _Engine:
    """Records what the feeder sends: (request id, prompt length, tag)."""

    def __init__(self) -> None:
        self.added: list[tuple[str, int, object]] = []
        self.aborted: list[str] = []

    def add_request(self, rid, token_ids, max_tokens, extra_args, kick):
        self.added.append((rid, len(token_ids), parse_tag(extra_args)))

    def abort(self, rids):
        self.aborted.extend(rids)


def test_feeder_resends_a_shadow_when_its_session_enters_and_leaves_the_gap() -> None:
    manager = ShadowManager(OneInstanceCluster(), ("A", "B"), EmpiricalSwitchPredictor(), AllOthers(), track_imminence=True)
    engine = _Engine()
    run = SimpleNamespace(runtime=SimpleNamespace(manager=manager), cluster=SimpleNamespace(by_id={"B-0": engine}))
    feeder = TaggedShadowFeeder()
    manager.on_call_arrival(CallArrival("s", "A", 64, 0.0, "fix", new_token_ids=tuple(range(64))))
    feeder(run)
    feeder(run)  # nothing changed: nothing sent
    assert [(n, t.imminent) for _, n, t in engine.added] == [(64, False)]
    manager.on_call_done("s")
    feeder(run)  # the same prefix, now imminent: sent again (it supersedes the first in the engine)
    assert [(n, t.imminent) for _, n, t in engine.added] == [(64, False), (64, True)]
    manager.on_call_arrival(CallArrival("s", "A", 16, 1.0, "fix", new_token_ids=tuple(range(16))))
    feeder(run)
    assert [(n, t.imminent) for _, n, t in engine.added][-1] == (80, False)
    jobs = EngineJobs("B-0", 16)
    entry, _ = jobs.open(SimpleNamespace(request_id="r", num_prompt_tokens=64), engine.added[1][2])
    assert entry.job.imminent and not jobs.open(SimpleNamespace(request_id="q", num_prompt_tokens=80),
                                                engine.added[2][2])[0].job.imminent
