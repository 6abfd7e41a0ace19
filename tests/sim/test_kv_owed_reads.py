"""Reads that leave private owed evictions owed answer what a settled manager answers.

``KVClassManager.cached_prefix_blocks`` (a remembered lookup) and
``shadow_room_blocks`` do not settle owed evictions whose victims are all
private runs at the head of the normal idle order (``_owed_scan_now``): the
named key sets and the room are known without making them. Two managers get
the same operations; one settles before every read (as every read did
before), the other does not; every answer, and the state after every step,
must be the same. The operations are the engine's under debt: private
admissions and finishes, decode growth (owed evictions), named and shadow
allocations and releases, with a tight pool and a host tier that trims.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from shadowcore.kv import HostTierParams, KVClass, KVClassManager, KVClassPolicy

from .test_speed_equivalence_kv import _chain, _Key, _run, _state

_OP = st.one_of(
    st.tuples(st.just("alloc"), st.integers(0, 4), st.integers(1, 8), st.booleans()),  # named or shadow
    st.tuples(st.just("fresh"), st.integers(1, 6), st.integers(0, 2)),  # a private admission
    st.tuples(st.just("finish"), st.integers(0, 40), st.integers(0, 3)),
    st.tuples(st.just("release"), st.integers(0, 40)),
    st.tuples(st.just("grow"), st.integers(0, 40), st.integers(1, 5)),  # decode growth: owed evictions
    st.tuples(st.just("grow"), st.integers(0, 40), st.integers(1, 5)),
    st.tuples(st.just("read"),),
    st.tuples(st.just("read"),),
)


def _reads(kv: KVClassManager, keys: list, now: float, settle: bool) -> list[int]:
    out = []
    for chain, key in enumerate(keys):
        if settle:
            kv._settle()
        out.append(kv.cached_prefix_blocks(key, 8, lambda _, c=chain: _chain(c, 8)))
    if settle:
        kv._settle()
    out.append(kv.shadow_room_blocks(now))
    return out


def _pool(num_blocks: int, host_blocks: int = 0) -> KVClassManager:
    host = HostTierParams(capacity_bytes=host_blocks * 16 * 131072.0) if host_blocks else None
    return KVClassManager(num_blocks, 16, KVClassPolicy(shadow_cap_fraction=0.5, cold_age_s=2.0, host=host))


def _drive(capacity: int, ops: list) -> None:
    kvs = [_pool(24, capacity), _pool(24, capacity)]  # [reads that may leave debt, settled]
    keys = [[_Key() for _ in range(5)] for _ in kvs]
    owners: list[tuple[str, int]] = []
    now = 0.0
    for n, (op, dt) in enumerate(ops):
        now += dt
        if op[0] == "alloc":
            _, chain, length, shadow = op
            got = [kv.allocate(f"o{n}", _chain(chain, length), 0, KVClass.SHADOW if shadow else KVClass.NORMAL, now)
                   is not None for kv in kvs]
            if got[0]:
                owners.append((f"o{n}", chain))
        elif op[0] == "fresh":
            got = [kv.allocate(f"o{n}", _run(100 + n, op[1]), op[2], KVClass.NORMAL, now, private=True) is not None
                   for kv in kvs]
            if got[0]:
                owners.append((f"o{n}", 100 + n))
        elif op[0] == "finish" and owners:
            owner, chain = owners.pop(op[1] % len(owners))
            got = [kv.release_and_cache(owner, _run(chain, len(kv._owners[owner].hashes) + op[2]), f"c{n}", now)
                   for kv in kvs]
        elif op[0] == "release" and owners:
            owner, _ = owners.pop(op[1] % len(owners))
            got = [kv.release(owner, now) for kv in kvs]
        elif op[0] == "grow" and owners:
            owner, _ = owners[op[1] % len(owners)]
            got = [kvs[0]._owners[owner].kv_class is KVClass.NORMAL and kv.extend_private([(owner, op[2])], now)
                   for kv in kvs]
        elif op[0] == "read":
            got = [_reads(kv, k, now, settle) for kv, k, settle in zip(kvs, keys, (False, True))]
        else:
            continue
        assert got[0] == got[1], (n, op)
    for kv in kvs:
        kv._settle()
        kv._name_private()  # (a representation: _state reads the block map by hash)
    assert _state(kvs[0]) == _state(kvs[1])


@pytest.mark.parametrize("capacity", [0, 3, 12])
@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.tuples(_OP, st.sampled_from([0.0, 0.5, 3.0])), min_size=5, max_size=60))
def test_reads_under_private_debt_equal_settled_reads(capacity: int, ops: list) -> None:
    _drive(capacity, ops)


def test_the_shadow_room_under_private_debt_leaves_out_the_cold_victims() -> None:
    """The room counts cold idle blocks; owed victims of a cold private run
    are not idle once settled: the room without settling leaves them out."""
    kv = _pool(16)
    kv.allocate("p", _run(100, 8), 0, KVClass.NORMAL, 0.0, private=True)
    kv.release_and_cache("p", _run(100, 8), "p.c", 0.0)  # 8 private idle blocks, cold from 2.0 on
    kv.allocate("q", _run(200, 8), 0, KVClass.NORMAL, 3.0, private=True)  # the free blocks
    assert kv.extend_private([("q", 5)], 3.0) and kv._owed == 5
    assert kv.shadow_room_blocks(3.0) == 3 and kv._owed == 5  # cap 8: 3 cold idle left after the 5 owed
    assert kv.num_shadow_blocks == 0 and kv.shadow_room_blocks(3.0) == 3  # settled: the same


def _lookup(kv: KVClassManager, key: _Key) -> int:
    return kv.cached_prefix_blocks(key, 4, lambda _: _chain(0, 4))


def test_a_remembered_lookup_sees_owed_victims_past_the_private_runs() -> None:
    """Owed evictions that reach a named run after the private head runs
    change a chain's cached prefix: the lookup settles (a scan that read the
    named run as private would answer the remembered 4)."""
    kv, key = _pool(24), _Key()
    kv.allocate("p", _run(100, 6), 0, KVClass.NORMAL, 0.0, private=True)
    kv.release_and_cache("p", _run(100, 6), "p.c", 0.0)  # a private idle run, the oldest
    kv.allocate("n", _chain(0, 4), 0, KVClass.NORMAL, 1.0)
    kv.release("n", 1.0)  # a named idle run after it
    assert _lookup(kv, key) == 4
    kv.allocate("q", _run(200, 14), 0, KVClass.NORMAL, 2.0, private=True)  # the pool is full
    assert kv.extend_private([("q", 6)], 2.0) and _lookup(kv, key) == 4 and kv._owed == 6  # private victims: owed
    assert kv.extend_private([("q", 2)], 2.0) and _lookup(kv, key) == 2 == kv.match_prefix(_chain(0, 4)).num_blocks


def test_a_remembered_lookup_sees_the_host_tier_trim_a_named_run() -> None:
    """Private owed victims whose spill trims a named run from the host tier
    change a chain's cached prefix there: the lookup settles."""
    kv, key = _pool(12, host_blocks=8), _Key()
    kv.allocate("n", _chain(0, 4), 0, KVClass.NORMAL, 0.0)
    kv.release("n", 0.0)
    kv.allocate("q", _run(200, 12), 0, KVClass.NORMAL, 1.0, private=True)  # owes the 4 named blocks
    assert kv.num_host_blocks == 4  # settled: the named chain is in the host tier
    kv.release_and_cache("q", _run(200, 12), "q.c", 1.0)  # a private idle run of 12 (its held blocks)
    assert _lookup(kv, key) == 4
    kv.allocate("r", _run(300, 3), 0, KVClass.NORMAL, 2.0, private=True)  # owes 3 private: the tier trims none
    assert kv._owed == 3 and _lookup(kv, key) == 4 and kv._owed == 3
    assert kv.extend_private([("r", 3)], 2.0)  # 6 owed: their spill trims the chain's last 2 blocks from the tier
    assert kv._owed == 6 and _lookup(kv, key) == 2 == kv.match_prefix(_chain(0, 4)).num_blocks


