"""The shadow room the hook is offered equals a brute-force count: cap room,
capped by free blocks plus idle blocks older than the cold age. (The manager
counts cold blocks incrementally; this pins it to the definition.)"""

from __future__ import annotations

import itertools

from hypothesis import example, given, settings
from hypothesis import strategies as st

from shadowcore.kv import KVClass, KVClassManager, KVClassPolicy


def brute_force_room(kv: KVClassManager, now_s: float) -> int:
    room = kv.cap_blocks - kv.num_shadow_blocks
    if room <= 0:
        return 0
    cold = sum(
        1
        for cls in (KVClass.SHADOW, KVClass.NORMAL)
        for h in kv.idle_order(cls)
        if kv.policy.shadow_may_displace(kv.idle_since(h), now_s)
    )
    return min(room, kv.num_free_blocks + cold)


ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "shadow", "release", "tick"]),
        st.integers(0, 3),  # chain id
        st.integers(1, 12),  # chain length / time step
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=400, deadline=None)
@given(ops=ops, cap=st.sampled_from([0.1, 0.25, 1.0]), cold_age=st.sampled_from([0.0, 1.0, 5.0]),
       num_blocks=st.integers(8, 48))
# Cold idle blocks evicted by a normal allocation must leave the cold count
# (pinned: random search finds this only sometimes).
@example(ops=[("alloc", 0, 8), ("release", 0, 1), ("tick", 0, 2), ("alloc", 1, 8)], cap=1.0, cold_age=1.0,
         num_blocks=8)
# One eviction taking blocks of a cold release and of a young one must take each from its own count (pinned:
# the manager counts evicted blocks per release).
@example(ops=[("alloc", 0, 2), ("release", 0, 1), ("tick", 0, 2), ("alloc", 1, 2), ("release", 0, 1),
              ("alloc", 2, 7)], cap=1.0, cold_age=1.0, num_blocks=8)
def test_shadow_room_matches_definition(ops, cap, cold_age, num_blocks) -> None:
    kv = KVClassManager(num_blocks, 4, KVClassPolicy(cap, cold_age))
    now, owners = 0.0, []
    for step, (op, chain, n) in enumerate(ops):
        if op == "tick":
            now += n * 0.7
        elif op == "release" and owners:
            kv.release(owners.pop(chain % len(owners)), now)
        elif op in ("alloc", "shadow"):
            owner = f"o{step}"
            hashes = [chain * 1000 + i for i in range(n)]
            cls = KVClass.SHADOW if op == "shadow" else KVClass.NORMAL
            if kv.allocate(owner, hashes, 0, cls, now) is not None:
                owners.append(owner)
        assert kv.shadow_room_blocks(now) == brute_force_room(kv, now)


def test_eviction_takes_a_released_chain_tail_first() -> None:
    """What survives eviction of a released context is still a usable prefix."""
    kv = KVClassManager(6, 4, KVClassPolicy())
    chain = [11, 12, 13, 14]
    assert kv.allocate("ctx", chain, 0, KVClass.NORMAL, 0.0) is not None
    kv.release("ctx", 1.0)
    assert kv.allocate("other", [], 3, KVClass.NORMAL, 2.0) is not None  # 2 free + 1 evicted
    assert kv.match_prefix(chain).num_device_blocks == 3
    assert not kv.is_cached(14)


idle_maps = st.lists(st.tuples(st.booleans(), st.floats(0.0, 20.0, allow_nan=False)), max_size=24)


@settings(max_examples=300, deadline=None)
@given(entries=idle_maps, order=st.sampled_from(["shadow-first", "lru"]),
       requester=st.sampled_from([KVClass.NORMAL, KVClass.SHADOW]), num=st.integers(0, 30),
       protect=st.sets(st.integers(0, 23), max_size=6), now_s=st.floats(0.0, 30.0, allow_nan=False))
