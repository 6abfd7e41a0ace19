"""The core's KV classes (:mod:`shadowcore.kv`) enforced in vLLM's block pool.

:class:`ShadowKVBridge` attaches to one vLLM ``BlockPool`` (and its
``FreeKVCacheBlockQueue``) by giving each object a subclass of its own class
that calls back into the bridge (vLLM glue). The rules are
:class:`shadowcore.kv.KVClassPolicy`'s: every victim the bridge picks is the
first of :meth:`~shadowcore.kv.KVClassPolicy.victims`, the choice
:class:`shadowcore.kv.KVClassManager` makes too. A block is in the *shadow class*
from the moment a shadow request gets it until a normal request hits it
(promotion: the shadow was used), it is evicted, or it is freed without a
hash (it then holds nothing).

Invariants (``tests/vllm/test_kvpool.py`` and the engine tests check them
through the pool itself):

* Shadow blocks (held by shadow requests or cached idle) never exceed
  ``policy.cap_blocks(num usable blocks)``: a shadow allocation sees
  ``get_num_free_blocks()`` as what the cap and the cold-age rule let it take
  (an instance attribute of the pool for the allocation's duration only),
  so vLLM's own ``allocate_slots`` refuses one that would break them.
* Eviction order for every allocation: never-used (hash-less) free blocks
  first, then, under ``eviction_order="shadow-first"``, idle shadow blocks
  (least recently freed first), then idle normal blocks (vLLM's LRU); under
  ``"lru"``, the least recently freed idle block of either class (on equal
  times the shadow block), as :class:`shadowcore.kv.KVClassManager` does.
  Shadow blocks are never evicted while a never-used block is free (the
  pitfall of moving them to the queue's front).
* A shadow allocation takes hash-less free blocks, or idle blocks (either
  class) freed more than ``cold_age_s`` ago; never a younger one.
* A block in use is never evicted (vLLM's rule; the bridge only reorders
  idle blocks).
* With no shadow request ever, every allocation returns the blocks stock
  vLLM returns (the queue's front), so the subclass schedules as stock. A
  ``lazy`` bridge (the scheduler's) is not even attached until
  :meth:`ShadowKVBridge.attach` (the first shadow request): until then vLLM's
  pool and queue run their own classes, at no cost. Blocks cached before the
  attachment count as idle from that moment (their true release time is not
  known), so the cold-age rule protects them for ``cold_age_s`` more: the
  conservative side for normal traffic.

Times are seconds on the scheduler's clock (``shadow_clock``).
"""

from __future__ import annotations

import contextlib
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from shadowcore.kv import KVClass, KVClassPolicy


