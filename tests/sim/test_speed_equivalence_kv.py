"""The KV manager's composite operations equal the calls they stand for.

``KVClassManager.release_and_cache`` (a finished request: release, then cache
its computed full blocks) and ``extend_private`` (the steady decode path's
block reservations in one go) must leave exactly the state the original call
sequences leave: per block its class, references and idle time, the LRU
order of each class, the host tier's order, every counter, and the cold
counts that ``shadow_room_blocks`` reports later. Hypothesis drives two
managers with the same random operations (shared prefixes, shadow owners, a
tight pool, a host tier) and compares them after every step.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from shadowcore.kv import HostTierParams, KVClass, KVClassManager, KVClassPolicy, PrefixMatch


def _chain(c: int, n: int) -> list[int]:
    """Block hashes of chain ``c``: chains 0-2 share their first 3 blocks."""
    return [i if (i < 3 and c < 3) else c * 1000 + i for i in range(n)]


def _state(kv: KVClassManager) -> tuple:
    # host entries by hash and class in LRU order: a spill's id says which call spilled it, and one composite
    # call spills in one run what its calls one by one spill in several (the same LRU, the same trims)
    kv._settle()  # the evictions extend_private owes (every query makes them; the raw fields below do not)
    blocks = {h: (kv.class_of(h), ref, since if ref == 0 else None, kv._cold(h))
              for h, (_, ref, since, _) in kv._blocks.items()}
    owners = {o: (w.kv_class, list(w.hashes), w.num_private_blocks) for o, w in kv._owners.items()}
    return (kv.num_free_blocks, kv.eviction_count, kv.num_shadow_blocks, dict(kv.num_evicted_blocks),
            kv.num_shadow_blocks_used, kv.num_reloaded_blocks, kv.host_order(),
            kv.idle_order(KVClass.SHADOW), kv.idle_order(KVClass.NORMAL), blocks, owners, kv._num_cold_idle)


_OP = st.one_of(
    st.tuples(st.just("alloc"), st.integers(0, 5), st.integers(0, 8), st.integers(0, 2), st.booleans()),
    st.tuples(st.just("release"), st.integers(0, 40)),
    st.tuples(st.just("finish"), st.integers(0, 40), st.integers(0, 6)),
    st.tuples(st.just("finish"), st.integers(0, 40), st.integers(0, 6)),
    st.tuples(st.just("grow"), st.lists(st.tuples(st.integers(0, 40), st.integers(1, 4)), min_size=1, max_size=3)),
    st.tuples(st.just("grow"), st.lists(st.tuples(st.integers(0, 40), st.integers(1, 4)), min_size=2, max_size=3)),
    st.tuples(st.just("room"),),
)


@pytest.mark.parametrize("host", [False, True])
@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.tuples(_OP, st.sampled_from([0.0, 0.5, 3.0])), max_size=60))
# A finished owner whose head another owner also holds: only its own blocks go idle (pinned: the chain's
# all-at-once path must not take a shared head).
@example(ops=[(("alloc", 0, 5, 0, False), 0.0), (("alloc", 1, 4, 0, False), 0.0), (("finish", 0, 1), 0.5)])
# (host=True) A finish whose new blocks hit shadow blocks in the host tier counts them used, as allocate does:
# the general short way (idle shadow hits on the device, then one in the host tier; Hypothesis found it) and
# the chain's all-at-once path (the whole tail in the host tier). Pins mutants used-host-finish, used-host-chain.
@example(ops=[(("alloc", 0, 7, 0, False), 0.0), (("alloc", 3, 6, 0, True), 0.0), (("release", 0), 0.0),
              (("release", 0), 0.0), (("room",), 0.0), (("release", 0), 0.0), (("alloc", 3, 3, 2, False), 0.0),
              (("alloc", 0, 0, 1, False), 0.0), (("alloc", 0, 0, 1, False), 0.0), (("finish", 0, 3), 0.0)])
@example(ops=[(("alloc", 3, 6, 0, True), 0.0), (("release", 0), 0.0), (("alloc", 4, 8, 5, False), 0.0),
              (("release", 0), 0.0), (("alloc", 3, 3, 3, False), 0.0), (("finish", 0, 3), 0.0)])
def test_composites_equal_the_calls_they_replace(host: bool, ops: list) -> None:
    policy = KVClassPolicy(shadow_cap_fraction=0.5, cold_age_s=2.0,
                           host=HostTierParams(capacity_bytes=6 * 16 * 131072.0) if host else None)
    fast, slow = (KVClassManager(16, 16, policy) for _ in range(2))
    owners: list[tuple[str, int, KVClass]] = []  # (owner id, chain, class) of live owners
    now = 0.0
    for n, (op, dt) in enumerate(ops):
        now += dt
        if op[0] == "alloc":
            _, chain, length, private, shadow = op
            cls = KVClass.SHADOW if shadow else KVClass.NORMAL
            a = fast.allocate(f"o{n}", _chain(chain, length), private, cls, now)
            b = slow.allocate(f"o{n}", _chain(chain, length), private, cls, now)
            assert a == b
            if a is not None:
                owners.append((f"o{n}", chain, cls))
        elif op[0] == "release" and owners:
            owner, _, _ = owners.pop(op[1] % len(owners))
            fast.release(owner, now)
            slow.release(owner, now)
        elif op[0] == "finish" and owners:
            owner, chain, _ = owners.pop(op[1] % len(owners))
            hashes = _chain(chain, len(fast._owners[owner].hashes) + op[2])
            fast.release_and_cache(owner, hashes, f"commit{n}", now)
            slow.release(owner, now)
            if slow.allocate(f"commit{n}", hashes, 0, KVClass.NORMAL, now) is not None:
                slow.release(f"commit{n}", now)
        elif op[0] == "grow":
            normal = [o for o, _, cls in owners if cls is KVClass.NORMAL]
            needs = list({normal[i % len(normal)]: k for i, k in op[1]}.items()) if normal else []
            ok = fast.extend_private(needs, now)
            if ok:
                for o, k in needs:
                    assert slow.extend(o, (), k, now)
            else:  # the room check refused: the calls one by one would not all have fitted
                assert sum(k for _, k in needs) > slow.num_free_blocks + slow.num_idle_blocks
        elif op[0] == "room":
            assert fast.shadow_room_blocks(now) == slow.shadow_room_blocks(now)
        assert _state(fast) == _state(slow), (n, op)


def test_release_and_cache_counts_host_hits_like_allocate() -> None:
    """Caching blocks that sit in the host tier (the short way: they fit in
    the owner's freed private blocks) reloads them, as allocate does."""
    policy = KVClassPolicy(host=HostTierParams(capacity_bytes=8 * 16 * 131072.0))
    fast, slow = (KVClassManager(8, 16, policy) for _ in range(2))
    for kv in (fast, slow):
        kv.allocate("a", _chain(9, 4), 0, KVClass.NORMAL, 0.0)
        kv.release("a", 0.0)
        kv.allocate("b", _chain(8, 8), 0, KVClass.NORMAL, 1.0)  # a's blocks go to the host tier
        kv.release("b", 1.0)
        assert kv.allocate("r", _chain(9, 2), 2, KVClass.NORMAL, 2.0).num_host_hit_blocks == 2
    before = fast.num_reloaded_blocks
    fast.release_and_cache("r", _chain(9, 4), "commit", 3.0)
    slow.release("r", 3.0)
    assert slow.allocate("commit", _chain(9, 4), 0, KVClass.NORMAL, 3.0).num_host_hit_blocks == 2
    slow.release("commit", 3.0)
    assert fast.num_reloaded_blocks == before + 2
    assert _state(fast) == _state(slow)


def _observed(kv: KVClassManager) -> tuple:
    """What a caller sees without a by-hash query (those name private blocks): counters, idle orders, owners,
    host tier, cold count."""
    owners = {o: (w.kv_class, list(w.hashes), w.num_private_blocks) for o, w in kv._owners.items()}
    return (kv.num_free_blocks, kv.eviction_count, kv.num_idle_blocks, kv.num_cached_blocks, kv.num_shadow_blocks,
            dict(kv.num_evicted_blocks), kv.num_shadow_blocks_used, kv.num_reloaded_blocks,
            kv.host_order(), kv.num_host_blocks, kv.idle_order(KVClass.SHADOW),
            kv.idle_order(KVClass.NORMAL), owners, kv._num_cold_idle)


def _run(c: int, n: int) -> list[int] | range:
    """``_chain(c, n)``, a fresh chain (c >= 100) as a range (what ``SessionHistory.block_hash_run`` gives)."""
    return range(c * 1000, c * 1000 + n) if c >= 100 else _chain(c, n)


_PRIVATE_OP = st.one_of(
    st.tuples(st.just("alloc"), st.integers(0, 5), st.integers(0, 8), st.integers(0, 2), st.booleans()),
    st.tuples(st.just("fresh"), st.integers(0, 8), st.integers(0, 2)),
    st.tuples(st.just("fresh"), st.integers(0, 8), st.integers(0, 2)),
    st.tuples(st.just("release"), st.integers(0, 40)),
    st.tuples(st.just("readmit"), st.integers(0, 40), st.integers(0, 2)),
    st.tuples(st.just("finish"), st.integers(0, 40), st.integers(0, 6)),
    st.tuples(st.just("finish"), st.integers(0, 40), st.integers(0, 6)),
    st.tuples(st.just("grow"), st.lists(st.tuples(st.integers(0, 40), st.integers(1, 4)), min_size=1, max_size=3)),
    st.tuples(st.just("room"),),
    st.tuples(st.just("query"),),
    st.tuples(st.just("lookup"), st.integers(0, 40), st.integers(0, 8)),
    st.tuples(st.just("extend"), st.integers(0, 40), st.integers(1, 6)),
)


@pytest.mark.parametrize(("host", "order"), [(False, "shadow-first"), (True, "shadow-first"), (True, "lru")])
@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(_PRIVATE_OP, st.sampled_from([0.0, 0.5, 3.0])), max_size=60))
# An idle shadow run older than an idle private run, then a normal allocation that evicts: "lru" takes the
# shadow one first (a private run's entries keep their release's idle time).
@example(ops=[(("alloc", 0, 4, 0, True), 0.0), (("release", 0), 0.5), (("fresh", 4, 0), 0.5),
              (("finish", 0, 0), 0.5), (("fresh", 8, 4), 0.0)])