@example(entries=[(False, 0.0), (True, 1.0)], order="lru", requester=KVClass.NORMAL, num=1, protect=set(), now_s=0.0)
def test_victim_runs_are_the_first_victims_grouped_by_class(entries, order, requester, num, protect, now_s) -> None:
    """``victim_runs`` (the manager's eviction path, with its fast case) is
    exactly the first ``num`` of ``victims`` (the one victim rule), cut into
    runs of one class, in order."""
    idle = {KVClass.SHADOW: {}, KVClass.NORMAL: {}}
    for block, (shadow, since) in enumerate(sorted(entries, key=lambda e: e[1])):  # release order: oldest first
        idle[KVClass.SHADOW if shadow else KVClass.NORMAL][block] = since
    policy = KVClassPolicy(cold_age_s=1.0, eviction_order=order)
    expected = list(itertools.islice(policy.victims(idle, requester, now_s, protect), num))
    runs = policy.victim_runs(idle, requester, num, now_s, protect)
    assert [(block, cls) for cls, run in runs for block in run] == expected
    assert all(run for _, run in runs)
    assert all(a[0] is not b[0] for a, b in itertools.pairwise(runs))  # maximal runs


def test_a_spilled_run_keeps_the_host_tier_an_lru_of_single_spills() -> None:
    """An eviction spills its victims to the host tier as one run; the tier
    must end as if they went one at a time, each trimming the least recent:
    a run longer than the tier leaves its last blocks (a chain's head, since
    the tail goes first), a shorter one pushes out the oldest entries."""
    from shadowcore.kv import HostTierParams

    kv = KVClassManager(8, 4, KVClassPolicy(host=HostTierParams(capacity_bytes=3 * 4 * 131072.0)))
    chain = [1, 2, 3, 4, 5, 6]
    assert kv.allocate("ctx", chain, 0, KVClass.NORMAL, 0.0) is not None
    kv.release("ctx", 1.0)
    assert kv.allocate("big", [], 8, KVClass.NORMAL, 2.0) is not None  # 2 free + the whole chain, tail first
    assert kv.host_capacity_blocks == 3 and kv.num_host_blocks == 3
    assert [kv.in_host(h) for h in chain] == [True, True, True, False, False, False]
    assert kv.match_prefix(chain).num_host_blocks == 3
    kv.release("big", 3.0)  # private blocks: back to free
    assert kv.allocate("two", [7, 8], 0, KVClass.NORMAL, 4.0) is not None
    kv.release("two", 5.0)
    assert kv.allocate("fill", [], 8, KVClass.NORMAL, 6.0) is not None  # evicts 8 then 7: pushes out 3, then 2
    assert [h for h in (1, 2, 3, 7, 8) if kv.in_host(h)] == [1, 7, 8]


def test_a_trim_skips_the_host_entries_reloads_left_stale() -> None:
    """The host tier keeps its spills as runs; a reload leaves its blocks'
    entries behind (stale), and a block spilled again is the newest entry.
    Trims must still take the least recent live blocks one by one: here the
    tier ends exactly as an LRU of single spills would."""
    from shadowcore.kv import HostTierParams

    kv = KVClassManager(4, 4, KVClassPolicy(host=HostTierParams(capacity_bytes=4 * 4 * 131072.0)))
    universe = range(1, 10)

    def host() -> list[int]:
        return [h for h in universe if kv.in_host(h)]

    assert kv.allocate("a", [1, 2, 3, 4], 0, KVClass.NORMAL, 0.0) is not None
    kv.release("a", 1.0)
    assert kv.allocate("x", [], 4, KVClass.NORMAL, 2.0) is not None  # spills 4, 3, 2, 1 (tail first)
    kv.release("x", 2.0)
    assert host() == [1, 2, 3, 4]
    alloc = kv.allocate("b", [1, 2], 0, KVClass.NORMAL, 3.0)  # reloads 1 and 2: their first entries go stale
    assert alloc is not None and alloc.num_host_hit_blocks == 2 and host() == [3, 4]
    kv.release("b", 3.0)
    assert kv.allocate("y", [], 4, KVClass.NORMAL, 4.0) is not None  # spills 2, 1 again: LRU order 4 3 2 1
    kv.release("y", 4.0)
    expected = [[1, 2, 3, 5], [1, 2, 5, 6], [1, 5, 6, 7], [5, 6, 7, 8], [6, 7, 8, 9]]  # 4, 3, 2, 1, 5 leave
    for h, want in zip(range(5, 10), expected):
        assert kv.allocate(f"c{h}", [h], 0, KVClass.NORMAL, float(h)) is not None
        kv.release(f"c{h}", float(h))
        assert kv.allocate(f"z{h}", [], 4, KVClass.NORMAL, float(h)) is not None  # evicts h: one spill, one trim
        kv.release(f"z{h}", float(h))
        assert host() == want, (h, host(), want)


