"""Hypothesis state machines that plugin authors subclass to property-test
their KV class manager or slack controller against the core's invariants.

Two machines, each a :class:`hypothesis.stateful.RuleBasedStateMachine`:

* :class:`KVClassMachine` drives a :class:`~shadowcore.kv.KVClassManager`
  (or anything with its public API: override :meth:`KVClassMachine.make_manager`)
  through allocations, extensions, releases and time steps, and keeps an
  independent model of who holds which block.
* :class:`SlackControllerMachine` drives one :class:`~shadowcore.hook.EngineHook`
  with a stub job source and a stub engine port through snapshots and
  outcomes; override :meth:`SlackControllerMachine.make_controller` (and
  optionally ``make_latency_model``, ``make_port``, ``make_job_source``).

Each machine checks a set of named invariants (``checks``; all by default).
The tests of the core enable one at a time, so that a failure names the
invariant; a plugin author usually keeps them all::

    from hypothesis import Phase, settings
    from hypothesis import strategies as st
    from shadowcore.testing.machines import SlackControllerMachine

    class MyControllerMachine(SlackControllerMachine):
        def make_controller(self, draw):
            return MyController(beta=draw(st.floats(0.1, 1.0)))

    MyControllerMachine.TestCase.settings = settings(
        max_examples=50, stateful_step_count=25, deadline=None,
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],  # no slow "explain"
    )
    TestMyController = MyControllerMachine.TestCase

A controller that is not one of the shipped ones should also override the
expectations the machine cannot guess: ``idle_cap_s``,
``budget_upper_bound_s`` and ``credit_charged`` return ``None`` (check
skipped) for a controller they do not know; ``credit_delta`` reads
``controller.delta``.

This module imports hypothesis (the ``dev`` extra); :mod:`shadowcore` never
imports it. The stubs (:class:`StubEnginePort`, :class:`StubJobSource`) are
plain classes that example-based tests use too.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import attrs
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from shadowcore.hook import EngineHook
from shadowcore.job import SessionHistory, ShadowJob
from shadowcore.kv import KVClass, KVClassManager, KVClassPolicy
from shadowcore.latency import BatchShape, LatencyModel, PrefillChunk
from shadowcore.slack import (
    EagerController,
    HarvestController,
    NoShadowController,
    PrefillInstanceController,
    SlackController,
    SloSlackController,
)
from shadowcore.testing import strategies as sst
from shadowcore.types import JobKey, Phase, StepOutcome, StepPlan, StepSnapshot

Draw = Callable[[st.SearchStrategy[Any]], Any]

#: Absolute tolerance (seconds) of every time comparison.
EPS_S = 1e-9


def _pick(data: st.DataObject, items: Sequence[Any]) -> Any:
    """One of ``items`` (an index draw: no strategy object built per call)."""
    return items[data.draw(st.integers(0, len(items) - 1))]


# =====================================================================================
# KV classes
# =====================================================================================
KV_CHECKS = frozenset({"cap", "shadow_first", "lru", "young", "host", "liveness"})


@attrs.frozen
class _KVView:
    """What the public API shows about the pool, over every hash the machine used."""

    cached: dict[int, KVClass]
    idle: dict[KVClass, list[int]]
    host: frozenset[int]
    num_free: int
    num_shadow: int
    num_host: int

    @property
    def idle_set(self) -> set[int]:
        return {h for c in KVClass for h in self.idle[c]}


class KVClassMachine(RuleBasedStateMachine):
    """Drives a KV class manager; checks, besides its own model's consistency:

    Always (consistency of the pool with an independent model of the owners):
      * every block some owner holds is cached on the device (in-use blocks are
        never evicted), and the idle lists hold exactly the cached blocks no
        owner holds, each once, with ``idle_since`` = the time of its release;
      * ``free + cached + private == num_blocks``; the shadow counter equals the
        shadow-class cached blocks plus shadow owners' private blocks;
      * the device and the host tier hold disjoint blocks;
      * an allocation evicts only idle blocks outside its own chain, returns
        ``None`` only with the pool unchanged, hits exactly the cached device
        prefix, leaves every block of its chain cached (a normal requester's in
        the normal class), and an extension spills nothing it just took.

    ``"cap"``: shadow blocks (in use + cached + private) <= ``cap_blocks``, and
    ``shadow_room_blocks`` never exceeds the room left under the cap.

    ``"shadow_first"`` (policies with ``eviction_order="shadow-first"``): no
    normal block is evicted while an evictable idle shadow block exists -- for a
    normal requester any idle shadow block outside the allocation's own chain,
    for a shadow requester one idle for more than ``cold_age_s``.

    ``"lru"``: within each class the evicted blocks are the least recently
    released of the eligible idle ones (ties in release time in any order), and
    ``idle_order`` lists each class by non-decreasing release time; with
    ``eviction_order="lru"`` the same holds across both classes together.

    ``"young"``: a shadow allocation never evicts a block idle for
    ``<= cold_age_s`` (of either class).

    ``"host"``: the host tier never holds more than its capacity (in whole
    blocks); every evicted block is spilled unless the tier is full; a hit on
    it costs exactly ``num_host_hit_blocks * block_size * kv_bytes_per_token /
    pcie_bytes_per_s`` and moves the blocks back to the device.

    ``"liveness"``: an allocation succeeds whenever free plus evictable blocks
    suffice (and, for a shadow requester, the cap allows it: shadow blocks now
    + new blocks <= cap); ``shadow_room_blocks`` is exactly
    ``min(cap room, free + cold idle blocks)``.

    Subclass hooks: :meth:`make_manager` (the implementation under test; it
    must expose ``num_blocks``, ``block_size``, ``kv_bytes_per_token``,
    ``policy``, ``cap_blocks``, ``host_capacity_blocks`` and the query methods
    of :class:`~shadowcore.kv.KVClassManager`), ``checks``,
    ``shadow_probability``, ``max_new_blocks``.
    """

    checks: ClassVar[frozenset[str]] = KV_CHECKS
    #: chance that an allocation is for a shadow owner
    shadow_probability: ClassVar[float] = 0.5
    #: fresh blocks per new chain, at most
    max_new_blocks: ClassVar[int] = 4
    #: host tier: True always, False never, None sometimes
    host: ClassVar[bool | None] = None
    #: shadow cap fractions to draw from (None: any in (0, 1])
    cap_fractions: ClassVar[st.SearchStrategy[float] | None] = None

    def __init__(self) -> None:
        super().__init__()
        self.kv: Any = None

    # -- factory -------------------------------------------------------------------
    def make_manager(self, draw: Draw) -> Any:
        """The manager under test, built from hypothesis draws."""
        block_size = draw(st.sampled_from([1, 2, 16]))
        kv_bytes = draw(st.sampled_from([1.0, 3.0, 131072.0]) | st.floats(1.0, 1e6))
        policy = self.make_policy(draw, block_size * kv_bytes)
        return KVClassManager(draw(st.integers(4, 16)), block_size, policy, kv_bytes)

    def make_policy(self, draw: Draw, block_bytes: float) -> KVClassPolicy:
        """The class rules (cap, cold age, host tier of a few blocks)."""
        policy = draw(sst.kv_policies(host=self.host, block_bytes=block_bytes))
        if self.cap_fractions is not None:
            policy = attrs.evolve(policy, shadow_cap_fraction=draw(self.cap_fractions))
        return policy

    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        self.kv = self.make_manager(data.draw)
        self.now = 0.0
        self.owners: dict[str, tuple[KVClass, list[int], int]] = {}  # class, chain, private blocks
        self.refs: Counter[int] = Counter()
        self.idle_since: dict[int, float] = {}
        self.chains: list[tuple[int, ...]] = []
        self.universe: set[int] = set()
        self.next_hash = 1
        self.next_owner = 0

    # -- helpers -------------------------------------------------------------------
    @property
    def cold_age_s(self) -> float:
        return self.kv.policy.cold_age_s

    @property
    def block_bytes(self) -> float:
        return self.kv.block_size * self.kv.kv_bytes_per_token

    def expected_host_capacity_blocks(self) -> int:
        host = self.kv.policy.host
        return 0 if host is None else int(host.capacity_bytes // self.block_bytes)

    def _observe(self) -> _KVView:
        kv = self.kv
        cached = {h: kv.class_of(h) for h in sorted(self.universe) if kv.is_cached(h)}
        idle = {c: list(kv.idle_order(c)) for c in KVClass}
        host = frozenset(h for h in self.universe if kv.in_host(h))
        return _KVView(cached, idle, host, kv.num_free_blocks, kv.num_shadow_blocks, kv.num_host_blocks)

    def _age(self, h: int) -> float:
        return self.now - self.idle_since[h]

    def _is_cold(self, h: int) -> bool:
        return self._age(h) > self.cold_age_s

    def _private(self, kv_class: KVClass | None = None) -> int:
        return sum(p for c, _, p in self.owners.values() if kv_class is None or c is kv_class)

    def _model_shadow(self, view: _KVView) -> int:
        return sum(1 for c in view.cached.values() if c is KVClass.SHADOW) + self._private(KVClass.SHADOW)

    def _evictable(self, view: _KVView, chain: list[int], requester: KVClass) -> list[int]:
        own = set(chain)
        return [
            h for h in view.idle_set
            if h not in own and (requester is KVClass.NORMAL or self._is_cold(h))
        ]

    def _feasible(self, view: _KVView, chain: list[int], num_new: int, requester: KVClass) -> bool:
        if requester is KVClass.SHADOW and self._model_shadow(view) + num_new > self.kv.cap_blocks:
            return False
        return num_new <= view.num_free + len(self._evictable(view, chain, requester))

    def _check_evictions(self, pre: _KVView, post: _KVView, chain: list[int], requester: KVClass) -> None:
        evicted = set(pre.cached) - set(post.cached)
        idle_pre = pre.idle_set
        own = set(chain)
        for h in evicted:
            assert h in idle_pre, f"block {h} was in use (or not idle) and got evicted"
            assert h not in own, f"block {h} of the allocation's own chain got evicted"
        if requester is KVClass.SHADOW and "young" in self.checks:
            young = sorted(h for h in evicted if not self._is_cold(h))
            assert not young, (
                f"shadow allocation at t={self.now} evicted blocks idle for <= cold_age_s={self.cold_age_s}: "
                f"{[(h, self._age(h)) for h in young]}"
            )
        eligible = set(self._evictable(pre, chain, requester))
        lru_order = self.kv.policy.eviction_order == "lru"
        if "shadow_first" in self.checks and not lru_order and any(pre.cached[h] is KVClass.NORMAL for h in evicted):
            left = sorted(h for h in eligible - evicted if pre.cached[h] is KVClass.SHADOW)
            assert not left, (
                f"{requester.value} allocation evicted normal blocks "
                f"{sorted(h for h in evicted if pre.cached[h] is KVClass.NORMAL)} "
                f"while evictable idle shadow blocks {left} remained"
            )
        if "lru" in self.checks:
            for c in (None,) if lru_order else KVClass:  # None: both classes as one LRU
                gone = {h for h in evicted if c is None or pre.cached[h] is c}
                kept = {h for h in eligible - evicted if c is None or pre.cached[h] is c}
                if gone and kept:
                    newest_gone = max(self.idle_since[h] for h in gone)
                    oldest_kept = min(self.idle_since[h] for h in kept)
                    assert newest_gone <= oldest_kept, (
                        f"{'one-LRU' if c is None else c.value} eviction not LRU: evicted {sorted(gone)} (released up to t={newest_gone}) "
                        f"but kept {sorted(kept)} (released from t={oldest_kept})"
                    )
        if "host" in self.checks:
            capacity = self.expected_host_capacity_blocks()
            for h in evicted:
                assert h in post.host or len(post.host) >= capacity, (
                    f"evicted block {h} was not spilled to a host tier with room "
                    f"({len(post.host)}/{capacity} blocks)"
                )

    def _new_chain(self, data: st.DataObject) -> list[int]:
        """A known chain with blocks in the host tier (a reload) one time in
        four when there is one, otherwise :func:`~shadowcore.testing.strategies.hash_chains`."""
        spilled = [c for c in self.chains if any(self.kv.in_host(h) for h in c)]
        if spilled and data.draw(st.integers(0, 3), label="reload") == 0:
            return list(_pick(data, spilled))
        return sst.draw_hash_chain(data.draw, self.chains, next_hash=self.next_hash, max_new=self.max_new_blocks)

    def _remember(self, chain: list[int]) -> None:
        self.universe.update(chain)
        if chain:
            self.chains.append(tuple(chain))
            self.next_hash = max(self.next_hash, max(chain) + 1)

    # -- rules ---------------------------------------------------------------------
    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        requester = KVClass.SHADOW if data.draw(st.floats(0, 1)) < self.shadow_probability else KVClass.NORMAL
        chain = self._new_chain(data)
        private = data.draw(st.integers(0, 1 if requester is KVClass.SHADOW else 2))
        owner = f"o{self.next_owner}"
        self.next_owner += 1
        pre = self._observe()
        n_dev = 0
        while n_dev < len(chain) and chain[n_dev] in pre.cached:
            n_dev += 1
        n_host = 0
        if self.kv.policy.host is not None:
            while n_dev + n_host < len(chain) and chain[n_dev + n_host] in pre.host:
                n_host += 1
        fresh = [h for h in chain[n_dev:] if h not in pre.cached]
        feasible = self._feasible(pre, chain, len(fresh) + private, requester)

        alloc = self.kv.allocate(owner, chain, private, requester, self.now)
        self._remember(chain)
        post = self._observe()
        if alloc is None:
            assert post == pre, "a failed allocation changed the pool"
            if "liveness" in self.checks:
                assert not feasible, (
                    f"{requester.value} allocation of {len(fresh)}+{private} blocks refused although "
                    f"{pre.num_free} free and {len(self._evictable(pre, chain, requester))} evictable"
                )
            return
        self.owners[owner] = (requester, list(chain), private)
        self.refs.update(chain)
        self._check_evictions(pre, post, chain, requester)
        self._check_allocation(alloc, pre, post, chain, fresh, n_dev, n_host, requester)
        if data.draw(st.booleans(), label="transient"):  # a short-lived owner: done right away
            self.pool_is_consistent()  # the invariants hold in between, too
            self._release(owner)

    def _check_allocation(self, alloc: Any, pre: _KVView, post: _KVView, chain: list[int], fresh: list[int],
                          n_dev: int, n_host: int, requester: KVClass) -> None:
        assert alloc.num_device_hit_blocks == n_dev, (alloc, n_dev)
        for h in chain:
            assert h in post.cached, f"block {h} of the new owner is not cached"
            if requester is KVClass.NORMAL:
                assert post.cached[h] is KVClass.NORMAL, f"normal owner holds shadow block {h}"
            elif h in fresh:
                assert post.cached[h] is KVClass.SHADOW, f"new block {h} of a shadow owner is {post.cached[h]}"
            else:
                assert post.cached[h] is pre.cached[h], f"shadow hit changed the class of block {h}"
        if "host" in self.checks:
            host = self.kv.policy.host
            assert alloc.num_host_hit_blocks == n_host, (alloc, n_host)
            expected = 0.0 if host is None else (
                n_host * self.kv.block_size * self.kv.kv_bytes_per_token / host.pcie_bytes_per_s
            )
            assert math.isclose(alloc.reload_s, expected, rel_tol=1e-12, abs_tol=0.0), (
                f"reload of {n_host} host blocks cost {alloc.reload_s}s, expected {expected}s"
            )
            for h in chain[n_dev : n_dev + n_host]:
                assert h not in post.host, f"reloaded block {h} is still in the host tier"

    @precondition(lambda self: bool(self.owners))
    @rule(data=st.data())
    def extend(self, data: st.DataObject) -> None:
        owner = _pick(data, sorted(self.owners))
        requester, chain, _ = self.owners[owner]
        longer = [c for c in self.chains if len(c) > len(chain) and list(c[: len(chain)]) == chain]
        new: list[int] = []
        if longer and data.draw(st.booleans()):
            other = _pick(data, longer)
            new = list(other[len(chain) : len(chain) + data.draw(st.integers(1, len(other) - len(chain)))])
        n_fresh = data.draw(st.integers(0, 3))
        new += list(range(self.next_hash, self.next_hash + n_fresh))
        private = data.draw(st.integers(0, 1))
        pre = self._observe()
        fresh = [h for h in new if h not in pre.cached]
        feasible = self._feasible(pre, new, len(fresh) + private, requester)

        ok = self.kv.extend(owner, new, private, self.now)
        self.universe.update(new)
        if new:
            self.next_hash = max(self.next_hash, max(new) + 1)
        post = self._observe()
        if not ok:
            assert post == pre, "a failed extension changed the pool"
            if "liveness" in self.checks:
                assert not feasible, f"extension of {len(fresh)}+{private} blocks refused although it fits"
            return
        self.owners[owner] = (requester, chain + new, self.owners[owner][2] + private)
        self.refs.update(new)
        self.chains.append(tuple(chain + new))
        self._check_evictions(pre, post, new, requester)
        for h in new:
            assert h in post.cached and h not in post.host, f"extended block {h} not on the device only"

    @precondition(lambda self: bool(self.owners))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        self._release(_pick(data, sorted(self.owners)))

    def _release(self, owner: str) -> None:
        _, chain, _ = self.owners.pop(owner)
        self.kv.release(owner, self.now)
        self.refs.subtract(chain)
        for h in chain:
            if self.refs[h] == 0:
                self.idle_since[h] = self.now

    @rule(data=st.data())
    def advance_time(self, data: st.DataObject) -> None:
        """Time moves forward only; steps of exactly ``cold_age_s`` are likely."""
        cold = self.cold_age_s
        if data.draw(st.booleans()):
            self.now += cold
        else:
            self.now += data.draw(st.integers(0, int((2 * cold + 2.0) / sst.TIME_QUANTUM_S))) * sst.TIME_QUANTUM_S

    # -- invariants ----------------------------------------------------------------
    @invariant()
    def pool_is_consistent(self) -> None:
        if self.kv is None:
            return
        kv = self.kv
        view = self._observe()
        held = {h for h, n in self.refs.items() if n > 0}
        missing = sorted(held - set(view.cached))
        assert not missing, f"blocks {missing} are held by an owner but not cached"
        for c in KVClass:
            expected = {h for h, k in view.cached.items() if k is c and h not in held}
            assert len(view.idle[c]) == len(set(view.idle[c])), f"duplicate in idle list of {c.value}"
            assert set(view.idle[c]) == expected, (
                f"idle {c.value} list {sorted(view.idle[c])} != cached unheld {c.value} blocks {sorted(expected)}"
            )
            for h in view.idle[c]:
                assert kv.idle_since(h) == self.idle_since[h], (h, kv.idle_since(h), self.idle_since[h])
            if "lru" in self.checks:
                times = [self.idle_since[h] for h in view.idle[c]]
                assert times == sorted(times), f"idle order of {c.value} is not least recently released first"
        assert view.num_free >= 0
        assert kv.num_cached_blocks == len(view.cached)
        assert view.num_free + kv.num_cached_blocks + self._private() == kv.num_blocks, (
            f"free {view.num_free} + cached {kv.num_cached_blocks} + private {self._private()} "
            f"!= {kv.num_blocks} blocks"
        )
        shadow = self._model_shadow(view)
        assert view.num_shadow == shadow, f"shadow counter {view.num_shadow} != {shadow} shadow blocks"
        both = sorted(set(view.cached) & view.host)
        assert not both, f"blocks {both} are both on the device and in the host tier"
        room = kv.shadow_room_blocks(self.now)
        if "cap" in self.checks:
            assert shadow <= kv.cap_blocks, f"{shadow} shadow blocks exceed the cap of {kv.cap_blocks}"
            assert room <= max(0, kv.cap_blocks - shadow), (room, kv.cap_blocks, shadow)
        if "liveness" in self.checks:
            cold_idle = sum(1 for h in view.idle_set if self._is_cold(h))
            expected_room = max(0, min(kv.cap_blocks - shadow, view.num_free + cold_idle))
            assert room == expected_room, f"shadow_room_blocks {room} != {expected_room}"
        if "host" in self.checks:
            capacity = self.expected_host_capacity_blocks()
            assert kv.host_capacity_blocks == capacity
            assert view.num_host <= capacity and len(view.host) <= capacity, (
                f"host tier holds {view.num_host} blocks, capacity {capacity}"
            )


# =====================================================================================
# Slack controller + engine hook
# =====================================================================================
SLACK_CHECKS = frozenset({"gate", "budget", "idle", "credit", "grants", "order", "liveness"})
_KINDS = st.sampled_from(("idle", "idle", "routed", "routed", "decode", "decode", "any", "waiting", "blocked"))


class StubEnginePort:
    """An :class:`~shadowcore.hook.EnginePort` with a settable cache: per session,
    the epoch and number of tokens the instance holds, plus an eviction counter."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.evictions = 0
        self.cached: dict[str, tuple[int, int]] = {}

    def cached_prefix_tokens(self, history: SessionHistory) -> int:
        epoch, n = self.cached.get(history.session_id, (history.epoch, 0))
        return min(n, history.num_tokens) if epoch == history.epoch else 0

    def eviction_count(self) -> int:
        return self.evictions

    def evict(self, session_id: str, keep_tokens: int) -> None:
        epoch, n = self.cached.get(session_id, (0, 0))
        self.cached[session_id] = (epoch, min(n, keep_tokens))
        self.evictions += 1

    def computed(self, history: SessionHistory, epoch: int, start: int, num_tokens: int) -> None:
        """An engine computed ``[start, start + num_tokens)`` of ``history``; it
        caches the whole blocks of it."""
        if num_tokens <= 0 or epoch != history.epoch:
            return
        e, n = self.cached.get(history.session_id, (epoch, 0))
        if e != epoch:
            n = 0
        end = start + num_tokens
        end -= end % self.block_size
        if start <= n:
            self.cached[history.session_id] = (epoch, max(n, end))