# A finished private chain half evicted by a fresh allocation, then a by-hash query: only its live (last) entries
# get map entries (pins mutant private-name, which named them all and survived a run by chance).
@example(ops=[(("fresh", 8, 0), 0.0), (("finish", 0, 0), 0.5), (("fresh", 8, 4), 0.5), (("query",), 0.5)])
# A by-hash query right after a private finish names the whole idle run (pins mutant private-run: the manager's
# copy of the run one entry short, which Hypothesis found only now and then).
@example(ops=[(("fresh", 8, 0), 0.0), (("finish", 0, 0), 0.5), (("query",), 0.5)])
# Owed evictions that span a private run at the head of the normal order and a named run after it: settling
# takes the private run by count, then the named one by the general path (pins mutant private-settle-rest).
@example(ops=[(("fresh", 3, 0), 0.0), (("finish", 0, 0), 0.5), (("alloc", 0, 8, 0, False), 0.5),
              (("release", 0), 0.5), (("fresh", 8, 1), 0.5), (("room",), 0.0)])
# The same with a second private run behind the named one: the rest goes as a head run of named pieces
# (pins mutant private-head-run, which the run-by-run settle made rare in random runs).
@example(ops=[(("fresh", 3, 0), 0.0), (("finish", 0, 0), 0.5), (("alloc", 0, 8, 0, False), 0.5),
              (("release", 0), 0.5), (("fresh", 2, 0), 0.5), (("finish", 0, 0), 0.5), (("fresh", 8, 1), 0.5),
              (("room",), 0.0)])