def test_a_released_run_goes_idle_only_where_no_other_owner_holds_it() -> None:
    """A release of a chain that another owner also holds leaves its blocks
    in use (not idle, not evictable); the last holder's release makes the
    chain idle, tail first."""
    kv = KVClassManager(16, 4, KVClassPolicy())
    chain = [21, 22, 23, 24, 25, 26]
    assert kv.allocate("a", chain, 0, KVClass.NORMAL, 0.0) is not None
    assert kv.allocate("b", chain, 0, KVClass.NORMAL, 0.0) is not None
    kv.release("a", 1.0)
    assert kv.idle_order(KVClass.NORMAL) == []
    assert kv.allocate("c", [], 10, KVClass.NORMAL, 2.0) is not None  # the free blocks
    assert kv.allocate("d", [], 1, KVClass.NORMAL, 2.0) is None  # the chain is held by b
    kv.release("b", 3.0)
    assert kv.idle_order(KVClass.NORMAL) == [26, 25, 24, 23, 22, 21]


def test_a_normal_hit_on_a_released_mixed_run_promotes_its_shadow_blocks() -> None:
    """A normal owner hitting an idle run of both classes promotes exactly
    its shadow blocks (counted used once each); its normal blocks stay
    normal."""
    kv = KVClassManager(16, 4, KVClassPolicy(shadow_cap_fraction=0.5))
    assert kv.allocate("n", [1, 2, 3], 0, KVClass.NORMAL, 0.0) is not None
    kv.release("n", 0.0)
    assert kv.allocate("s", [1, 2, 3, 4, 5, 6], 0, KVClass.SHADOW, 1.0) is not None  # 4-6 are new shadow blocks
    kv.release("s", 1.0)
    assert [kv.class_of(h) for h in range(1, 7)] == [KVClass.NORMAL] * 3 + [KVClass.SHADOW] * 3
    alloc = kv.allocate("call", [1, 2, 3, 4, 5, 6, 7, 8], 0, KVClass.NORMAL, 2.0)
    assert alloc is not None and alloc.num_device_hit_blocks == 6 and alloc.num_shadow_blocks_used == 3
    assert [kv.class_of(h) for h in range(1, 9)] == [KVClass.NORMAL] * 8
    assert kv.num_shadow_blocks == 0 and kv.num_shadow_blocks_used == 3
    assert kv.allocate("s2", [11, 12, 13, 14, 15], 0, KVClass.SHADOW, 3.0) is not None
    kv.release("s2", 3.0)
    assert kv.allocate("s3", [11, 12], 0, KVClass.SHADOW, 3.0) is not None  # a shadow chunk still holds 11-12
    alloc = kv.allocate("call2", [11, 12, 13, 14, 15], 0, KVClass.NORMAL, 4.0)  # held and idle shadow blocks
    assert alloc is not None and alloc.num_shadow_blocks_used == 5
    assert [kv.class_of(h) for h in range(11, 16)] == [KVClass.NORMAL] * 5 and kv.num_shadow_blocks == 0


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["alloc", "shadow", "release", "finish", "grow", "tick"]),
                              st.integers(0, 5), st.integers(1, 10)), min_size=1, max_size=50),
       num_blocks=st.integers(6, 40), slack=st.sampled_from([0, 1, 1024]), host=st.booleans())
# A hit on the head of a released chain, then evictions through the rest and past it (pinned: the dead-run
# and head-advance shortcuts both apply here).
@example(ops=[("alloc", 0, 6), ("release", 0, 1), ("alloc", 1, 6), ("release", 0, 1), ("alloc", 0, 3),
              ("grow", 0, 7), ("release", 0, 1), ("grow", 0, 4)], num_blocks=16, slack=0, host=False)
