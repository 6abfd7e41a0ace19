"""The KV class machine: :class:`KVClassMachine` drives a
:class:`~shadowcore.kv.KVClassManager` (or anything with its public API)
through allocations, extensions, decode growth (``extend_private``), releases
and time steps, and keeps an
independent model of who holds which block (see the class docstring for the
named checks)."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, ClassVar

import attrs
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from shadowcore.kv import KVClass, KVClassManager, KVClassPolicy
from shadowcore.testing import strategies as sst
from shadowcore.testing.machines._base import Draw
from shadowcore.testing.machines._base import pick as _pick

__all__ = ["KV_CHECKS", "KVClassMachine"]

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

    @precondition(lambda self: any(c is KVClass.NORMAL for c, _, _ in self.owners.values()))
    @rule(data=st.data())
    def grow_private(self, data: st.DataObject) -> None:
        """Decode growth: private blocks for a few normal owners in one
        ``extend_private``, all or nothing; it fits iff free and idle blocks
        cover it (a normal owner may take any idle block)."""
        normal = sorted(o for o, (c, _, _) in self.owners.items() if c is KVClass.NORMAL)
        picked = data.draw(st.lists(st.sampled_from(normal), min_size=1, max_size=3, unique=True))
        needs = [(owner, data.draw(st.integers(1, 3))) for owner in picked]
        pre = self._observe()
        feasible = sum(n for _, n in needs) <= pre.num_free + len(self._evictable(pre, [], KVClass.NORMAL))
        ok = self.kv.extend_private(needs, self.now)
        post = self._observe()
        if not ok:
            assert post == pre, "a failed extend_private changed the pool"
            if "liveness" in self.checks:
                assert not feasible, f"extend_private of {needs} refused although it fits"
            return
        assert feasible, f"extend_private of {needs} succeeded without the blocks for it"
        for owner, n in needs:
            requester, chain, private = self.owners[owner]
            self.owners[owner] = (requester, chain, private + n)
        self._check_evictions(pre, post, [], KVClass.NORMAL)

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