def test_private_blocks_equal_named_ones(host: bool, order: str, ops: list) -> None:
    """``allocate(private=True)`` (a normal request's fresh prompt: its blocks
    kept out of the block map) leaves everything a caller sees as the same
    allocation without it does, through preemption (the owner's own blocks hit
    again on readmission), finishing, eviction in either order, spills to the
    host tier and shadow allocations; a by-hash query (``query``) names the
    private blocks and changes nothing either."""
    policy = KVClassPolicy(shadow_cap_fraction=0.5, cold_age_s=2.0, eviction_order=order,
                           host=HostTierParams(capacity_bytes=6 * 16 * 131072.0) if host else None)
    priv, named = (KVClassManager(16, 16, policy) for _ in range(2))
    owners: list[tuple[str, int, KVClass]] = []  # (owner id, chain, class) of live owners
    preempted: list[tuple[int, int]] = []  # (chain, blocks) of released fresh chains
    now = 0.0
    for n, (op, dt) in enumerate(ops):
        now += dt
        if op[0] in ("alloc", "fresh", "readmit"):
            if op[0] == "alloc":
                _, chain, length, extra, shadow = op
                cls, private = (KVClass.SHADOW if shadow else KVClass.NORMAL), False
            elif op[0] == "fresh":  # a chain no one else names
                (_, length, extra), chain, cls, private = op, 100 + n, KVClass.NORMAL, True
            elif preempted:
                (chain, length), extra = preempted.pop(op[1] % len(preempted)), op[2]
                cls, private = KVClass.NORMAL, False
            else:
                continue
            a = priv.allocate(f"o{n}", _run(chain, length), extra, cls, now, private=private)
            b = named.allocate(f"o{n}", _chain(chain, length), extra, cls, now)
            assert a == b
            if a is not None:
                owners.append((f"o{n}", chain, cls))
        elif op[0] == "release" and owners:
            owner, chain, _ = owners.pop(op[1] % len(owners))
            if chain >= 100:
                preempted.append((chain, len(named._owners[owner].hashes)))
            priv.release(owner, now)
            named.release(owner, now)
        elif op[0] == "finish" and owners:
            owner, chain, _ = owners.pop(op[1] % len(owners))
            hashes = _chain(chain, len(named._owners[owner].hashes) + op[2])
            priv.release_and_cache(owner, _run(chain, len(hashes)), f"commit{n}", now)
            named.release_and_cache(owner, hashes, f"commit{n}", now)
        elif op[0] == "grow":
            normal = [o for o, _, cls in owners if cls is KVClass.NORMAL]
            needs = list({normal[i % len(normal)]: k for i, k in op[1]}.items()) if normal else []
            assert priv.extend_private(needs, now) == named.extend_private(needs, now)
        elif op[0] == "extend" and owners:  # a decode's block one call at a time (the engine's _reserve)
            owner, _, cls = owners[op[1] % len(owners)]
            assert priv.extend(owner, (), op[2], now) == named.extend(owner, (), op[2], now), (n, op)
        elif op[0] == "room":
            assert priv.shadow_room_blocks(now) == named.shadow_room_blocks(now)
        elif op[0] == "lookup":  # a prefix lookup of a fresh chain (idle, held, evicted or spilled) finds it
            chains = [*range(6), *range(100, 100 + n)]  # the shared chains, and every op's fresh one
            chain = chains[op[1] % len(chains)]
            assert priv.match_prefix(_run(chain, op[2])) == named.match_prefix(_chain(chain, op[2])), (n, op)
        elif op[0] == "query":  # a by-hash query names the private blocks; then every block compares
            assert not priv.is_cached(-1)
            assert _state(priv) == _state(named), (n, op)
        assert _observed(priv) == _observed(named), (n, op)