# A head run with two stale entries in a row before a one-block eviction (found by search: the head's shortcut
# must not stop on a stale entry, whose block is gone).
@example(ops=[("alloc", 1, 3), ("finish", 2, 2), ("alloc", 5, 3), ("alloc", 4, 8), ("shadow", 3, 2), ("tick", 4, 5),
              ("finish", 1, 8), ("alloc", 0, 10), ("finish", 5, 1), ("tick", 0, 8), ("shadow", 4, 4),
              ("finish", 2, 3), ("grow", 4, 2), ("alloc", 4, 9), ("tick", 0, 5), ("shadow", 1, 10)],
         num_blocks=18, slack=1024, host=False)
def test_idle_orders_are_the_release_order_of_idle_blocks(ops, num_blocks, slack, host) -> None:
    """Each class's idle order (kept as runs with stale entries, see
    ``_IdleRuns``) is, by definition, its idle blocks (reference count 0)
    sorted by release, a release's blocks in the order it released them
    (here: a chain tail first); its length is their number. Checked after
    every step, with compaction forced (slack 0, 1) and not."""
    from unittest import mock

    from shadowcore import kv as kv_module
    from shadowcore.kv import HostTierParams

    policy = KVClassPolicy(0.5, 1.0, HostTierParams(capacity_bytes=5 * 4 * 131072.0) if host else None)
    kv = KVClassManager(num_blocks, 4, policy)
    now, owners = 0.0, []  # (owner id, chain, length)
    with mock.patch.object(kv_module, "_COMPACT_SLACK", slack):
        for step, (op, chain, n) in enumerate(ops):
            if op == "tick":
                now += n * 0.4
            elif op in ("alloc", "shadow"):
                cls = KVClass.SHADOW if op == "shadow" else KVClass.NORMAL
                if kv.allocate(f"o{step}", [chain * 1000 + i for i in range(n)], 0, cls, now) is not None:
                    owners.append((f"o{step}", chain, n))
            elif op == "grow" and owners:
                if kv.allocate(f"g{step}", [], n, KVClass.NORMAL, now) is not None:  # private blocks: evictions
                    kv.release(f"g{step}", now)
            elif owners:
                owner, c, k = owners.pop(chain % len(owners))
                if op == "release" or kv._owners[owner].kv_class is KVClass.SHADOW:
                    kv.release(owner, now)
                else:
                    kv.release_and_cache(owner, [c * 1000 + i for i in range(k + n)], f"c{step}", now)
            for cls in KVClass:
                order = kv.idle_order(cls)  # first: a query makes the evictions owed, the raw fields below do not
                idle = [h for h, (shadow, ref, _, _) in kv._blocks.items() if ref == 0 and shadow is (cls is KVClass.SHADOW)]
                expected = sorted(idle, key=lambda h: (kv._blocks[h][3], -h))
                assert order == expected, (step, cls)
                assert len(kv._idle[cls]) == len(expected)


def test_decode_growth_evicts_the_blocks_idle_when_it_grew() -> None:
    """``extend_private`` owes its evictions (the manager makes them at its
    next query or change): they must be the victims of the moment it grew,
    even when a shadow release in between puts shadow blocks ahead of the
    normal ones in the eviction order; every count must already include
    them."""
    kv = KVClassManager(8, 4, KVClassPolicy(shadow_cap_fraction=1.0))
    assert kv.allocate("s", [10, 11], 0, KVClass.SHADOW, 0.0) is not None
    assert kv.allocate("ctx", [1, 2, 3, 4], 0, KVClass.NORMAL, 0.0) is not None
    kv.release("ctx", 0.0)  # idle, normal: 4, 3, 2, 1
    assert kv.allocate("d", [], 2, KVClass.NORMAL, 0.0) is not None  # the last free blocks
    assert kv.extend_private([("d", 2)], 1.0)  # two of the normal idle blocks: 4, 3
    assert kv.eviction_count == 2 and kv.num_idle_blocks == 2 and kv.num_free_blocks == 0
    assert not kv.extend_private([("d", 3)], 1.5)  # the owed two are no longer there to take
    kv.release("s", 2.0)  # the shadow blocks go idle: now first in line
    assert [kv.is_cached(h) for h in (1, 2, 3, 4, 10, 11)] == [True, True, False, False, True, True]
    assert kv.idle_order(KVClass.NORMAL) == [2, 1] and kv.idle_order(KVClass.SHADOW) == [11, 10]
    assert kv.num_evicted_blocks == {KVClass.SHADOW: 0, KVClass.NORMAL: 2} and kv.eviction_count == 2
    assert not kv.extend_private([("d", 5)], 3.0)  # 4 idle blocks: nothing changed
    assert kv.num_idle_blocks == 4 and kv.eviction_count == 2


