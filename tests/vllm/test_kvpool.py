"""The core's KV classes in vLLM's own block pool.

Unit tests drive a real ``vllm.v1.core.block_pool.BlockPool`` directly;
the engine test checks the shadow cap at every step of a real engine by
reading the pool (which blocks hold which request's content), not the
bridge's counters.
"""

from __future__ import annotations

import pytest
from shadow_vllm.engine_config import engine_args
from shadow_vllm.kvpool import ShadowKVBridge

from shadowcore.kv import KVClass, KVClassPolicy

BLOCK = 32


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def _pool(num_blocks: int, policy: KVClassPolicy, clock: Clock, bridged: bool = True):
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=16)
    bridge = ShadowKVBridge(pool, policy, clock) if bridged else None
    return pool, bridge


def _cache(pool, blocks, tag: str) -> None:
    """Give ``blocks`` content hashes, as vLLM does once they are full."""
    from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

    for i, block in enumerate(blocks):
        pool._insert_block_hash(make_block_hash_with_group_id(BlockHash(f"{tag}{i}".encode()), 0), block, 16)


def _take(pool, bridge, n: int, shadow: bool, clock: Clock) -> list:
    if shadow:
        with bridge.shadow_allocation(clock(), ()):
            assert pool.get_num_free_blocks() >= n
            return pool.get_new_blocks(n)
    return pool.get_new_blocks(n)


def _scenario(bridged: bool):
    """2 shadow and 2 normal blocks cached and freed (normal first, so stock
    LRU would evict normal first); 3 never-used blocks stay free."""
    clock = Clock()
    pool, bridge = _pool(8, KVClassPolicy(shadow_cap_fraction=0.5, cold_age_s=5.0), clock, bridged)
    shadow = _take(pool, bridge, 2, bridged, clock)
    normal = pool.get_new_blocks(2)
    _cache(pool, shadow, "s")
    _cache(pool, normal, "n")
    pool.free_blocks(reversed(normal))
    pool.free_blocks(reversed(shadow))
    return pool, bridge, clock, [b.block_id for b in shadow], [b.block_id for b in normal]


def test_normal_allocation_evicts_never_used_then_shadow_then_normal() -> None:
    pool, bridge, _, shadow, normal = _scenario(bridged=True)
    assert bridge.num_shadow_blocks == 2
    first = [b.block_id for b in pool.get_new_blocks(3)]
    assert not set(first) & set(shadow + normal)  # never-used blocks go first (the pitfall)
    assert bridge.eviction_count == 0
    nxt = [b.block_id for b in pool.get_new_blocks(3)]
    assert nxt[:2] == shadow[::-1]  # least recently freed first (a chain is freed tail first)
    assert nxt[2] in normal
    assert bridge.num_evicted_blocks == {KVClass.SHADOW: 2, KVClass.NORMAL: 1}
    assert bridge.num_shadow_blocks == 0


def test_stock_pool_would_evict_normal_first() -> None:
    """The same scenario without the bridge: vLLM's LRU takes the normal blocks
    first, which is what the bridge changes."""
    pool, _, _, _, normal = _scenario(bridged=False)
    pool.get_new_blocks(3)
    nxt = [b.block_id for b in pool.get_new_blocks(2)]
    assert set(nxt) == set(normal)


def test_shadow_allocation_takes_only_cold_blocks_and_respects_the_cap() -> None:
    pool, bridge, clock, shadow, _ = _scenario(bridged=True)
    pool.get_new_blocks(3)  # the never-used blocks are gone: only idle cached blocks are free
    with bridge.shadow_allocation(clock(), ()):
        assert pool.get_num_free_blocks() == 0  # every idle block is younger than cold_age_s
    clock.now_s += 6.0
    with bridge.shadow_allocation(clock(), ()):
        # cap = 0.5 * 7 usable = 3 blocks; 2 shadow blocks exist: room for 1 more
        assert pool.get_num_free_blocks() == 1
        got = pool.get_new_blocks(1)
    assert got[0].block_id in shadow  # the oldest cold shadow block, not a normal one
    assert bridge.num_shadow_blocks == 2  # one evicted, one new: still within the cap


def test_one_lru_evicts_the_least_recently_freed_block_of_either_class() -> None:
    """``eviction_order="lru"``: normal blocks freed before the shadow ones go
    first (still after the never-used blocks); a shadow allocation takes the
    oldest cold block of either class."""
    clock = Clock()
    policy = KVClassPolicy(shadow_cap_fraction=0.5, cold_age_s=5.0, eviction_order="lru")
    pool, bridge = _pool(8, policy, clock)
    shadow = _take(pool, bridge, 2, True, clock)
    normal = pool.get_new_blocks(2)
    _cache(pool, shadow, "s")
    _cache(pool, normal, "n")
    pool.free_blocks(reversed(normal))
    clock.now_s += 1.0
    pool.free_blocks(reversed(shadow))
    shadow, normal = [b.block_id for b in shadow], [b.block_id for b in normal]
    first = [b.block_id for b in pool.get_new_blocks(3)]
    assert not set(first) & set(shadow + normal) and bridge.eviction_count == 0
    assert [b.block_id for b in pool.get_new_blocks(1)] == [normal[1]]  # released first (a chain tail first)
    clock.now_s += 6.0  # every idle block is cold now
    with bridge.shadow_allocation(clock(), ()):
        assert pool.get_num_free_blocks() == 1  # cap 3 of 7 usable, 2 shadow blocks cached
        assert [b.block_id for b in pool.get_new_blocks(1)] == [normal[0]]  # older than either shadow block
    assert [b.block_id for b in pool.get_new_blocks(2)] == shadow[::-1]
    assert bridge.num_evicted_blocks == {KVClass.SHADOW: 2, KVClass.NORMAL: 2}


