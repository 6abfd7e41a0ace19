"""ShadowManager.placement: where a call would go, read without changing
anything, by the same rule on_call_arrival applies to a call whose new input
is not counted yet (backends that register a call only once an engine
accepted it, such as the gateway, send it there first)."""

from __future__ import annotations

import zlib

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from shadowcore.manager import ShadowManager
from shadowcore.switch import EmpiricalSwitchPredictor, TopK
from shadowcore.types import CallArrival, JobKey

MODELS = ("A", "B")


@attrs.define
class _Cluster:
    """Three instances per model; what each holds depends on the session and its length."""

    load: dict[str, float] = attrs.Factory(dict)

    def instances(self, model):
        return tuple(f"{model}-{i}" for i in range(3))

    def block_size(self, instance_id):
        return 16

    def cached_prefix_tokens(self, instance_id, history):
        h = zlib.crc32(f"{instance_id}/{history.session_id}/{history.num_tokens // 64}".encode())
        return history.num_tokens if h % 3 == 0 else 0

    def estimated_prefill_completion_s(self, instance_id, num_uncached_tokens):
        return num_uncached_tokens * 1e-4 + self.load.get(instance_id, 0.0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from(MODELS), st.integers(0, 300),
                          st.dictionaries(st.sampled_from([f"{m}-{i}" for m in MODELS for i in range(3)]),
                                          st.sampled_from([0.0, 0.01]))), min_size=1, max_size=25))
def test_placement_reads_only_and_agrees_with_on_call_arrival(calls):
    cluster = _Cluster()
    manager = ShadowManager(cluster, MODELS, EmpiricalSwitchPredictor(0.5), TopK(1))
    for t, (session, model, tokens, load) in enumerate(calls):
        sid = f"s{session}"
        cluster.load = load
        before = manager.session(sid)
        num_sessions = manager.num_sessions
        predicted = manager.placement(sid, model)
        assert manager.session(sid) == before and manager.num_sessions == num_sessions  # nothing changed
        placed = manager.on_call_arrival(CallArrival(sid, model, 0, float(t)))  # input known later (the gateway)
        if before is not None:
            assert placed.instance_id == predicted
        else:  # a new session: its first call has no history yet, so only the load decides
            assert predicted == min(cluster.instances(model),
                                    key=lambda i: (cluster.estimated_prefill_completion_s(i, 0),
                                                   cluster.instances(model).index(i)))
        manager.on_output_tokens(sid, tokens)


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.sampled_from([f"B-{i}" for i in range(3)]), st.sampled_from([0.0, 0.01, 0.02])))
def test_a_shadow_job_opens_on_the_least_loaded_instance_first_in_order_on_ties(load):
    """A session's first job on a model it never ran on lives on that model's least loaded instance (the
    queued prefill work finishing first), the earliest in cluster order among equals."""
    cluster = _Cluster(load)
    manager = ShadowManager(cluster, MODELS, EmpiricalSwitchPredictor(0.5), TopK(1))
    manager.on_call_arrival(CallArrival("s", "A", 100, 0.0))
    job = manager.job(JobKey("s", "B"))
    assert job is not None  # TopK(1) targets the other model
    best = min(cluster.load.get(i, 0.0) for i in cluster.instances("B"))
    assert job.instance_id == next(i for i in cluster.instances("B") if cluster.load.get(i, 0.0) == best)


@attrs.define
class _FloorCluster(_Cluster):
    """Six instances per model, a placement floor (the estimate with no load), and every estimate counted."""

    read: list = attrs.Factory(list)

    def instances(self, model):
        return tuple(f"{model}-{i}" for i in range(6))

    def estimated_prefill_completion_s(self, instance_id, num_uncached_tokens):
        self.read.append(instance_id)
        return super().estimated_prefill_completion_s(instance_id, num_uncached_tokens)

    def prefill_completion_floor_s(self, instance_id, num_uncached_tokens):
        return num_uncached_tokens * 1e-4


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.01, 0.02]), min_size=6, max_size=6))
def test_the_least_loaded_scan_stops_reading_at_an_instance_with_nothing_queued(loads):
    """With a floor port, the shadow job's instance is still the full scan's (least loaded, first on ties),
    and no instance after the first one with nothing queued has its estimate read."""
    cluster = _FloorCluster({f"B-{i}": x for i, x in enumerate(loads)})
    manager = ShadowManager(cluster, MODELS, EmpiricalSwitchPredictor(0.5), TopK(1))
    manager.on_call_arrival(CallArrival("s", "A", 100, 0.0))
    job = manager.job(JobKey("s", "B"))
    assert job is not None
    assert job.instance_id == f"B-{loads.index(min(loads))}"
    read = [i for i in cluster.read if i.startswith("B-")]
    last = loads.index(0.0) if 0.0 in loads else len(loads) - 1  # the floor (no load) is below any load
    want = [f"B-{i}" for i in range(last + 1)]
    assert read == want, (loads, read)