def test_private_allocations_and_finishes_leave_owed_evictions_owed() -> None:
    """A private allocation and a private owner's finish run with evictions
    still owed (only other calls settle them): the allocation's room counts
    the debt, and the owed victims stay those of the moment decode grew
    (a finished chain joins the idle order behind them)."""
    kv = KVClassManager(16, 16, KVClassPolicy())
    assert kv.allocate("a", range(100, 108), 0, KVClass.NORMAL, 0.0, private=True) is not None
    kv.release_and_cache("a", range(100, 108), "c", 0.5)  # idle (private): 107 ... 100
    assert kv.allocate("b", [0, 1, 2, 3], 0, KVClass.NORMAL, 1.0) is not None
    assert kv.extend_private([("b", 4)], 1.0) and kv.extend_private([("b", 4)], 1.0)  # owes 4: 107 ... 104
    assert kv.num_idle_blocks == 4 and kv.eviction_count == 4
    assert kv.allocate("x", range(200, 206), 0, KVClass.NORMAL, 1.5, private=True) is None  # 4 blocks to take
    assert kv.allocate("y", range(300, 302), 1, KVClass.NORMAL, 1.5, private=True) is not None  # owes 3 more
    kv.release_and_cache("y", range(300, 303), "c2", 2.0)  # idle behind the rest: 302, 301, 300; 1 block freed
    assert kv._owed == 7  # nothing settled so far (what this test is about: no eager eviction per call)
    assert kv.idle_order(KVClass.NORMAL) == [100, 302, 301, 300] and kv.num_free_blocks == 0
    assert kv.eviction_count == 7 and kv.num_evicted_blocks[KVClass.NORMAL] == 7


def test_a_finish_makes_the_owed_evictions_before_it_reloads() -> None:
    """A finish (``release_and_cache``) of a named owner settles the owed
    evictions first: their spill can trim the host tier, and a tail block it
    trims is no longer there to reload (the calls one by one). Only a private
    owner's finish may run with evictions owed, and not when it would reload."""
    from shadowcore.kv import HostTierParams

    kv = KVClassManager(5, 4, KVClassPolicy(host=HostTierParams(capacity_bytes=1 * 4 * 131072.0)))
    assert kv.allocate("a", [1], 0, KVClass.NORMAL, 0.0) is not None
    kv.release("a", 0.0)  # idle: 1
    assert kv.allocate("d", [], 4, KVClass.NORMAL, 0.0) is not None
    assert kv.allocate("e", [], 1, KVClass.NORMAL, 0.0) is not None  # evicts 1 (owed)
    assert kv.in_host(1)  # settled: 1 spilled to the host tier (its capacity: one block)
    kv.release("e", 0.0)
    assert kv.allocate("ctx", [5], 0, KVClass.NORMAL, 0.0) is not None
    kv.release("ctx", 0.0)  # idle: 5
    kv.release("d", 0.0)
    assert kv.allocate("r", [], 1, KVClass.NORMAL, 0.0) is not None
    assert kv.allocate("d2", [], 3, KVClass.NORMAL, 0.0) is not None  # no free block left
    assert kv.extend_private([("d2", 1)], 1.0)  # owes the eviction of 5, whose spill trims 1 from the host tier
    kv.release_and_cache("r", [1], "c", 2.0)  # 1 is computed anew in r's private block: no reload
    assert kv.num_reloaded_blocks == 0 and kv.is_cached(1) and kv.in_host(5) and not kv.in_host(1)