@attrs.frozen
class ServedJob:
    """A job as the job source handed it to the hook (before planning)."""

    key: JobKey
    switch_probability: float
    epoch: int
    next_token: int
    num_missing_tokens: int


class StubJobSource:
    """The part of :class:`~shadowcore.manager.ShadowManager` a hook uses:
    ``pending_jobs`` (jobs with missing tokens, highest switch probability
    first, ties by creation order) and ``job``. Records what it served last."""

    def __init__(self) -> None:
        self._jobs: dict[JobKey, ShadowJob] = {}
        self.served: list[ServedJob] | None = None

    def add(self, job: ShadowJob) -> None:
        self._jobs[job.key] = job

    def remove(self, key: JobKey) -> None:
        self._jobs.pop(key, None)

    def all(self) -> list[ShadowJob]:
        return list(self._jobs.values())

    def pending_jobs(self, instance_id: str) -> list[ShadowJob]:
        jobs = [j for j in self._jobs.values() if j.instance_id == instance_id and j.num_missing_tokens > 0]
        jobs.sort(key=lambda j: (-j.switch_probability, j.sequence))
        self.served = [
            ServedJob(j.key, j.switch_probability, j.epoch, j.next_token, j.num_missing_tokens) for j in jobs
        ]
        return jobs

    def job(self, key: JobKey) -> ShadowJob | None:
        return self._jobs.get(key)


