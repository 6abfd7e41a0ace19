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

from .test_speed_equivalence_kv import _chain, _run, _state

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


class _Key:
    """A lookup's key (remembered per key object, as the engine per history)."""


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


def _drive(capacity: int, ops: list) -> None:
    policy = KVClassPolicy(shadow_cap_fraction=0.5, cold_age_s=2.0,
                           host=HostTierParams(capacity_bytes=capacity * 16 * 131072.0) if capacity else None)
    kvs = [KVClassManager(24, 16, policy), KVClassManager(24, 16, policy)]  # [reads that may leave debt, settled]
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