class ShadowKVBridge:
    """Shadow/normal classes, shadow cap and cold age for one vLLM block pool."""

    def __init__(self, pool: Any, policy: KVClassPolicy, clock: Callable[[], float], *, lazy: bool = False) -> None:
        self.pool = pool
        self.policy = policy
        self.clock = clock
        self.num_usable_blocks = pool.num_gpu_blocks - 1  # vLLM's null block is never handed out
        self.cap_blocks = policy.cap_blocks(self.num_usable_blocks)
        self.shadow_ids: set[int] = set()
        #: Idle (free, hashed) blocks per class, in eviction order, with the time they were freed.
        self.idle: dict[KVClass, OrderedDict[int, float]] = {KVClass.SHADOW: OrderedDict(), KVClass.NORMAL: OrderedDict()}
        self.eviction_count = 0
        self.num_evicted_blocks = {KVClass.SHADOW: 0, KVClass.NORMAL: 0}
        self.num_promoted_blocks = 0
        self._shadow_now_s: float | None = None  # set while a shadow request allocates
        self._shadow_hit_ids: frozenset[int] = frozenset()
        self.attached = False
        if not lazy:
            self.attach()

    def attach(self) -> None:
        """Hook into the pool and its free queue (once): from now on the
        bridge sees every block that goes idle, is evicted or is touched."""
        if self.attached:
            return
        pool, queue = self.pool, self.pool.free_block_queue
        now_s = self.clock()
        for block in queue.get_all_free_blocks():
            if block.block_hash is not None:
                self.idle[KVClass.NORMAL][block.block_id] = now_s
        pool.__class__ = _subclass(type(pool), _PoolHooks)
        queue.__class__ = _subclass(type(queue), _QueueHooks)
        pool._shadow_bridge = self
        queue._shadow_bridge = self
        self.attached = True

    # -- queries ---------------------------------------------------------------------
    @property
    def num_shadow_blocks(self) -> int:
        return len(self.shadow_ids)

    @property
    def is_shadow_allocating(self) -> bool:
        return self._shadow_now_s is not None

    def class_of(self, block_id: int) -> KVClass:
        return KVClass.SHADOW if block_id in self.shadow_ids else KVClass.NORMAL

    def shadow_room_blocks(self, now_s: float, exclude: frozenset[int] = frozenset()) -> int:
        """Blocks a shadow allocation may take now: room under the cap, limited
        to hash-less free blocks plus cold idle blocks (``exclude``: idle blocks
        the allocation itself hits, which it reuses rather than evicts)."""
        self.attach()
        room = self.cap_blocks - len(self.shadow_ids)
        if room <= 0:
            return 0
        queue = self.pool.free_block_queue
        unhashed = queue.num_free_blocks - len(self.idle[KVClass.SHADOW]) - len(self.idle[KVClass.NORMAL])
        if unhashed >= room:
            return room
        return min(room, unhashed + self._count_cold(now_s, room - unhashed, exclude))

    def _count_cold(self, now_s: float, limit: int, exclude: frozenset[int]) -> int:
        """Idle blocks (at most ``limit``) a shadow allocation may evict now, ``exclude`` aside."""
        return sum(1 for _ in itertools.islice(self.policy.victims(self.idle, KVClass.SHADOW, now_s, exclude), limit))

    # -- the shadow requester --------------------------------------------------------
    @contextlib.contextmanager
    def shadow_allocation(self, now_s: float, hit_blocks: Iterable[Any]) -> Iterator[None]:
        """Allocations inside this block are a shadow request's."""
        self.attach()
        self._shadow_now_s = now_s
        self._shadow_hit_ids = frozenset(b.block_id for b in hit_blocks if b.ref_cnt == 0)
        # Only a shadow allocation sees the limited count: an instance attribute
        # for its duration, so every other allocation calls vLLM's own method.
        self.pool.get_num_free_blocks = self._num_free_blocks_for_shadow
        try:
            yield
        finally:
            del self.pool.get_num_free_blocks
            self._shadow_now_s = None
            self._shadow_hit_ids = frozenset()

    def _num_free_blocks_for_shadow(self) -> int:
        """``BlockPool.get_num_free_blocks`` as a shadow allocation sees it."""
        return min(type(self.pool).get_num_free_blocks(self.pool), self._free_for_shadow())

    def _free_for_shadow(self) -> int:
        assert self._shadow_now_s is not None
        hits = self._shadow_hit_ids
        return self.shadow_room_blocks(self._shadow_now_s, hits) + len(hits)

    # -- callbacks from the pool and queue ---------------------------------------------
    def _on_idle(self, blocks: Iterable[Any]) -> None:
        now_s = None
        for block in blocks:
            block_id = block.block_id
            if block.block_hash is None:
                self.shadow_ids.discard(block_id)  # holds nothing any more
                continue
            if now_s is None:
                now_s = self.clock()
            self.idle[self.class_of(block_id)][block_id] = now_s

    def _on_leave_queue(self, block: Any) -> None:
        block_id = block.block_id
        if self.idle[KVClass.SHADOW].pop(block_id, None) is None:
            self.idle[KVClass.NORMAL].pop(block_id, None)

    def _on_touch(self, blocks: Sequence[Any]) -> None:
        if self._shadow_now_s is not None or not self.shadow_ids:
            return
        for block in blocks:
            if block.block_id in self.shadow_ids:
                self.shadow_ids.discard(block.block_id)
                self.num_promoted_blocks += 1

    def _on_evicted(self, block: Any) -> None:
        self.eviction_count += 1
        cls = self.class_of(block.block_id)
        self.num_evicted_blocks[cls] += 1
        self.shadow_ids.discard(block.block_id)

    def _on_new_blocks(self, blocks: Sequence[Any]) -> None:
        if self._shadow_now_s is not None:
            self.shadow_ids.update(b.block_id for b in blocks)

    def _on_reset(self) -> None:
        self.idle[KVClass.SHADOW].clear()
        self.idle[KVClass.NORMAL].clear()
        self.shadow_ids = {b for b in self.shadow_ids if self.pool.blocks[b].ref_cnt > 0}
        self.eviction_count += 1

    def _next_idle(self) -> Any | None:
        """The idle hashed block the next allocation evicts, or None for the queue's front."""
        queue = self.pool.free_block_queue
        first = queue.fake_free_list_head.next_free_block
        if first is not None and first is not queue.fake_free_list_tail and first.block_hash is None:
            return None  # never-used blocks go first
        now_s = self._shadow_now_s  # set: a shadow allocation (cold blocks only); None: a normal one
        if now_s is None:
            if not self.idle[KVClass.SHADOW] and self.policy.eviction_order == "shadow-first":
                return None  # the policy's order is then vLLM's own LRU: the queue's front
            victim = next(self.policy.victims(self.idle, KVClass.NORMAL), None)
        else:
            victim = next(self.policy.victims(self.idle, KVClass.SHADOW, now_s), None)
            if victim is None:
                raise AssertionError("shadow allocation beyond its room (get_num_free_blocks was checked)")
        return None if victim is None else self.pool.blocks[victim[0]]