def decode_slack_reference_s(r: Any, now_s: float, margin: float) -> float:
    """Eq. 1, written out independently of :mod:`shadowcore.slack`."""
    k, f, t_r = r.num_decode_steps, r.first_token_s, r.tpot_slo_s
    return (1.0 - margin) * t_r * (k + 1) - (now_s - f)


def prefill_slack_reference_s(r: Any, now_s: float, margin: float, latency: LatencyModel, chunk: int) -> float:
    """``(1-m) F_r - (t - a_r) - p_r`` with ``p_r`` the remaining chunks run alone."""
    rest, ctx, p = r.num_remaining_prefill_tokens, r.num_context_tokens + r.num_scheduled_tokens, 0.0
    while rest > 0:
        n = min(chunk, rest)
        p += latency.predict_s(BatchShape((PrefillChunk(n, ctx),)))
        ctx, rest = ctx + n, rest - n
    return (1.0 - margin) * r.ttft_slo_s - (now_s - r.arrival_s) - p


class SlackControllerMachine(RuleBasedStateMachine):
    """Drives one :class:`~shadowcore.hook.EngineHook` (controller, latency
    model, stub port, stub job source) through snapshots and outcomes, with
    jobs opened, grown, re-prioritised, compacted, evicted and closed in
    between. Per iteration it checks (predictions recomputed with the latency
    model from the snapshot and the grants, never taken from the plan):

    ``"gate"``: no shadow tokens while ``num_waiting > 0`` or
    ``admission_blocked`` (unless the controller is ``normal_priority``, Eager).

    ``"budget"``: the plan reports the predictions truthfully; with shadow
    tokens the predicted iteration fits the budget -- the whole iteration for
    slack/idle budgets, the added time (stretch) for credit budgets
    (``bounds_stretch``); and for the shipped controllers the budget itself is
    at most the paper's bound (``beta*T``; ``min(beta*T, min_r sigma_r)`` by an
    independent Eq. 1 for SLO slack; 0 when gated). See
    :meth:`budget_upper_bound_s`.

    ``"idle"``: a shadow-only iteration on an idle instance is predicted to
    last at most ``beta*T`` (:meth:`idle_cap_s`).

    ``"credit"``: the cumulative predicted stretch of the iterations the credit
    pays for (Harvest-SLO: those carrying a routed call; Harvest: every busy
    one; :meth:`credit_charged`) is at most ``delta`` times the cumulative
    measured duration of decode-only iterations (decode-only batch, no shadow
    token computed), + ``EPS_S``.

    ``"grants"``: grants are whole blocks (start and length), to distinct jobs,
    start where the job's held prefix ends, in the job's epoch and with its
    probability, never exceed a job's missing tokens, the token budget or the
    shadow KV room; a non-empty plan has at least ``n_min`` tokens; a zero
    budget gives no grants.

    ``"order"``: grants come in non-increasing switch probability, and follow
    the job source's order greedily (each job before the last is fully served).

    ``"liveness"``: the plan is maximal (Algorithm 1, line 10): one more block
    would not fit the budget, or the limits are reached; an empty plan under a
    positive budget means even ``max(n_min, 1 block)`` tokens would not fit.

    Subclass hooks: :meth:`make_controller`, :meth:`make_latency_model`,
    :meth:`make_port`, :meth:`make_job_source`, :meth:`snapshot_kinds`; the job
    actions (``open_job``, ``grow_job``, ``reprioritise_job``, ``compact_job``,
    ``evict_job``, ``close_job``); and the expectations :meth:`idle_cap_s`,
    :meth:`budget_upper_bound_s`, :meth:`credit_charged`, :meth:`credit_delta`.
    """

    checks: ClassVar[frozenset[str]] = SLACK_CHECKS
    instance_id: ClassVar[str] = "i0"

    def __init__(self) -> None:
        super().__init__()
        self.hook: EngineHook | None = None

    # -- factories -----------------------------------------------------------------
    def make_controller(self, draw: Draw) -> SlackController:
        """The controller under test (default: any shipped one, random parameters)."""
        return draw(sst.slack_controllers(n_min=st.sampled_from([0, self.block_size, 64, 256])))

    def make_latency_model(self, draw: Draw) -> LatencyModel:
        return draw(sst.latency_models())

    def make_port(self, draw: Draw) -> Any:
        return StubEnginePort(self.block_size)

    def make_job_source(self, draw: Draw) -> Any:
        return StubJobSource()

    def snapshot_kinds(self) -> st.SearchStrategy[str]:
        """Which kind of snapshot each step shows."""
        return _KINDS

    # -- expectations for the shipped controllers -----------------------------------
    def idle_cap_s(self, snapshot: StepSnapshot) -> float | None:
        """The longest an idle shadow-only iteration may be predicted to last."""
        c = self.controller
        if isinstance(c, (SloSlackController, HarvestController)):
            return c.beta * snapshot.tpot_slo_s
        if isinstance(c, PrefillInstanceController):
            return c.max_iteration_s
        if isinstance(c, NoShadowController):
            return 0.0
        return None

    def budget_upper_bound_s(self, snapshot: StepSnapshot) -> float | None:
        """An independent upper bound of the controller's budget (None: unknown)."""
        c = self.controller
        gated = snapshot.num_waiting > 0 or snapshot.admission_blocked
        if isinstance(c, NoShadowController):
            return 0.0
        if isinstance(c, EagerController):
            return math.inf
        if gated:
            return 0.0
        if isinstance(c, HarvestController):
            return c.beta * snapshot.tpot_slo_s
        if isinstance(c, SloSlackController):
            cap = c.beta * snapshot.tpot_slo_s
            if snapshot.is_idle or snapshot.has_routed:
                return cap
            return max(0.0, min(cap, self._min_slack(snapshot, c.margin, c.chunk_tokens)))
        if isinstance(c, PrefillInstanceController):
            return max(0.0, min(c.max_iteration_s, self._min_slack(snapshot, c.margin, c.chunk_tokens)))
        return None

    def credit_charged(self, snapshot: StepSnapshot) -> bool | None:
        """Whether the credit pays for shadow tokens in this iteration (None: no credit)."""
        c = self.controller
        if isinstance(c, SloSlackController):
            return snapshot.has_routed
        if isinstance(c, HarvestController):
            return not snapshot.is_idle
        return None

    def credit_delta(self) -> float:
        return float(self.controller.delta)

    def _min_slack(self, snapshot: StepSnapshot, margin: float, chunk: int) -> float:
        out = math.inf
        for r in snapshot.batch:
            if r.phase is Phase.DECODE:
                out = min(out, decode_slack_reference_s(r, snapshot.now_s, margin))
            else:
                out = min(out, prefill_slack_reference_s(r, snapshot.now_s, margin, self.latency, chunk))
        return out

    # -- setup ---------------------------------------------------------------------
    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        self.block_size = data.draw(st.sampled_from([1, 4, 16]), label="block_size")
        self.tpot_s = data.draw(st.floats(0.02, 0.1), label="tpot_slo_s")
        self.latency = self.make_latency_model(data.draw)
        self.controller = self.make_controller(data.draw)
        self.port = self.make_port(data.draw)
        self.jobs = self.make_job_source(data.draw)
        self.hook = EngineHook(self.instance_id, self.jobs, self.controller, self.latency, self.port)
        self.now = 0.0
        self.iteration = 0
        self.next_session = 0
        self.charged_stretch_s = 0.0
        self.decode_only_s = 0.0
        for _ in range(data.draw(st.integers(0, 3), label="initial jobs")):
            self.open_job(data)

    def _live(self) -> list[ShadowJob]:
        return sorted(self.jobs.all(), key=lambda j: j.sequence)

    # -- job rules -----------------------------------------------------------------
    # One rule picks one of the actions below, so that most machine steps are
    # engine iterations (hypothesis picks rules roughly uniformly).
    @rule(data=st.data())
    def change_jobs(self, data: st.DataObject) -> None:
        live = self._live()
        actions = ["open", "open"] + (["grow", "grow", "reprioritise", "compact", "evict", "close"] if live else [])
        action = _pick(data, actions)
        if action == "open":
            self.open_job(data)
            return
        job = _pick(data, live)
        getattr(self, action + "_job")(job, data)

    def open_job(self, data: st.DataObject) -> None:
        sid = f"s{self.next_session}"
        history = SessionHistory(sid)
        history.append(data.draw(st.integers(0, 8192)))
        job = ShadowJob(
            JobKey(sid, "B"), self.instance_id, history, self.block_size,
            switch_probability=data.draw(sst.probabilities()), sequence=self.next_session, epoch=history.epoch,
        )
        self.next_session += 1
        if data.draw(st.integers(0, 3)) == 0:  # the instance already holds part of the history
            self.port.cached[sid] = (history.epoch, data.draw(st.integers(0, history.num_tokens)))
        self.jobs.add(job)

    def grow_job(self, job: ShadowJob, data: st.DataObject) -> None:
        """Streamed output or a new call's input extends the history."""
        job.history.append(data.draw(st.integers(0, 2048)))

    def reprioritise_job(self, job: ShadowJob, data: st.DataObject) -> None:
        job.switch_probability = data.draw(sst.probabilities())

    def compact_job(self, job: ShadowJob, data: st.DataObject) -> None:
        job.history.compact(data.draw(st.integers(0, 1024)))

    def evict_job(self, job: ShadowJob, data: st.DataObject) -> None:
        self.port.evict(job.key.session_id, data.draw(st.integers(0, job.history.num_tokens)))

    def close_job(self, job: ShadowJob, data: st.DataObject) -> None:
        self.jobs.remove(job.key)

    # -- the iteration ---------------------------------------------------------------
    @rule(data=st.data())
    def steps(self, data: st.DataObject) -> None:
        """One to three engine iterations."""
        for _ in range(data.draw(st.integers(1, 3), label="iterations")):
            self.step(data)

    def step(self, data: st.DataObject) -> None:
        kind = data.draw(self.snapshot_kinds(), label="kind")
        self.now += data.draw(st.floats(0.0, 0.2))
        self.iteration += 1
        opts: dict[str, Any] = {"waiting": False, "blocked": False}
        if kind == "idle":
            opts["idle"] = True
        elif kind == "routed":
            opts["has_routed"] = True
        elif kind == "decode":
            opts.update(decode_only=True, has_routed=data.draw(st.booleans()))
        elif kind == "waiting":
            opts.update(waiting=True, blocked=None)
        elif kind == "blocked":
            opts.update(blocked=True, waiting=None)
        else:
            opts.update(waiting=None, blocked=None)
        snapshot = sst.draw_snapshot(
            data.draw, instance_id=self.instance_id, iteration=self.iteration, now_s=self.now,
            tpot_slo_s=self.tpot_s, max_batch=4, max_free_token_budget=4096, **opts,
        )
        if hasattr(self.jobs, "served"):
            self.jobs.served = None
        plan = self.hook.begin_step(snapshot)
        base_s, predicted_s = self._check_plan(snapshot, plan)
        outcome = sst.draw_step_outcome(data.draw, plan, block_size=self.block_size)
        self.hook.end_step(outcome)
        for r in outcome.results:
            job = self.jobs.job(r.grant.job)
            if job is not None:
                self.port.computed(job.history, r.grant.epoch, r.grant.start_token, r.num_computed_tokens)
        self._check_credit(snapshot, plan, outcome, predicted_s - base_s)
        live = self._live()
        if live and data.draw(st.booleans(), label="stream"):  # a routed call streams output meanwhile
            self.grow_job(_pick(data, live), data)

    # -- checks ----------------------------------------------------------------------
    def _predict(self, snapshot: StepSnapshot, chunks: tuple[PrefillChunk, ...]) -> tuple[float, float]:
        base = snapshot.batch_shape
        return self.latency.predict_s(base), self.latency.predict_s(base.with_prefills(chunks))

    def _check_plan(self, snapshot: StepSnapshot, plan: StepPlan) -> tuple[float, float]:
        grants = plan.grants
        total = plan.num_shadow_tokens
        chunks = tuple(PrefillChunk(g.num_tokens, g.start_token) for g in grants)
        base_s, predicted_s = self._predict(snapshot, chunks)
        gated = snapshot.num_waiting > 0 or snapshot.admission_blocked
        if "gate" in self.checks and gated and not self.controller.normal_priority:
            assert total == 0, (
                f"{total} shadow tokens planned with {snapshot.num_waiting} waiting, "
                f"admission_blocked={snapshot.admission_blocked} ({plan.budget})"
            )
        if "budget" in self.checks:
            assert math.isclose(plan.predicted_base_s, base_s, rel_tol=1e-9, abs_tol=EPS_S), (plan, base_s)
            assert math.isclose(plan.predicted_s, predicted_s, rel_tol=1e-9, abs_tol=EPS_S), (plan, predicted_s)
            if grants:
                used = predicted_s - base_s if plan.budget.bounds_stretch else predicted_s
                assert used <= plan.budget.budget_s + EPS_S, (
                    f"{'stretch' if plan.budget.bounds_stretch else 'iteration'} {used}s with {total} shadow tokens "
                    f"exceeds the budget {plan.budget}"
                )
            bound = self.budget_upper_bound_s(snapshot)
            if bound is not None:
                assert plan.budget.budget_s <= bound + EPS_S, f"budget {plan.budget} above the bound {bound}s"
        if "idle" in self.checks and snapshot.is_idle and grants:
            cap = self.idle_cap_s(snapshot)
            if cap is not None:
                assert predicted_s <= cap + EPS_S, (
                    f"idle shadow-only iteration predicted {predicted_s}s > cap {cap}s ({total} tokens)"
                )
        served = getattr(self.jobs, "served", None)
        if "grants" in self.checks:
            bs = self.block_size
            if plan.budget.budget_s <= 0:
                assert not grants, f"grants under a zero budget: {plan}"
            for g in grants:
                assert g.num_tokens % bs == 0 and g.start_token % bs == 0, f"grant {g} is not whole blocks of {bs}"
            assert len({g.job for g in grants}) == len(grants), "two grants for one job"
            if grants:
                assert total >= self.controller.n_min, f"{total} shadow tokens < n_min {self.controller.n_min}"
            assert total <= min(snapshot.num_free_token_budget, snapshot.num_shadow_room_tokens), (
                total, snapshot.num_free_token_budget, snapshot.num_shadow_room_tokens,
            )
            if served is not None:
                by_key = {s.key: s for s in served}
                for g in grants:
                    s = by_key.get(g.job)
                    assert s is not None, f"grant {g} for a job that was not pending"
                    assert (g.epoch, g.start_token) == (s.epoch, s.next_token), (g, s)
                    assert g.num_tokens <= s.num_missing_tokens, (g, s)
                    assert g.switch_probability == s.switch_probability, (g, s)
        if "order" in self.checks:
            ps = [g.switch_probability for g in grants]
            assert all(a >= b for a, b in itertools.pairwise(ps)), f"grants not in non-increasing switch probability: {ps}"
            if served is not None:
                sp = [s.switch_probability for s in served]
                assert all(a >= b for a, b in itertools.pairwise(sp)), f"job source order not non-increasing: {sp}"
                assert [g.job for g in grants] == [s.key for s in served[: len(grants)]], (
                    "grants do not follow the job order", grants, served,
                )
                for g, s in zip(grants[:-1], served):
                    assert g.num_tokens == s.num_missing_tokens, f"job {s.key} not fully served before the next"
        if "liveness" in self.checks and plan.budget.budget_s > 0:
            self._check_maximal(snapshot, plan, served, base_s)
        return base_s, predicted_s

    def _check_maximal(self, snapshot: StepSnapshot, plan: StepPlan, served: list[ServedJob] | None,
                       base_s: float) -> None:
        bs = self.block_size
        if not hasattr(self.jobs, "served"):
            return  # a job source that does not record what it served
        assert served is not None, f"positive budget {plan.budget} but the hook did not ask for jobs"
        missing = sum(s.num_missing_tokens for s in served)
        upper = min(snapshot.num_free_token_budget, snapshot.num_shadow_room_tokens, missing) // bs * bs

        def fits_clearly(n: int) -> bool:
            left, chunks = n, []
            for s in served:
                take = min(left, s.num_missing_tokens)
                if take > 0:
                    chunks.append(PrefillChunk(take, s.next_token))
                    left -= take
            t = self.latency.predict_s(snapshot.batch_shape.with_prefills(tuple(chunks)))
            used = t - base_s if plan.budget.bounds_stretch else t
            return used <= plan.budget.budget_s - EPS_S

        total = plan.num_shadow_tokens
        if total > 0:
            assert total == upper or not fits_clearly(total + bs), (
                f"plan of {total} tokens is not maximal: {total + bs} fit the budget {plan.budget} (limit {upper})"
            )
        else:
            first = max(bs, -(-self.controller.n_min // bs) * bs)
            assert first > upper or not fits_clearly(first), (
                f"empty plan although {first} tokens fit the budget {plan.budget} (limit {upper})"
            )

    def _check_credit(self, snapshot: StepSnapshot, plan: StepPlan, outcome: StepOutcome, stretch_s: float) -> None:
        if "credit" not in self.checks:
            return
        charged = self.credit_charged(snapshot)
        if charged is None:
            return
        if charged and plan.grants:
            self.charged_stretch_s += stretch_s
        if snapshot.batch_shape.is_decode_only and outcome.num_shadow_tokens == 0:
            self.decode_only_s += outcome.duration_s
        bound = self.credit_delta() * self.decode_only_s
        assert self.charged_stretch_s <= bound + EPS_S, (
            f"cumulative charged stretch {self.charged_stretch_s}s > delta * decode-only time = {bound}s"
        )


__all__ = [
    "EPS_S",
    "KV_CHECKS",
    "SLACK_CHECKS",
    "KVClassMachine",
    "ServedJob",
    "SlackControllerMachine",
    "StubEnginePort",
    "StubJobSource",
    "decode_slack_reference_s",
    "prefill_slack_reference_s",
]