_HOST_OP = st.one_of(
    *(st.tuples(st.just("fresh"), st.integers(1, 8), st.integers(0, 2)) for _ in range(3)),
    *(st.tuples(st.just("finish"), st.integers(0, 40), st.integers(0, 4)) for _ in range(3)),
    st.tuples(st.just("alloc"), st.integers(0, 5), st.integers(1, 8), st.booleans()),
    st.tuples(st.just("release"), st.integers(0, 40)),
    st.tuples(st.just("lookup"), st.integers(0, 40), st.integers(0, 12)),
    st.tuples(st.just("host"), st.integers(0, 40), st.integers(0, 11)),
    st.tuples(st.just("query"),),
)


@pytest.mark.parametrize("capacity", [3, 20])
@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(_HOST_OP, st.sampled_from([0.0, 0.5, 3.0])), min_size=10, max_size=60))
def test_private_runs_in_the_host_tier_equal_named(capacity: int, ops: list) -> None:
    """Finished private chains evicted to the host tier stay private there
    (runs kept by count); trims through them, lookups of a private chain from
    its first block (device, host tier, or both), host-tier queries by hash
    (``in_host``, which names them) and device queries that name only the
    device's private blocks leave everything a caller sees as the same calls
    without ``private`` do."""
    policy = KVClassPolicy(shadow_cap_fraction=0.5, cold_age_s=2.0,
                           host=HostTierParams(capacity_bytes=capacity * 16 * 131072.0))
    priv, named = (KVClassManager(16, 16, policy) for _ in range(2))
    owners: list[tuple[str, int]] = []  # (owner id, chain) of live owners
    fresh: list[int] = []  # the private chains allocated so far
    now = 0.0
    for n, (op, dt) in enumerate(ops):
        now += dt
        if op[0] in ("fresh", "alloc"):
            if op[0] == "fresh":  # a chain no one else names
                (_, length, extra), chain, cls, private = op, 100 + n, KVClass.NORMAL, True
            else:
                (_, chain, length, shadow), extra, private = op, 0, False
                cls = KVClass.SHADOW if shadow else KVClass.NORMAL
            a = priv.allocate(f"o{n}", _run(chain, length), extra, cls, now, private=private)
            assert a == named.allocate(f"o{n}", _chain(chain, length), extra, cls, now), (n, op)
            if a is not None:
                owners.append((f"o{n}", chain))
                fresh += [chain] if private else []
        elif op[0] == "release" and owners:
            owner, _ = owners.pop(op[1] % len(owners))
            priv.release(owner, now)
            named.release(owner, now)
        elif op[0] == "finish" and owners:
            owner, chain = owners.pop(op[1] % len(owners))
            length = len(named._owners[owner].hashes) + op[2]
            priv.release_and_cache(owner, _run(chain, length), f"commit{n}", now)
            named.release_and_cache(owner, _chain(chain, length), f"commit{n}", now)
        elif op[0] == "lookup" and fresh:  # from the chain's first block: private runs are found by hash
            gone = [c for c in fresh if not named.is_cached(_chain(c, 1)[0])]  # none on the device: the host tier
            chain = (gone or fresh)[op[1] % len(gone or fresh)]  # (a device lookup names all the device's private runs)
            assert priv.match_prefix(_run(chain, op[2])) == named.match_prefix(_chain(chain, op[2])), (n, op)
        elif op[0] == "host" and fresh:
            h = _chain(fresh[op[1] % len(fresh)], 12)[op[2]]
            assert priv.in_host(h) == named.in_host(h), (n, op)
        elif op[0] == "query":  # names the device's private blocks, not the host tier's
            assert not priv.is_cached(-1)
        assert _observed(priv) == _observed(named), (n, op)