def test_an_allocation_that_reloads_from_the_host_tier_evicts_before_the_reload() -> None:
    """An allocation's evictions spill to the host tier before its host hits
    leave it (the order of the calls one by one): one that reloads a block
    must not owe its evictions, or the spill would trim the tier as if the
    reloaded block had already left."""
    from shadowcore.kv import HostTierParams

    kv = KVClassManager(6, 4, KVClassPolicy(host=HostTierParams(capacity_bytes=3 * 4 * 131072.0)))
    assert kv.allocate("a", [1, 2], 0, KVClass.NORMAL, 0.0) is not None
    kv.release("a", 0.0)  # idle: 2, 1
    assert kv.allocate("b", [], 4, KVClass.NORMAL, 0.0) is not None  # the free blocks
    assert kv.allocate("c", [], 2, KVClass.NORMAL, 0.0) is not None  # evicts 2, 1: the host tier holds 2, 1
    kv.release("c", 0.0)
    assert kv.allocate("d", [3, 4], 0, KVClass.NORMAL, 0.0) is not None
    kv.release("d", 0.0)  # idle: 4, 3
    alloc = kv.allocate("e", [1, 5], 0, KVClass.NORMAL, 1.0)  # reloads 1; evicts 4, 3 (spilled: 2 goes)
    assert alloc is not None and alloc.num_host_hit_blocks == 1
    assert [h for h in (1, 2, 3, 4) if kv.in_host(h)] == [3, 4] and kv.num_host_blocks == 2


def test_a_hit_inside_a_release_of_both_classes_is_not_evicted() -> None:
    """A release that made blocks of both classes idle, then a hit on one of
    its normal blocks: the release's idle count (its shadow block included)
    equals the length of its normal run, yet that run has a stale entry.
    Eviction must skip the hit block (held) and go on to the next release."""
    kv = KVClassManager(8, 4, KVClassPolicy(1.0, 1.0))
    assert kv.allocate("n", [1, 2], 0, KVClass.NORMAL, 0.0) is not None
    kv.release("n", 0.0)
    assert kv.allocate("s", [1, 2, 3], 0, KVClass.SHADOW, 2.0) is not None  # hits 1, 2 (cold); 3 is new, shadow
    kv.release("s", 2.0)  # one release, both classes: normal 2, 1 and shadow 3 go idle
    assert kv.allocate("h", [1], 0, KVClass.NORMAL, 3.0) is not None  # 1 is held again
    assert kv.allocate("x", [7, 8], 0, KVClass.NORMAL, 3.0) is not None
    kv.release("x", 3.0)  # idle: shadow 3; normal 2, then 8, 7
    assert kv.allocate("p", [], 3, KVClass.NORMAL, 3.0) is not None  # the free blocks
    assert kv.allocate("q", [], 3, KVClass.NORMAL, 4.0) is not None  # evicts 3, then 2, then 8
    assert [kv.is_cached(h) for h in (1, 2, 3, 7, 8)] == [True, False, False, True, False]


def test_decode_pool_hands_blocks_over_and_changes_nothing_else() -> None:
    """pool_owner / move_private (the engine's pooled decode blocks): the pool
    grows like any normal owner; a move changes who holds blocks, never the
    free count; moving more than the pool holds, or to a shadow owner, is an error."""
    import pytest

    kv = KVClassManager(10, 16)
    kv.pool_owner("pool")
    kv.pool_owner("pool")  # again: nothing changes
    assert kv.allocate("a", [1, 2], 1, KVClass.NORMAL, 0.0) is not None
    assert kv.extend_private([("pool", 3)], 0.0) and kv.num_free_blocks == 4
    kv.move_private("pool", "a", 2)
    assert kv.num_free_blocks == 4
    kv.release("a", 1.0)  # its 1 + 2 private blocks free, its two hashed blocks idle
    assert kv.num_free_blocks == 7 and kv.num_idle_blocks == 2
    with pytest.raises(ValueError, match="cannot move 2 private blocks"):
        kv.move_private("pool", "pool", 2)
    assert kv.allocate("s", [9], 0, KVClass.SHADOW, 1.0) is not None
    with pytest.raises(ValueError, match="SHADOW"):
        kv.move_private("pool", "s", 1)
    with pytest.raises(ValueError, match="not a normal owner"):
        kv.pool_owner("s")