def _subclass(base: type, hooks: type) -> type:
    """``hooks`` mixed into ``base`` (cached per base)."""
    key = (base, hooks)
    cls = _SUBCLASSES.get(key)
    if cls is None:
        cls = type(f"Shadow{base.__name__}", (hooks, base), {"__module__": __name__})
        _SUBCLASSES[key] = cls
    return cls


_SUBCLASSES: dict[tuple[type, type], type] = {}


class _PoolHooks:
    """Mixed into vLLM's ``BlockPool``."""

    _shadow_bridge: ShadowKVBridge

    def get_new_blocks(self, num_blocks: int) -> list:
        blocks = super().get_new_blocks(num_blocks)
        self._shadow_bridge._on_new_blocks(blocks)
        return blocks

    def touch(self, blocks) -> None:
        self._shadow_bridge._on_touch(blocks)
        super().touch(blocks)

    def _maybe_evict_cached_block(self, block) -> bool:
        evicted = super()._maybe_evict_cached_block(block)
        if evicted:
            self._shadow_bridge._on_evicted(block)
        return evicted

    def reset_prefix_cache(self) -> bool:
        done = super().reset_prefix_cache()
        if done:
            self._shadow_bridge._on_reset()
        return done


class _QueueHooks:
    """Mixed into vLLM's ``FreeKVCacheBlockQueue``: pops follow the bridge's order."""

    _shadow_bridge: ShadowKVBridge

    def popleft(self):
        block = self._shadow_bridge._next_idle()
        if block is None:
            block = super().popleft()
        else:
            super().remove(block)
        self._shadow_bridge._on_leave_queue(block)
        return block

    def popleft_n(self, n: int) -> list:
        bridge = self._shadow_bridge
        if not bridge.is_shadow_allocating and not bridge.idle[KVClass.SHADOW]:
            blocks = super().popleft_n(n)  # stock order
            for block in blocks:
                bridge._on_leave_queue(block)
            return blocks
        return [self.popleft() for _ in range(n)]

    def remove(self, block) -> None:
        super().remove(block)
        self._shadow_bridge._on_leave_queue(block)

    def append(self, block) -> None:
        super().append(block)
        self._shadow_bridge._on_idle((block,))

    def append_n(self, blocks) -> None:
        super().append_n(blocks)
        self._shadow_bridge._on_idle(blocks)

    def prepend_n(self, blocks) -> None:
        super().prepend_n(blocks)
        self._shadow_bridge._on_idle(blocks)