_MEMO_OP = st.one_of(
    st.tuples(st.just("alloc"), st.integers(0, 5), st.integers(1, 10), st.booleans()),
    st.tuples(st.just("fresh"), st.integers(1, 8), st.integers(0, 2)),
    st.tuples(st.just("release"), st.integers(0, 40)),
    st.tuples(st.just("finish"), st.integers(0, 40), st.integers(0, 4)),
    st.tuples(st.just("grow"), st.integers(0, 40), st.integers(1, 4)),
    st.tuples(st.just("history"), st.integers(0, 5), st.integers(0, 12)),  # a looked-up history's new length
)


class _Key:
    """A lookup's key (cached_prefix_blocks remembers per key object, as the engine per history)."""


@pytest.mark.parametrize("capacity", [0, 4])
@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(_MEMO_OP, st.sampled_from([0.0, 0.5, 3.0])), min_size=5, max_size=40),
       lengths=st.lists(st.integers(0, 12), min_size=6, max_size=6))
def test_remembered_prefix_lookups_equal_fresh_ones(capacity: int, ops: list, lengths: list) -> None:
    """``cached_prefix_blocks`` (a lookup remembered per key while no named
    block enters or leaves the device or the host tier) answers what
    ``match_prefix`` answers now, after every kind of change: named and
    shadow allocations, private ones, releases, finishes, decode growth and
    the evictions, spills, trims and reloads they make; for hashes given as
    lists and as ranges (``SessionHistory.block_hash_run``'s)."""
    policy = KVClassPolicy(shadow_cap_fraction=0.5, cold_age_s=2.0,
                           host=HostTierParams(capacity_bytes=capacity * 16 * 131072.0) if capacity else None)
    kv = KVClassManager(16, 16, policy)
    keys = [_Key() for _ in range(6)]
    lengths = list(lengths)
    owners: list[tuple[str, int]] = []
    now = 0.0
    for n, (op, dt) in enumerate(ops):
        now += dt
        if op[0] == "alloc":
            _, chain, length, shadow = op
            if kv.allocate(f"o{n}", _chain(chain, length), 0, KVClass.SHADOW if shadow else KVClass.NORMAL,
                           now) is not None:
                owners.append((f"o{n}", chain))
        elif op[0] == "fresh":
            if kv.allocate(f"o{n}", _run(100 + n, op[1]), op[2], KVClass.NORMAL, now, private=True) is not None:
                owners.append((f"o{n}", 100 + n))
        elif op[0] == "release" and owners:
            kv.release(owners.pop(op[1] % len(owners))[0], now)
        elif op[0] == "finish" and owners:
            owner, chain = owners.pop(op[1] % len(owners))
            kv.release_and_cache(owner, _run(chain, len(kv._owners[owner].hashes) + op[2]), f"c{n}", now)
        elif op[0] == "grow" and owners:
            owner, chain = owners[op[1] % len(owners)]
            if kv._owners[owner].kv_class is KVClass.NORMAL:
                kv.extend_private([(owner, op[2])], now)
        elif op[0] == "history":
            lengths[op[1]] = op[2]
        for chain, (key, length) in enumerate(zip(keys, lengths)):  # chains 3-5 looked up as ranges
            got = kv.cached_prefix_blocks(key, length, lambda _, c=chain, k=length: _lookup(c, k))
            assert got == kv.match_prefix(_chain(chain, length)).num_blocks, (n, op, chain, length)


