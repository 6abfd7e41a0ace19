"""Placement on many instances: what ``EngineCluster`` answers the manager's
per-instance scan with is what the full reads give, and a run's results do
not move.

``EngineCluster.cached_prefix_tokens`` answers 0 from one membership test
(``KVClassManager.may_hold_prefix``) on an instance that holds none of the
history's first block, with no catch-up of its lazy run;
``estimated_prefill_completion_s`` computes one instant's estimates once per
(latency model, token budget, work). Checked on a run with four instances per
model, a tight KV pool, a host tier and shadow jobs: every answer against the
full read at that moment, and the whole run against one whose cluster does
the full reads (the code before the shortcut).
"""

from __future__ import annotations

import math

import attrs

from shadowcore.config import PluginRef, ShadowConfig
from shadowcore.engine.cluster import EngineCluster
from shadowcore.engine.scenario import FakeRun, FakeScenario
from shadowcore.kv import KVClass
from shadowcore.latency import windowed_prefill_s

from .test_speed_equivalence import _same

_FIELDS = {"instances_per_model": 4, "duration_s": 30.0, "warmup_s": 5.0, "session_rate_per_s": 0.4,
           "calls_per_session": 5, "normal_rate_per_s": 3.0, "normal_output_median": 200, "num_blocks": 1500,
           "seed": 3}


@attrs.define(eq=False)
class _FullReads(EngineCluster):
    """The cluster's reads as they were before the shortcuts: a full lookup (with its catch-up) and a fresh
    estimate on every instance (a deferred one brought up to now first: its queued work is its own)."""

    def cached_prefix_tokens(self, instance_id, history):
        return self.by_id[instance_id].cached_prefix_tokens(history)

    def estimated_prefill_completion_s(self, instance_id, num_uncached_tokens):
        inst = self._up_to_now(instance_id)
        work = inst.queued_prefill_tokens + num_uncached_tokens
        return self.loop.now_s + windowed_prefill_s(inst.latency, work, inst.limits.token_budget, self.window_tokens)

    def prefill_completion_floor_s(self, instance_id, num_uncached_tokens):
        return -math.inf  # no floor: the manager reads every instance's estimate


@attrs.define(eq=False)
class _Eager(EngineCluster):
    """No instance deferred: every instance's events on the loop (what the shortcuts and deferral must equal)."""

    defer_instances: bool = False


SEEN: dict[str, int] = {}


@attrs.define(eq=False)
class _Checked(EngineCluster):
    """The cluster's own reads, each compared with the full read at that moment (``SEEN`` counts them)."""

    def cached_prefix_tokens(self, instance_id, history):
        got = super().cached_prefix_tokens(instance_id, history)
        want = _FullReads.cached_prefix_tokens(self, instance_id, history)
        assert got == want, f"{instance_id} at {self.loop.now_s}: cached {got}, the full lookup {want}"
        SEEN["cached" if want else "none"] += 1
        return got

    def estimated_prefill_completion_s(self, instance_id, num_uncached_tokens):
        got = super().estimated_prefill_completion_s(instance_id, num_uncached_tokens)
        want = _FullReads.estimated_prefill_completion_s(self, instance_id, num_uncached_tokens)
        assert got == want, f"{instance_id} at {self.loop.now_s}: estimate {got}, computed {want}"
        SEEN["estimates"] += 1
        return got

    def prefill_completion_floor_s(self, instance_id, num_uncached_tokens):
        got = super().prefill_completion_floor_s(instance_id, num_uncached_tokens)
        self._up_to_now(instance_id)  # (the check only: the floor itself reads no queued work)
        want = _FullReads.estimated_prefill_completion_s(self, instance_id, num_uncached_tokens)
        assert got <= want, f"{instance_id} at {self.loop.now_s}: floor {got} above the estimate {want}"
        SEEN["floors"] += 1
        return got


def _run(policy: str, cluster_cls: type[EngineCluster]) -> dict:
    @attrs.define(eq=False)
    class Run(FakeRun):
        def build_cluster(self, extra: int) -> EngineCluster:
            c = super().build_cluster(extra)
            for insts in c.by_model.values():  # one latency model per model, as SimRun's instances share one
                for inst in insts:
                    inst.latency = insts[0].latency
            return cluster_cls(c.loop, c.by_model, c.by_id, c.window_tokens)

    run = Run(FakeScenario.from_dict(_FIELDS), ShadowConfig(PluginRef(policy), seed=2))
    result = run.run()
    insts = run.cluster.by_id.values()
    return {
        "summary": dict(result.metrics),
        "calls": [list(attrs.astuple(c)) for c in result.calls],
        "normal": [list(r) for r in run.normal],
        "instances": {i.instance_id: [i.num_iterations_run, i.busy_s, i.num_shadow_tokens, i.num_preemptions,
                                      i.kv.eviction_count, i.kv.num_free_blocks, i.kv.num_host_blocks,
                                      i.kv.idle_order(KVClass.NORMAL), i.kv.idle_order(KVClass.SHADOW)]
                      for i in insts},
        "end_s": run.loop.now_s,
    }