def test_a_remembered_lookup_after_a_settle_scans_the_debt_again() -> None:
    """The scan of owed victims holds until the next settle: after one, the
    private run has fewer idle blocks and a new debt may reach the named run."""
    kv, key = _pool(24), _Key()
    kv.allocate("p", _run(100, 6), 0, KVClass.NORMAL, 0.0, private=True)
    kv.release_and_cache("p", _run(100, 6), "p.c", 0.0)
    kv.allocate("n", _chain(0, 4), 0, KVClass.NORMAL, 1.0)
    kv.release("n", 1.0)
    assert _lookup(kv, key) == 4
    kv.allocate("q", _run(200, 14), 0, KVClass.NORMAL, 2.0, private=True)
    assert kv.extend_private([("q", 2)], 2.0) and _lookup(kv, key) == 4 and kv._owed == 2
    assert kv.num_shadow_blocks == 0 and kv._owed == 0  # a settling query: the private run has 4 idle blocks left
    assert kv.extend_private([("q", 6)], 2.0) and _lookup(kv, key) == 2 == kv.match_prefix(_chain(0, 4)).num_blocks


_UNREF_OP = st.one_of(
    st.tuples(st.just("alloc"), st.integers(0, 3), st.integers(1, 8), st.booleans()),
    st.tuples(st.just("release"), st.integers(0, 40)),
)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(_UNREF_OP, st.sampled_from([0.0, 0.5, 3.0])), min_size=2, max_size=30))
@example(ops=[(("alloc", 0, 4, False), 0.0), (("release", 0), 0.0), (("alloc", 0, 8, True), 0.0),
              (("release", 0), 0.0), (("alloc", 0, 2, False), 0.0)])
def test_a_release_of_both_classes_equals_the_block_loop(ops: list) -> None:
    """``release`` of a run its owner alone holds with blocks of both
    classes (a shadow chunk over a normal prefix) leaves what the block loop
    leaves (reached with a ``keep`` that holds none of them): classes, idle
    orders, idle counts per release, the releases of both classes."""
    kvs = [_pool(16), _pool(16)]
    owners: list[str] = []
    for n, (op, dt) in enumerate(ops):
        now = n + dt
        if op[0] == "alloc":
            _, chain, length, shadow = op
            got = [kv.allocate(f"o{n}", _chain(chain, length), 0, KVClass.SHADOW if shadow else KVClass.NORMAL, now)
                   is not None for kv in kvs]
            assert got[0] == got[1]
            if got[0]:
                owners.append(f"o{n}")
        elif owners:
            owner = owners.pop(op[1] % len(owners))
            kvs[0].release(owner, now)
            kv = kvs[1]
            kv._settle()
            o = kv._owners.pop(owner)
            kv._unref(reversed(o.hashes), frozenset({-1}), now)  # the loop: a keep that holds none of them
            kv._free(o.num_private_blocks, o.kv_class)
        a, b = kvs
        assert (a._mixed, a._idle_left) == (b._mixed, b._idle_left), (n, op)
        assert _state(a) == _state(b), (n, op)