def test_normal_hit_promotes_a_shadow_block() -> None:
    pool, bridge, _, shadow, _ = _scenario(bridged=True)
    pool.touch([pool.blocks[shadow[0]]])
    assert bridge.num_shadow_blocks == 1 and bridge.num_promoted_blocks == 1
    pool.free_blocks([pool.blocks[shadow[0]]])
    assert bridge.class_of(shadow[0]) is KVClass.NORMAL


def _shadow_blocks_in_pool(sched, shadow_requests) -> set[int]:
    """Block ids that hold shadow-only content: cached under a shadow prompt's
    hashes, or held by a shadow request (read from vLLM's pool and manager)."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    pool = sched.kv_cache_manager.block_pool
    ids: set[int] = set()
    for req in shadow_requests:
        for h in req.block_hashes:
            block = pool.cached_block_hash_to_block.get_one_block(make_block_hash_with_group_id(h, 0))
            if block is not None:
                ids.add(block.block_id)
        if req.request_id in sched.requests and not req.is_finished():
            ids.update(b.block_id for b in sched.kv_cache_manager.get_blocks(req.request_id).blocks[0])
    return ids


def test_shadow_cap_holds_at_every_step_of_a_real_engine(engines) -> None:
    from vllm import SamplingParams

    from shadowcore.wire import ShadowTag, TagKind

    policy = {"name": "harvest-slo", "args": {"shadow_cap": 0.125, "cold_age_s": 0.0}}
    llm = engines.start(**engine_args(policy))
    sched = engines.scheduler(llm)
    cap = sched.shadow_bridge.cap_blocks
    assert cap == 31
    engine = llm.llm_engine
    for i in range(3):  # 3 x 25 blocks of shadow content > the 31-block cap
        tag = ShadowTag(TagKind.SHADOW, f"cap{i}", "tiny", 0, 0.9 - 0.2 * i).to_extra_args()
        ids = [10 + (i * 31 + k * 17) % 400 for k in range(25 * BLOCK + 3)]
        engine.add_request(f"shadow{i}", {"prompt_token_ids": ids}, SamplingParams(max_tokens=1, extra_args=tag))
    shadow_reqs = [r for r in sched.requests.values() if r.request_id.startswith("shadow")]
    most, step = 0, 0
    for wave in range(3):  # normal traffic that fills the pool and forces evictions
        for i in range(8):
            ids = [11 + (wave * 101 + i * 13 + k * 7) % 400 for k in range(28 * BLOCK)]
            engine.add_request(f"normal{wave}.{i}", {"prompt_token_ids": ids},
                               SamplingParams(max_tokens=4, ignore_eos=True))
        while any(not r.is_finished() for r in sched.requests.values() if r.request_id.startswith("normal")):
            engine.step()
            step += 1
            used = _shadow_blocks_in_pool(sched, shadow_reqs)
            most = max(most, len(used))
            assert len(used) <= cap, f"step {step}: {len(used)} shadow blocks > cap {cap}"
            assert sched.shadow_bridge.num_shadow_blocks <= cap
        for _ in range(20):  # idle steps: shadows run in the slack
            engine.step()
            assert len(_shadow_blocks_in_pool(sched, shadow_reqs)) <= cap
    assert most >= cap - 3  # the cap was actually reached, so the check had teeth
    assert sched.shadow_bridge.num_evicted_blocks[KVClass.SHADOW] > 0  # normal work evicted shadow blocks
    assert sched.shadow_stats.num_shadow_tokens > cap * BLOCK  # and shadows went on after that
    engines.stop(llm)


@pytest.mark.parametrize("name", ["nope", ""])
def test_bad_policy_fails_engine_start_naming_the_field(engines, name) -> None:
    from shadowcore.errors import ConfigError

    extra = {"scheduler_cls": "shadow_vllm.scheduler.ShadowScheduler",
             "additional_config": {"shadowprefill": {"shadow": {"policy": name}}}}
    with pytest.raises(Exception) as info:
        engines.start(**extra)
    err = _root(info.value, ConfigError)
    assert err is not None, f"no ConfigError in {info.value!r}"
    assert str(err).startswith("additional_config.shadowprefill.shadow.policy")


def test_bad_json_fails_engine_start_naming_the_field(engines) -> None:
    from shadowcore.errors import ConfigError

    extra = {"scheduler_cls": "shadow_vllm.scheduler.ShadowScheduler",
             "additional_config": {"shadowprefill": '{"shadow": {"policy": "harvest-slo",}}'}}
    with pytest.raises(Exception) as info:
        engines.start(**extra)
    err = _root(info.value, ConfigError)
    assert err is not None and str(err).startswith("additional_config.shadowprefill:1:")


def _root(exc: BaseException, kind: type) -> BaseException | None:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None