def _lookup(c: int, n: int) -> list[int] | range:
    """``_chain(c, n)``, as a range where its hashes are consecutive (chains 3 on: what
    ``SessionHistory.block_hash_run`` gives a count-only history)."""
    return range(c * 1000, c * 1000 + n) if c >= 3 else _chain(c, n)


def _host_kv(num_blocks: int, host_blocks: int) -> KVClassManager:
    return KVClassManager(num_blocks, 16, KVClassPolicy(host=HostTierParams(capacity_bytes=host_blocks * 16 * 131072.0)))


def _lookup_both(kv: KVClassManager, key: object, hashes: range) -> int:
    """The remembered lookup of ``hashes``, asserted equal to a fresh ``match_prefix``."""
    got = kv.cached_prefix_blocks(key, len(hashes), lambda _: hashes)
    assert got == kv.match_prefix(list(hashes)).num_blocks
    return got


def test_a_remembered_lookup_sees_a_trim_of_its_host_blocks():
    """A's tail is in the host tier, its head held on the device; B's eviction spills B into the host tier,
    whose trim takes A's least recent host block (B's own eviction names no block of A's prefix): the
    remembered lookup sees the trim."""
    kv, a, key = _host_kv(6, 3), range(3000, 3004), _Key()
    kv.allocate("a", a, 0, KVClass.NORMAL, 0.0)
    kv.allocate("b", range(4000, 4002), 0, KVClass.NORMAL, 0.0)
    kv.release("a", 1.0)
    kv.allocate("c1", range(5000, 5002), 0, KVClass.NORMAL, 2.0)  # A's tail (3002, 3003) to the host tier
    kv.allocate("a2", a[:2], 0, KVClass.NORMAL, 3.0)  # A's head held: not a victim
    assert _lookup_both(kv, key, a) == 4
    kv.release("b", 4.0)
    kv.allocate("c2", range(6000, 6002), 0, KVClass.NORMAL, 5.0)  # B to the host tier: 3003 trimmed
    assert _lookup_both(kv, key, a) == 3