def test_placement_reads_equal_the_full_reads_and_the_run_does_not_move() -> None:
    SEEN.update(cached=0, none=0, estimates=0, floors=0)
    checked = _run("harvest-slo-host", _Checked)
    # not vacuous: instances that hold a prefix and instances that hold none were both asked, and the floor
    # let placement skip some instances' estimates (fewer estimates than instances asked)
    assert SEEN["cached"] > 20 and SEEN["none"] > 100 and SEEN["estimates"] > 100, SEEN
    assert SEEN["floors"] > 100 and SEEN["estimates"] < SEEN["cached"] + SEEN["none"] - 50, SEEN
    shortcut = _run("harvest-slo-host", EngineCluster)
    full = _run("harvest-slo-host", _FullReads)
    eager = _run("harvest-slo-host", _Eager)
    for key in full:
        assert _same(shortcut[key], full[key]), f"{key} differs from the run with full reads"
        assert _same(checked[key], full[key]), f"{key} differs (checked run)"
        assert _same(shortcut[key], eager[key]), f"{key} differs from the run with no instance deferred"


def test_one_instants_estimates_equal_fresh_ones_for_every_queue_and_window() -> None:
    """The memo of :meth:`EngineCluster.estimated_prefill_completion_s` answers every instance with its own
    queued work, latency model and token budget (instances of both models, queues of their own), at one
    instant and after the clock moves."""
    run = FakeRun(FakeScenario.from_dict(_FIELDS), ShadowConfig(PluginRef("no-shadow"), seed=2))
    for insts in run.cluster.by_model.values():  # one latency model per model, as SimRun's instances share one
        for inst in insts:
            inst.latency = insts[0].latency
    for window in (0, 3000):
        cluster = EngineCluster(run.loop, run.cluster.by_model, run.cluster.by_id, window)
        full = _FullReads(run.loop, run.cluster.by_model, run.cluster.by_id, window)
        for now in (0.0, 0.0, 1.5):
            run.loop.now_s = now
            for k, inst in enumerate(run.cluster.by_id.values()):
                inst.queued_prefill_tokens = (k % 3) * 700
            for uncached in (0, 1, 500, 2999, 6001):
                for iid in run.cluster.by_id:
                    got = cluster.estimated_prefill_completion_s(iid, uncached)
                    assert got == full.estimated_prefill_completion_s(iid, uncached), (window, now, iid, uncached)


@attrs.frozen
class _Dip:
    """A latency model whose one-chunk prefill is slower for ``dip`` tokens than for more: not monotone."""

    inner: object
    dip: int = 300

    def predict_s(self, shape):
        t = self.inner.predict_s(shape)
        if len(shape.prefills) == 1 and shape.prefills[0].num_new_tokens == self.dip and not shape.decode_context_tokens:
            return t + 10.0
        return t


def test_the_floor_is_below_every_estimate_and_absent_for_a_latency_that_dips() -> None:
    """:meth:`EngineCluster.prefill_completion_floor_s` with no work queued is never above the estimate with
    any queued work (windows 0 and 3000, uncached work within and past a window), at least one floor is
    the estimate itself (work queued 0), and a latency model whose chunk time falls somewhere has none."""
    run = FakeRun(FakeScenario.from_dict(_FIELDS), ShadowConfig(PluginRef("no-shadow"), seed=2))
    insts = list(run.cluster.by_id.values())
    dipped = insts[-1]
    dipped.latency = _Dip(dipped.latency)
    run.loop.now_s = 2.25
    exact = 0
    for window in (0, 3000):
        cluster = EngineCluster(run.loop, run.cluster.by_model, run.cluster.by_id, window)
        for uncached in (0, 1, 299, 300, 2048, 2049, 2999, 3000, 3001, 6001, 9100):
            for inst in insts:
                floor = cluster.prefill_completion_floor_s(inst.instance_id, uncached)
                if inst is dipped:
                    assert floor == -math.inf
                    continue
                for queued in (0, 1, 300, 2047, 2048, 2999, 3000, 5000, 12345):
                    inst.queued_prefill_tokens = queued
                    t = cluster.estimated_prefill_completion_s(inst.instance_id, uncached)
                    assert floor <= t, (window, inst.instance_id, uncached, queued, floor, t)
                    exact += floor == t
    assert exact > 20
    # the dip is real: one more token queued gives an earlier estimate there
    cluster = _FullReads(run.loop, run.cluster.by_model, run.cluster.by_id, 0)
    dipped.queued_prefill_tokens = 0
    assert (cluster.estimated_prefill_completion_s(dipped.instance_id, 301)
            < cluster.estimated_prefill_completion_s(dipped.instance_id, 300))