def test_a_remembered_lookup_sees_a_reload_and_what_follows_it():
    """A's host blocks reloaded (the host tier's take) and its next block cached on the device: the prefix
    is then all on the device and goes on there."""
    kv, a, key = _host_kv(8, 5), range(3000, 3006), _Key()
    kv.allocate("a", a[:4], 0, KVClass.NORMAL, 0.0)
    kv.allocate("b", range(4000, 4003), 0, KVClass.NORMAL, 0.0)
    kv.release("a", 1.0)
    kv.allocate("c1", range(5000, 5003), 0, KVClass.NORMAL, 2.0)  # A's tail (3002, 3003) to the host tier
    kv.allocate("a2", a[:2], 0, KVClass.NORMAL, 3.0)
    assert _lookup_both(kv, key, a) == 4
    assert kv.match_prefix(list(a)) == PrefixMatch(2, 2)
    kv.release("c1", 4.0)
    kv.release("a2", 4.0)
    assert kv.allocate("a3", a[:5], 0, KVClass.NORMAL, 5.0) is not None  # reloads 3002-3003, caches 3004
    assert kv.match_prefix(list(a)) == PrefixMatch(5, 0)
    assert _lookup_both(kv, key, a) == 5


def test_a_remembered_lookup_scans_on_in_the_host_tier():
    """The block after A's remembered host run is spilled there later, by an eviction that names no block of
    A's prefix: the host run goes on past its remembered end."""
    kv, a, key = _host_kv(6, 16), range(3000, 3006), _Key()
    kv.allocate("a", a[:4], 0, KVClass.NORMAL, 0.0)
    kv.release("a", 1.0)
    kv.allocate("a2", a[:2], 0, KVClass.NORMAL, 2.0)  # A's head held
    kv.allocate("x", range(7000, 7004), 0, KVClass.NORMAL, 3.0)  # 3003, 3002 to the host tier
    assert kv.match_prefix(list(a)) == PrefixMatch(2, 2)
    assert _lookup_both(kv, key, a) == 4
    kv.release("x", 4.0)
    kv.allocate("z", a[4:5], 0, KVClass.NORMAL, 5.0)  # 3004 cached on its own (one of x's blocks evicted)
    kv.release("z", 6.0)
    kv.allocate("w", range(9000, 9004), 0, KVClass.NORMAL, 7.0)  # x's other blocks and 3004 to the host tier
    assert kv.match_prefix(list(a)) == PrefixMatch(2, 3)
    assert _lookup_both(kv, key, a) == 5
