"""KV classes: a block-level prefix cache with a normal and a shadow class,
plus an optional host-memory tier.

Layers (vLLM v1 style): the engine asks :class:`KVClassManager` for blocks on
behalf of an *owner* (a request or a shadow chunk); which idle cached block an
allocation evicts is decided in one place, :meth:`KVClassPolicy.victims`
(classes, order, cold age), which the manager and the vLLM backend's
block-pool bridge both call.

Invariants (each has a property test):

* Shadow blocks (in use or cached) never exceed ``cap_blocks``.
* Eviction order (``KVClassPolicy.eviction_order``). ``"shadow-first"`` (the
  paper's): a normal allocation evicts an idle shadow block before any
  normal block, LRU (least recently released first) within a class.
  ``"lru"``: one LRU over both classes (the earlier release first; on equal
  release times shadow blocks first). Either way a released chain goes idle
  tail first, so its tail is evicted before its head and what survives is
  still a prefix (vLLM frees blocks in reverse order too).
* A shadow allocation takes free blocks or idle blocks older than
  ``cold_age_s`` only; it never displaces a younger entry of either class.
* A block in use (ref count > 0) is never evicted.
* The host tier never holds more than its capacity; a hit on it costs
  ``bytes / pcie_bytes_per_s`` and moves the block back to the device.
* A normal hit on a shadow block promotes it to the normal class: the shadow
  was used. So every block a normal owner holds is normal (only a shadow
  owner's new blocks are shadow, and a block in use is never evicted). ``num_shadow_blocks_used`` counts these hits, on the device and on
  the host tier alike (a host hit reloads the block as normal), once per block;
  it is THE "shadow tokens used" of the results (times the block size).

Cost (issue 17): the manager works on runs of blocks, not block by block in
Python. Sessions' calls carry thousands of blocks, so an allocation, a
release, a finished request's caching, an eviction and its spill to the host
tier each run as a few C-level passes (``dict.update``, ``map``,
``takewhile``) over the run, with Python work per run of one state:

* Blocks in the same state share one state tuple: every block one release
  made idle holds ``(shadow, 0, time, release id)``, so a run changes state
  by one ``dict.update`` over a repeated tuple.
* A release is the unit of coldness: its blocks go idle together and turn
  cold together once it is older than ``cold_age_s``; the manager keeps per
  release the count of its blocks still idle (O(1) per release to turn cold;
  blocks leaving idle leave their release's count, per run of one release).
* Each class's idle order is its release order, so a run of victims of one
  class is sorted by release. It is kept as the runs releases appended
  (:class:`_IdleRuns`): an entry is live while its block holds the run's
  state tuple, so a release appends one run and a hit or an eviction leaves
  stale entries behind instead of deleting block by block.
* Evictions for normal owners are owed, not made, where nothing can tell
  the difference: ``extend_private`` (decode growth) and a normal
  allocation or extension that reloads nothing from the host tier take free
  blocks and count the rest as owed; every other query or change but a
  private allocation and a private owner's finish first makes the owed
  evictions in one go (:meth:`KVClassManager._settle`), which are exactly
  the ones the takes would have made (only normal takes and private finishes
  ran since, which leave the idle orders' heads and the host tier as they
  were, and a normal requester's victims do not depend on the time). ``eviction_count`` and ``num_idle_blocks`` count the
  debt without settling it; a remembered prefix lookup and the shadow room
  read past it while every owed victim is a private head run whose spill
  trims only private host-tier entries (``_owed_scan_now``: settling then
  changes no named key set, and the room subtracts the cold victims).
* Device and host tier are disjoint, so a spilled run enters the host tier in
  one update with one capacity check (exactly an LRU of single spills). The
  tier is a plain dict in LRU order plus the runs spills appended
  (:class:`_HostTier`), so its least recent blocks leave by a slice of the
  head run, not a linked-list node per block.
* A fast path only takes a run whose blocks are distinct and alike (one
  class, one owner holding them); anything else goes block by block, with
  the same result.
* Private blocks (``allocate(private=True)``: a normal request's fresh
  prompt, whose hashes nothing else names) stay out of the block map: held,
  a count; finished, one idle run whose live entries are the last ones its
  release has idle (only eviction, from the run's front, takes them), evicted
  by count. A preemption, a lookup starting at a private chain's first block
  and a by-hash query give them their entries first, so every result and
  query equals the same calls without ``private``. Evicted, a private
  run's pieces stay private in the host tier too (runs kept by count, out
  of its dict); a lookup starting at the chain's first block and a by-hash
  host-tier query (``in_host``) name them first.
"""

from __future__ import annotations

import bisect
import enum
import heapq
import itertools
from collections import deque
from collections.abc import Callable, Container, Hashable, Iterable, Iterator, Mapping, Sequence
from itertools import compress, islice, repeat, takewhile
from operator import and_, attrgetter, countOf, is_, itemgetter, not_
from typing import TypeVar

import attrs

from shadowcore._validators import fraction_open_closed, non_negative, one_of, positive, positive_int


class KVClass(enum.Enum):
    NORMAL = "normal"
    SHADOW = "shadow"

    # Members are singletons: identity hashing is exact and keeps dict lookups
    # keyed by class (idle lists, counters) in C (Enum's own __hash__ is Python).
    __hash__ = object.__hash__


@attrs.frozen
class HostTierParams:
    """Host DRAM behind one instance and the PCIe link to it."""

    capacity_bytes: float = attrs.field(default=32e9, validator=non_negative)
    pcie_bytes_per_s: float = attrs.field(default=25e9, validator=positive)


#: ``KVClassPolicy.eviction_order`` values.
EVICTION_ORDERS = ("shadow-first", "lru")
#: The class order of ``"shadow-first"`` eviction.
_SHADOW_FIRST = (KVClass.SHADOW, KVClass.NORMAL)
_B = TypeVar("_B")  # a block's key: a content hash (the manager), a block id (the vLLM bridge)


@attrs.frozen
class KVClassPolicy:
    """The rules of the two classes, as pure functions of block metadata.

    ``eviction_order`` says which idle block an allocation evicts:
    ``"shadow-first"`` (the paper's evict-first shadow class: every idle
    shadow block goes before any normal one) or ``"lru"`` (the least recently
    released block of either class; shadow blocks keep their cap and a shadow
    allocation still takes only cold blocks). Under normal traffic with little
    prefix reuse, shadow-first evicts a shadow before its switch call comes
    while normal blocks nobody will hit again stay cached (docs/architecture.md,
    "KV classes").
    """

    shadow_cap_fraction: float = attrs.field(default=0.25, validator=fraction_open_closed)
    cold_age_s: float = attrs.field(default=5.0, validator=non_negative)
    host: HostTierParams | None = None
    eviction_order: str = attrs.field(default="shadow-first", validator=one_of(*EVICTION_ORDERS))

    def cap_blocks(self, num_blocks: int) -> int:
        return int(self.shadow_cap_fraction * num_blocks)

    def shadow_may_displace(self, idle_since_s: float, now_s: float) -> bool:
        """A shadow chunk may take an idle block only once it is cold."""
        return now_s - idle_since_s > self.cold_age_s

    def victims(self, idle: Mapping[KVClass, Mapping[_B, float]], requester: KVClass, now_s: float | None = None,
                protect: Container[_B] = ()) -> Iterator[tuple[_B, KVClass]]:
        """The idle blocks an allocation by ``requester`` may evict, in the
        order it evicts them, as ``(block, class)``: the one owner of the
        victim choice (:class:`KVClassManager` and the vLLM block-pool bridge
        both take their victims from here).

        ``idle[cls]`` maps each idle block of a class to the time it went idle,
        in release order (oldest first). Blocks of ``protect`` are skipped.
        ``"shadow-first"``: every idle shadow block before any normal one, in
        release order within a class. ``"lru"``: one release order over both
        classes (equal times: the shadow block first). A shadow requester gets
        cold blocks only (:meth:`shadow_may_displace`): a class's first young
        block ends that class (under ``"lru"``, the whole order), since every
        later one is younger (``now_s``, needed for a shadow requester only,
        is the time of that check). The caller takes as many as it needs and
        must not change ``idle`` while it iterates.
        """
        shadow_requester = requester is KVClass.SHADOW
        if shadow_requester and now_s is None:
            raise ValueError("a shadow requester's victims need now_s (the cold-age rule)")
        if self.eviction_order == "lru":
            return self._lru_victims(idle, shadow_requester, now_s, protect)
        if not shadow_requester and not protect:  # nothing skipped, nothing cold-checked: the classes' orders, in C
            return itertools.chain.from_iterable(zip(idle[cls], repeat(cls)) for cls in _SHADOW_FIRST)
        return self._class_victims(idle, shadow_requester, now_s, protect)

    def victim_runs(self, idle: Mapping[KVClass, Mapping[_B, float]], requester: KVClass, num: int,
                    now_s: float | None = None, protect: Container[_B] = ()) -> list[tuple[KVClass, list[_B]]]:
        """The first ``num`` of :meth:`victims` (fewer when there are not that
        many), as runs of one class in eviction order: what an allocation that
        needs ``num`` blocks evicts, class by class. Exactly
        ``groupby(islice(victims(...), num))``; the common case (shadow-first,
        a normal requester, nothing protected: each class's release order from
        its head) slices the idle maps directly: an idle map that has a
        ``first(num)`` method (the manager's: a sequence equal to
        ``list(islice(m, num))``, per run while it holds private runs) is
        asked for it, and its sequence is the class's run as it is."""
        if self.takes_heads(requester, protect):
            runs = []
            for cls in _SHADOW_FIRST:
                if num <= 0:
                    break
                first = getattr(idle[cls], "first", None)
                head = first(num) if first is not None else list(itertools.islice(idle[cls], num))
                if head:
                    runs.append((cls, head))
                    num -= len(head)
            return runs
        chosen = itertools.islice(self.victims(idle, requester, now_s, protect), num)
        return [(cls, [block for block, _ in run]) for cls, run in itertools.groupby(chosen, itemgetter(1))]

    def takes_heads(self, requester: KVClass, protect: Container = ()) -> bool:
        """Whether :meth:`victim_runs` for ``requester`` takes each class's
        release order from its head (shadow-first, a normal requester, nothing
        protected): no cold check, nothing skipped, nothing read but the
        heads' next blocks."""
        return self.eviction_order == "shadow-first" and requester is KVClass.NORMAL and not protect

    def _class_victims(self, idle: Mapping[KVClass, Mapping[_B, float]], shadow_requester: bool, now_s: float,
                       protect: Container[_B]) -> Iterator[tuple[_B, KVClass]]:
        for cls in _SHADOW_FIRST:
            for block, since in idle[cls].items():
                if block in protect:
                    continue
                if shadow_requester and not self.shadow_may_displace(since, now_s):
                    break
                yield block, cls

    def _lru_victims(self, idle: Mapping[KVClass, Mapping[_B, float]], shadow_requester: bool, now_s: float,
                     protect: Container[_B]) -> Iterator[tuple[_B, KVClass]]:
        by_class = [zip(idle[cls].values(), idle[cls], repeat(cls)) for cls in _SHADOW_FIRST]  # (since, block, cls)
        for since, block, cls in heapq.merge(*by_class, key=itemgetter(0)):  # stable: shadow first on ties
            if block in protect:
                continue
            if shadow_requester and not self.shadow_may_displace(since, now_s):
                return
            yield block, cls


@attrs.frozen
class PrefixMatch:
    """Longest cached prefix of a block-hash chain: first on the device, then
    continuing in the host tier."""

    num_device_blocks: int
    num_host_blocks: int

    @property
    def num_blocks(self) -> int:
        return self.num_device_blocks + self.num_host_blocks


@attrs.frozen
class Allocation:
    """Result of a successful allocation for one owner."""

    num_device_hit_blocks: int
    num_host_hit_blocks: int
    num_new_blocks: int
    reload_s: float
    num_shadow_blocks_used: int  # shadow blocks a normal owner hit, device or host tier (now promoted)


#: A private allocation's result by its number of new blocks (no hit, no reload: a frozen value, shared)
_PRIVATE_ALLOCATIONS: dict[int, Allocation] = {}


# A cached block's state is one tuple ``(shadow, ref_count, idle_since_s, release)``:
#   shadow        its class (True: KVClass.SHADOW); a bool, so the tuple holds atomic values only and the
#                 garbage collector stops tracking it at its first collection (no object per block to scan)
#   ref_count     owners holding it; 0: idle, in its class's LRU order
#   idle_since_s  when it last went idle (0.0 if never since cached)
#   release       the id of the release that made it idle (-1 if never)
# While idle, a block is cold (counted in _num_cold_idle) iff its release has aged past the cold age
# (_refresh_cold): its id has left _live. A change replaces the tuple; blocks in the same state share one
# tuple (a new held block of a class, the blocks one release made idle), so a run of blocks changes state
# in one dict.update over a repeated tuple.
_KV_CLASS = (KVClass.NORMAL, KVClass.SHADOW)  # by the shadow flag
_HELD = {KVClass.NORMAL: (False, 1, 0.0, -1), KVClass.SHADOW: (True, 1, 0.0, -1)}
_KV_CLASS_FLAG = itemgetter(0)
_REF, _SINCE, _RELEASE = itemgetter(1), itemgetter(2), itemgetter(3)
_FIRST, _SECOND = itemgetter(0), itemgetter(1)
_OWNER_CLASS = attrgetter("kv_class")


def _run_length(keys: Container[int], hashes: Sequence[int]) -> int:
    """How many of ``hashes``, from the first, are in ``keys`` (a C-level scan)."""
    return len(list(takewhile(keys.__contains__, hashes)))


#: Stale entries an idle order may hold beyond its live ones before it compacts (see _IdleRuns).
_COMPACT_SLACK = 1024


class _IdleRuns(Mapping):
    """One class's idle blocks in release order, as the runs releases
    appended: ``Mapping[hash, idle since]`` for :meth:`KVClassPolicy.victims`.

    A release appends its blocks of this class as one run ``(state,
    hashes)``, ``state`` the one state tuple every block of the run got (the
    manager's blocks one release made idle share it). An entry is live while
    its block still holds that very tuple (``blocks.get(h) is state``): a hit
    or an eviction changes or drops the block's state and so leaves its entry
    stale with no work here; the caller only says how many blocks of the
    class left (:meth:`left`). So a release costs O(1) here and a hit or an
    eviction nothing per block, where an ordered dict costs a node per block
    on each.

    A private run (its release in ``anon``: blocks not in ``blocks``) is
    the exception: its live entries are its last ``releases[r]`` ones.

    Invariants: ``count`` is the number of live entries; iteration yields
    the live ones in run order, which is the release order (the order an
    ordered dict of the same insertions and deletions has); stale entries
    are skipped, trimmed from the head as iteration reaches them, and
    dropped all at once when they outnumber the live ones by more than
    ``_COMPACT_SLACK`` (amortised O(1) per stale entry). The owner must not
    change the order while it iterates."""

    __slots__ = ("_anon", "_blocks", "_mixed", "_pos", "_releases", "_runs", "_shadow", "_stored", "count")

    def __init__(self, blocks: dict[int, tuple], shadow: bool, releases: dict[int, int], mixed: Container[int],
                 anon: Container[int] = ()) -> None:
        # releases: per release, its blocks still idle; mixed: the releases that made blocks of both classes idle.
        # A run of a release not mixed whose idle count is the number of its entries from the head on has no
        # stale entry there (its live entries are all at or after the head).
        # anon: the releases whose runs are private (KVClassManager: blocks not in ``blocks``): such a run's
        # blocks leave idle only by eviction from its front, so its live entries are its last ``releases[r]``.
        self._blocks, self._shadow, self._releases, self._mixed = blocks, shadow, releases, mixed
        self._anon = anon
        self._runs: deque[tuple[tuple, list[int]]] = deque()
        self._pos = 0  # the head run's first entry not yet trimmed
        self.count = 0  # live entries
        self._stored = 0  # entries from the head position on, live or stale

    def append(self, state: tuple, hashes: list[int]) -> None:
        """Blocks that just went idle in this class, in order, each now
        holding ``state`` (not to be changed while they stay idle)."""
        if hashes:
            self._runs.append((state, hashes))
            self.count += len(hashes)
            self._stored += len(hashes)

    def left(self, num: int) -> None:
        """``num`` live entries' blocks left idle (hit or evicted)."""
        self.count -= num
        if self._stored - self.count > self.count + _COMPACT_SLACK:
            self._compact()

    def evicted(self, victims: list[int]) -> None:
        """``victims`` (live entries, in order) were just evicted: they
        leave, and when they are the head's next entries (the usual: the
        victims :meth:`first` gave) the head moves past them unread."""
        runs = self._runs
        if runs:
            hashes, pos = runs[0][1], self._pos
            end = pos + len(victims)
            if end <= len(hashes) and hashes[pos:end] == victims:  # identical objects: compared by pointer
                self._stored -= len(victims)
                if end == len(hashes):
                    runs.popleft()
                    end = 0
                self._pos = end
        self.left(len(victims))

    def _live(self, state: tuple, hashes: Sequence[int], start: int = 0) -> Iterator[int]:
        if state[3] in self._anon:  # a private run: its last releases[r] entries are live
            return islice(hashes, max(start, len(hashes) - self._releases.get(state[3], 0)), None)
        return compress(islice(hashes, start, None), map(is_, map(self._blocks.get, islice(hashes, start, None)),
                                                         repeat(state)))

    def _trim(self) -> None:
        """Drop the stale entries at the head (each once)."""
        runs, get, releases = self._runs, self._blocks.get, self._releases
        while runs:
            state, hashes = runs[0]
            pos, n = self._pos, len(hashes)
            if state[3] not in releases:  # nothing of its release is idle: a dead run, dropped unread
                runs.popleft()
                self._stored -= n - pos
                self._pos = 0
                continue
            if state[3] in self._anon:  # a private run: live from its last releases[r] entries on
                live_from = max(pos, n - releases[state[3]])
                self._stored -= live_from - pos
                self._pos = live_from
                return
            if pos < n and get(hashes[pos]) is state:
                return
            if pos + 1 < n and get(hashes[pos + 1]) is state:  # the usual: the head was just evicted
                self._stored -= 1
                self._pos = pos + 1
                return
            i = next(compress(itertools.count(pos), map(is_, map(get, islice(hashes, pos, None)), repeat(state))),
                     -1)
            if i >= 0:
                self._stored -= i - pos
                self._pos = i
                return
            runs.popleft()
            self._stored -= len(hashes) - pos
            self._pos = 0

    def _compact(self) -> None:
        runs, pos = deque(), self._pos
        for k, (state, hashes) in enumerate(self._runs):
            if state[3] not in self._releases:
                continue
            live = list(self._live(state, hashes, pos if k == 0 else 0))
            if live:
                runs.append((state, live))
        self._runs, self._pos, self._stored = runs, 0, self.count

    def first(self, num: int) -> list[int] | _HeadRun:
        """``list(islice(self, num))``: the next ``num`` to evict, in order
        (fewer when there are not that many; all of them, as a list, when
        ``num`` reaches the count); otherwise a slice of the head run when
        they are its next entries (the usual case). While the order holds
        private runs, a :class:`_HeadRun` of the same entries (per run,
        nothing materialised)."""
        if not self.count:
            return []
        if num >= self.count:
            return list(self)
        self._trim()
        state, hashes = self._runs[0]
        pos = self._pos
        releases, mixed = self._releases, self._mixed
        if self._anon:
            return self._head_run(num)
        if pos + num <= len(hashes):
            head = hashes[pos : pos + num]
            if (num == 1 or (state[3] not in mixed and releases[state[3]] == len(hashes) - pos)  # trimmed: [0] live
                    or all(map(is_, map(self._blocks.get, head), repeat(state)))):
                return head
        out: list[int] = []  # run by run (no chained iterators), dead runs unread, clean runs sliced
        for state, hashes in self._runs:
            release = state[3]
            if pos or release in releases:
                if release not in mixed and releases[release] == len(hashes) - pos:
                    out += hashes[pos : pos + num - len(out)]
                else:
                    out += islice(self._live(state, hashes, pos), num - len(out))
                if len(out) == num:
                    break
            pos = 0
        return out

    def _head_run(self, num: int) -> _HeadRun:
        """:meth:`first` as the runs' pieces (after the trim; ``num`` < count)."""
        releases, mixed = self._releases, self._mixed
        pieces, got, pos = [], 0, self._pos
        for state, hashes in self._runs:
            release = state[3]
            if pos or release in releases:
                if release not in mixed and releases[release] == len(hashes) - pos:  # clean: a slice
                    piece = hashes[pos : pos + num - got]
                else:
                    piece = list(islice(self._live(state, hashes, pos), num - got))
                if piece:
                    pieces.append((state, piece))
                    got += len(piece)
                if got == num:
                    break
            pos = 0
        return _HeadRun(pieces, got)

    def __iter__(self) -> Iterator[int]:
        self._trim()
        runs = self._runs
        if not runs:
            return iter(())
        state, hashes = runs[0]
        head = self._live(state, hashes, self._pos)
        if len(runs) == 1:
            return head
        releases = self._releases
        return itertools.chain(head, itertools.chain.from_iterable(
            itertools.starmap(self._live, (run for run in islice(runs, 1, None) if run[0][3] in releases))))

    def __reversed__(self) -> Iterator[int]:
        return reversed(list(self))

    def head(self) -> tuple[tuple, Sequence[int]] | None:
        """The head run as ``(state, hashes)`` after the trim (its whole
        hashes: the live entries are the last ``releases[state[3]]``), or None
        when no run is left."""
        self._trim()
        return self._runs[0] if self._runs else None

    def runs_from_head(self) -> Iterator[tuple[tuple, Sequence[int]]]:
        """The runs as ``(state, hashes)`` in order, the head run from its
        first untrimmed entry (entries before it are not live); dead and
        stale entries are the caller's to skip."""
        self._trim()
        runs = self._runs
        if runs:
            state, hashes = runs[0]
            yield state, hashes[self._pos :]
            yield from islice(runs, 1, None)

    def __len__(self) -> int:
        return self.count

    def __contains__(self, block_hash: object) -> bool:
        state = self._blocks.get(block_hash)
        if state is None:
            return self._private_since(block_hash) is not None
        return state[1] == 0 and state[0] is self._shadow

    def __getitem__(self, block_hash: int) -> float:
        state = self._blocks.get(block_hash)
        if state is None:
            since = self._private_since(block_hash)
            if since is None:
                raise KeyError(block_hash)
            return since
        if state[1] or state[0] is not self._shadow:
            raise KeyError(block_hash)
        return state[2]

    def _private_since(self, block_hash: object) -> float | None:
        """The idle time of ``block_hash`` when it is a live entry of a
        private run (its blocks are not in the block map), else None: a scan
        of the private runs (O(runs), O(1) each for a range), for a policy
        that reads the order as a Mapping by key; the victim orders only
        iterate it."""
        if not self._anon:
            return None
        releases = self._releases
        for state, hashes in self.private_runs():
            if block_hash in hashes[len(hashes) - releases[state[3]] :]:
                return state[2]
        return None

    def private_runs(self) -> Iterator[tuple[tuple, Sequence[int]]]:
        """The private runs, as ``(state, hashes)`` in order (each run's
        live entries are its last ``releases[state[3]]``): a scan of the runs,
        for the rare reads by key and the manager's naming."""
        anon = self._anon
        return ((state, hashes) for state, hashes in self._runs if state[3] in anon)

    def values(self) -> Iterator[float]:
        return map(_SECOND, self._pairs())

    def _pairs(self) -> Iterator[tuple[int, float]]:
        """(hash, idle since) of the live entries in order: a live entry's block holds its run's state,
        and a private run's blocks keep it, so every entry of a run went idle at ``state[2]``."""
        self._trim()
        releases = self._releases
        for k, (state, hashes) in enumerate(self._runs):
            if k == 0 or state[3] in releases:
                yield from zip(self._live(state, hashes, self._pos if k == 0 else 0), repeat(state[2]))

    def items(self) -> _IdleItems:
        return _IdleItems(self)


class _HeadRun(Sequence):
    """The next blocks of an idle order from its head, as ``(state, hashes)``
    pieces, one per run (a private run's hashes may be a range): what
    :meth:`_IdleRuns.first` gives while the order holds private runs, so an
    eviction goes per run, not per block. A sequence of the hashes in
    order (materialised only when read by index)."""

    __slots__ = ("_list", "n", "pieces")

    def __init__(self, pieces: list[tuple[tuple, Sequence[int]]], n: int) -> None:
        self.pieces, self.n, self._list = pieces, n, None

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        return itertools.chain.from_iterable(map(_SECOND, self.pieces))

    def __getitem__(self, index):
        if self._list is None:
            self._list = list(self)
        return self._list[index]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None


class _IdleItems:
    """``_IdleRuns.items()``: (hash, idle since) in release order, lazily (reversible)."""

    __slots__ = ("_idle",)

    def __init__(self, idle: _IdleRuns) -> None:
        self._idle = idle

    def __iter__(self) -> Iterator[tuple[int, float]]:
        return self._idle._pairs()

    def __reversed__(self) -> Iterator[tuple[int, float]]:
        return reversed(list(self))

    def __len__(self) -> int:
        return self._idle.count


class _HostTier:
    """The host tier: an LRU of evicted blocks, spilled as the runs evictions
    make. ``blocks`` maps each named hash in the tier to the token of the
    spill that put it there (``(class, spill id)``, one tuple per spill); the
    manager reads and pops it directly (C-level passes). A plain dict keeps
    insertion order, and a key enters only by a spill (device and host tier
    are disjoint, so never twice), so its order is the LRU order of the named
    blocks; what a plain dict cannot do cheaply is drop its oldest entries,
    which is what the runs are for.

    A private spill (:meth:`spill` with ``head``: the next blocks of a private
    idle run, whose hashes nothing but a lookup of that chain from its first
    block ``head`` names) stays out of ``blocks``: a run kept by count, token
    ``(class, spill id, head)``. Nothing takes its blocks but the trim (a
    reload names them first: :meth:`name`), so its live entries are all its
    entries from the head position on. ``heads`` counts the private runs per
    chain head (the manager's trigger to name them, as its own
    ``_private_heads`` for the device).

    Invariants: ``_runs`` holds the spills in order as ``(token, hashes)``,
    ``_pos`` the head run's first entry not yet trimmed; a named run's entry
    is live while its block still holds that very token (``blocks.get(h) is
    token``: a reload pops the block, a later spill gives it a new token), a
    private run's entries are all live; each block in the tier has exactly
    one live entry, so ``_stored`` (the entries from the head position on)
    minus ``len(blocks)`` minus ``num_private`` is the number of stale ones,
    and ``_stale`` counts them per token (a run whose token is absent has
    none: its entries from the head on are sliced unchecked); trimming takes
    live entries from the head in order (exactly an LRU of single spills,
    each trimming to capacity), and the runs are rebuilt from their live
    entries when stale entries outnumber the live ones by more than
    ``_COMPACT_SLACK`` (amortised O(1) per stale entry)."""

    __slots__ = ("_pos", "_runs", "_spills", "_stale", "_stored", "blocks", "heads", "num_private", "removals")

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[KVClass, int]] = {}
        self._runs: deque[tuple[tuple, Sequence[int]]] = deque()
        self._pos = 0
        self._stored = 0
        self._spills = 0
        self._stale: dict[tuple[KVClass, int], int] = {}  # per spill token: its stale entries (none: absent)
        self.num_private = 0  # live entries of private runs (not in blocks)
        self.heads: dict[int, int] = {}  # a private chain's first hash -> its private runs here
        self.removals = 0  # removal events from ``blocks`` (trims, reloads, clears): see cached_prefix_blocks

    def __len__(self) -> int:
        return len(self.blocks) + self.num_private

    def spill(self, victims: Sequence[int], kv_class: KVClass, capacity: int, head: int | None = None) -> None:
        """``victims`` (none in the tier; not changed afterwards) enter as its
        most recent entries, in order; the least recent leave to
        ``capacity`` (> 0). With ``head``, a private spill: blocks of the
        private chain whose first hash is ``head``, kept by count."""
        self._spills += 1
        token = (kv_class, self._spills) if head is None else (kv_class, self._spills, head)
        blocks = self.blocks
        if len(victims) >= capacity:  # the run alone fills the tier: only its last ``capacity`` stay
            kept = victims[len(victims) - capacity :]
            blocks.clear()
            self.removals += 1
            self._runs.clear()
            self._stale.clear()
            self.heads.clear()
            self.num_private = 0
            self._runs.append((token, kept))
            self._pos, self._stored = 0, capacity
            if head is None:
                blocks.update(zip(kept, repeat(token)))
            else:
                self.num_private, self.heads[head] = capacity, 1
            return
        if head is None:
            blocks.update(zip(victims, repeat(token)))
        else:
            self.num_private += len(victims)
            self.heads[head] = self.heads.get(head, 0) + 1
        self._runs.append((token, victims))
        self._stored += len(victims)
        excess = len(blocks) + self.num_private - capacity
        if excess > 0:  # the least recent leave first
            self._trim(excess)

    def _trim(self, excess: int) -> None:
        """Drop the ``excess`` least recent blocks (live entries from the head)."""
        blocks, runs, stale = self.blocks, self._runs, self._stale
        while excess > 0:
            token, hashes = runs[0]
            pos = self._pos
            end = min(len(hashes), pos + excess)
            if len(token) == 3:  # a private run: its entries from the head position on are live, by count
                self.num_private -= end - pos
                excess -= end - pos
                if end == len(hashes):
                    self._private_gone(token[2])
            else:
                chunk = hashes[pos:end]
                if token in stale:  # a run with stale entries: take its live ones
                    live = list(compress(chunk, map(is_, map(blocks.get, chunk), repeat(token))))
                    left = stale[token] - (len(chunk) - len(live))
                    if left:
                        stale[token] = left
                    else:
                        del stale[token]
                    chunk = live
                deque(map(blocks.__delitem__, chunk), 0)
                self.removals += 1
                excess -= len(chunk)
            self._stored -= end - pos
            if end == len(hashes):
                runs.popleft()
                end = 0
            self._pos = end

    def _private_gone(self, head: int) -> None:
        """A private run of the chain starting at ``head`` left the tier."""
        n = self.heads[head] - 1
        if n:
            self.heads[head] = n
        else:
            del self.heads[head]

    def head_token(self) -> tuple | None:
        """The least recent run's token (None: no run)."""
        return self._runs[0][0] if self._runs else None

    def private_cover(self, start: int, cover: int) -> tuple[int, int, bool]:
        """Scan the runs from index ``start`` (``cover`` entries found so far)
        for the least recent entries that are private runs' ones: ``(next
        index, cover, blocked)``, ``blocked`` when a named run ends it (a
        trim reaching a named run counts a removal, even of stale entries
        only). A trim of up to ``cover`` entries takes private ones only."""
        runs = self._runs
        for k in range(start, len(runs)):
            token, hashes = runs[k]
            if len(token) != 3:
                return k, cover, True
            cover += len(hashes) - (self._pos if k == 0 else 0)
        return len(runs), cover, False

    def take(self, hashes: Iterable[int]) -> None:
        """Reload: the blocks of ``hashes`` that are in the tier leave it
        (their entries go stale); compact when stale ones are too many.
        ``hashes`` holds no private block (the caller names them first)."""
        popped = list(filter(None, map(self.blocks.pop, hashes, repeat(None))))
        if not popped:
            return
        self.removals += 1
        stale = self._stale
        for token, group in itertools.groupby(popped):  # a reloaded chain's blocks come from few spills
            stale[token] = stale.get(token, 0) + len(list(group))
        live = len(self.blocks) + self.num_private
        if self._stored - live > live + _COMPACT_SLACK:
            self._compact()

    def _live_runs(self) -> Iterator[tuple[tuple, Sequence[int]]]:
        """The runs' live entries in LRU order, as ``(token, hashes)`` (no empty one)."""
        blocks = self.blocks
        for k, (token, hashes) in enumerate(self._runs):
            if k == 0:
                hashes = hashes[self._pos :]
            if len(token) == 2 and token in self._stale:
                hashes = list(compress(hashes, map(is_, map(blocks.get, hashes), repeat(token))))
            if hashes:
                yield token, hashes

    def _compact(self) -> None:
        """Drop the stale entries: the runs rebuilt from their live ones."""
        self._runs = deque(self._live_runs())
        self._pos, self._stored = 0, len(self)
        self._stale.clear()

    def name(self) -> None:
        """Give the private runs' blocks their entries in ``blocks`` (each its
        run's named token), keeping ``blocks`` in LRU order: a change of
        representation only (the same blocks, order and classes)."""
        if not self.num_private:
            return
        runs, order = deque(), {}
        for token, hashes in self._live_runs():
            if len(token) == 3:
                token = token[:2]
            runs.append((token, hashes))
            order.update(zip(hashes, repeat(token)))
        self.blocks.clear()
        self.removals += 1
        self.blocks.update(order)
        self._runs, self._pos, self._stored = runs, 0, len(order)
        self._stale.clear()
        self.heads.clear()
        self.num_private = 0

    def order(self) -> list[tuple[int, KVClass]]:
        """Every block in the tier with its class, least recent first."""
        return [(h, token[0]) for token, hashes in self._live_runs() for h in hashes]


class _OwedScan:
    """The owed evictions' victims while they are all private runs at the
    head of the normal idle order (:meth:`KVClassManager._owed_scan_now`).

    Invariants: ``releases`` are the private head runs' releases in order
    (release order, so oldest first), ``ends[i + 1]`` the idle blocks of the
    first ``i + 1`` of them (``ends[0]`` 0); ``next`` the index of the
    idle order's next run to scan, ``blocked`` once a named run came first;
    ``host_*`` the same for the host tier's least recent private entries
    (:meth:`_HostTier.private_cover`)."""

    __slots__ = ("blocked", "cold", "ends", "head", "host_blocked", "host_cover", "host_head", "host_next", "next",
                 "releases")

    def __init__(self, head: tuple | None) -> None:
        self.head = head  # the idle order's head run when the scan began
        self.releases: list[int] = []
        self.ends = [0]
        self.next = 0
        self.blocked = False
        self.cold = 0  # the first ``cold`` releases are known cold
        self.host_head: tuple | None = None
        self.host_next, self.host_cover, self.host_blocked = 0, 0, False

    def cold_victims(self, owed: int, live: Container[int]) -> int:
        """Of the first ``owed`` victims, those of cold releases (not in
        ``live``): the cold releases are the oldest, so a prefix of
        ``releases``, which only grows (a release once cold stays cold)."""
        releases, i = self.releases, self.cold
        while i < len(releases) and releases[i] not in live:
            i += 1
        self.cold = i
        return min(owed, self.ends[i])


@attrs.define(eq=False)
class _Owner:
    kv_class: KVClass
    hashes: list[int] = attrs.Factory(list)
    num_private_blocks: int = 0
    #: Its blocks of ``hashes`` are private (``allocate(private=True)``): held, but not in the block map.
    private: bool = False


@attrs.define(eq=False, on_setattr=attrs.setters.NO_OP)  # validated at construction; counters mutate freely
class KVClassManager:
    """Blocks of one instance's KV pool, by content hash, in two classes."""

    num_blocks: int = attrs.field(validator=positive_int)
    block_size: int = attrs.field(validator=positive_int)
    policy: KVClassPolicy = attrs.Factory(KVClassPolicy)
    kv_bytes_per_token: float = attrs.field(default=131072.0, validator=positive)
    num_free_blocks: int = attrs.field(init=False)
    _eviction_count: int = attrs.field(init=False, default=0)
    _num_shadow_blocks: int = attrs.field(init=False, default=0)
    _num_evicted_blocks: dict[KVClass, int] = attrs.field(init=False)
    num_shadow_blocks_used: int = attrs.field(init=False, default=0)
    num_reloaded_blocks: int = attrs.field(init=False, default=0)
    _blocks: dict[int, tuple] = attrs.field(init=False, factory=dict)  # hash -> state (see _HELD)
    _idle: dict[KVClass, _IdleRuns] = attrs.field(init=False)  # hash -> idle since, release order
    _idle_s: _IdleRuns = attrs.field(init=False, repr=False)  # _idle[SHADOW] and _idle[NORMAL] (the same objects)
    _idle_n: _IdleRuns = attrs.field(init=False, repr=False)
    _owners: dict[str, _Owner] = attrs.field(init=False, factory=dict)
    _host_tier: _HostTier = attrs.field(init=False, factory=_HostTier)
    _host: dict[int, tuple[KVClass, int]] = attrs.field(init=False)  # _host_tier.blocks: hash -> spill token
    # Releases not yet cold, in order, as (time, release id); _live[id]: the blocks still idle from that
    # release. A release leaves both once older than the cold age (_refresh_cold); its blocks still idle are
    # then cold: counted in _num_cold_idle until they leave idle (O(1) per release, not per block).
    _cold_queue: deque = attrs.field(init=False, factory=deque)
    _live: dict[int, int] = attrs.field(init=False, factory=dict)
    _num_cold_idle: int = attrs.field(init=False, default=0)
    # Per release, its blocks still idle, cold or not (the idle orders skip a release's run once it has none).
    _idle_left: dict[int, int] = attrs.field(init=False, factory=dict)
    _mixed: set[int] = attrs.field(init=False, factory=set)  # releases with idle blocks of both classes
    _num_releases: int = attrs.field(init=False, default=0)
    # Evictions owed: blocks normal owners took from idle whose victims are not chosen yet (_settle).
    _owed: int = attrs.field(init=False, default=0)
    # Private blocks (allocate(private=True)), not in _blocks: the held ones' count, and per release of a
    # private owner's finished chain (its run in the normal idle order: _IdleRuns.private_runs) the chain's first
    # hash, until its last block is evicted or it is named.
    _num_private_held: int = attrs.field(init=False, default=0)
    _private_runs: dict[int, int] = attrs.field(init=False, factory=dict)
    # The first block's hash of each private chain (held or idle) -> how many: a lookup that starts there
    # names the private blocks first (match_prefix), so a private chain is found by hash like any other.
    _private_heads: dict[int, int] = attrs.field(init=False, factory=dict)
    # Named blocks' removal events from the block map (evictions of named blocks): with the map's size and the
    # host tier's, the key sets a prefix lookup reads (see cached_prefix_blocks).
    _named_removals: int = attrs.field(init=False, default=0)
    # cached_prefix_blocks' memo: the key sets' version it holds for, and per key (by identity) (key, stamp, n).
    _prefix_version: tuple = attrs.field(init=False, default=())
    _prefix_memo: dict[int, tuple] = attrs.field(init=False, factory=dict)
    # The owed evictions' victims while they are private head runs (_owed_scan_now), until the next settle.
    _owed_scan: _OwedScan | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        self.num_free_blocks = self.num_blocks
        self._host = self._host_tier.blocks
        self._idle = {KVClass.SHADOW: _IdleRuns(self._blocks, True, self._idle_left, self._mixed),
                      KVClass.NORMAL: _IdleRuns(self._blocks, False, self._idle_left, self._mixed,
                                                self._private_runs)}
        self._idle_s, self._idle_n = self._idle[KVClass.SHADOW], self._idle[KVClass.NORMAL]  # never replaced
        self._num_evicted_blocks = {KVClass.SHADOW: 0, KVClass.NORMAL: 0}

    # -- queries -----------------------------------------------------------------
    @property
    def cap_blocks(self) -> int:
        return self.policy.cap_blocks(self.num_blocks)

    @property
    def block_bytes(self) -> float:
        return self.block_size * self.kv_bytes_per_token

    @property
    def host_capacity_blocks(self) -> int:
        host = self.policy.host
        return 0 if host is None else int(host.capacity_bytes // self.block_bytes)

    @property
    def num_host_blocks(self) -> int:
        if self._owed:
            self._settle()
        return len(self._host_tier)

    @property
    def num_idle_blocks(self) -> int:
        """Cached blocks no owner holds (both classes): what a normal
        allocation may evict."""
        return self._idle_s.count + self._idle_n.count - self._owed

    @property
    def num_cached_blocks(self) -> int:
        if self._owed:
            self._settle()
        idle_private = sum(map(self._idle_left.__getitem__, self._private_runs))
        return len(self._blocks) + self._num_private_held + idle_private

    @property
    def eviction_count(self) -> int:
        """Blocks evicted so far (each owed eviction will be one)."""
        return self._eviction_count + self._owed

    @property
    def num_shadow_blocks(self) -> int:
        """Shadow blocks, in use or cached."""
        if self._owed:
            self._settle()
        return self._num_shadow_blocks

    @property
    def num_evicted_blocks(self) -> dict[KVClass, int]:
        """Blocks evicted so far, by class (the manager's counters)."""
        if self._owed:
            self._settle()
        return self._num_evicted_blocks

    def _settle(self) -> None:
        """Make the evictions owed (see :meth:`_take`). Every query and change
        settles first but ``extend_private``, ``allocate(private=True)``, a
        private owner's finish (:meth:`_release_and_cache_private`) and the
        counts above it, so no caller sees the debt: between the take and now
        only those ran, which take free blocks or owe more, free blocks, and
        append a release at the tail of the normal idle order (the latest
        idle time, so after every block now idle in either order), and leave
        the host tier as it was. The owed count never exceeds the blocks idle
        before those appends (each take checks it against the idle count less
        the debt), and a normal requester's victims do not depend on the time,
        so the victims now are the ones the takes would have evicted, in
        order, and the free count is the one the eager evictions leave."""
        owed = self._owed
        if owed:
            self._owed = 0
            self._owed_scan = None
            if self._private_runs and not self._idle[KVClass.SHADOW].count:
                owed = self._evict_private_heads(owed)  # the usual: finished requests' private chains at the head
            if owed:
                self._evict(owed, KVClass.NORMAL, 0.0)

    def _owed_scan_now(self) -> _OwedScan | None:
        """The owed evictions' victims as a :class:`_OwedScan` when they are
        all private runs at the head of the normal idle order (the usual),
        which :meth:`_settle` takes by count (:meth:`_evict_private_heads`:
        the policy takes heads, no shadow block is idle); None otherwise.
        Kept until the next settle: in between only the debt grows and
        releases append at the tail (see :meth:`_settle`), so the head runs,
        their idle counts and the host tier stay as they were, and a larger
        debt only scans further. A read."""
        scan = self._owed_scan
        runs = self._idle[KVClass.NORMAL]._runs
        if scan is None or not runs or runs[0] is not scan.head:  # (the head run checked: indices stay valid)
            if (not self._private_runs or self._idle[KVClass.SHADOW].count
                    or not self.policy.takes_heads(KVClass.NORMAL)):
                return None
            head = self._idle[KVClass.NORMAL].head()  # dead runs at the head dropped (representation only)
            scan = self._owed_scan = _OwedScan(head)
        if scan.blocked:
            return None
        if scan.ends[-1] < self._owed:
            self._extend_scan(scan)
        return None if scan.ends[-1] < self._owed else scan

    def _extend_scan(self, scan: _OwedScan) -> None:
        """Scan further runs of the normal idle order until the private ones
        cover the debt, a named run blocks, or the runs end."""
        runs, left, private, owed = self._idle[KVClass.NORMAL]._runs, self._idle_left, self._private_runs, self._owed
        k, n = scan.next, len(runs)
        while k < n and scan.ends[-1] < owed:
            release = runs[k][0][3]
            k += 1
            if release not in left:
                continue  # a dead run: no block of its release is idle (the settle's trim drops it unread)
            if release not in private:
                scan.blocked = True
                break
            scan.releases.append(release)
            scan.ends.append(scan.ends[-1] + left[release])
        scan.next = k

    def _settle_names_nothing(self, scan: _OwedScan | None) -> bool:
        """Whether making the owed evictions, found all private by ``scan``
        (:meth:`_owed_scan_now`), would leave the named key sets as they
        are (the block map, the host tier's dict and their removal counts:
        :meth:`_key_sets_version`): the host tier's trims of their spill (in
        pieces below its capacity) take the ``len + owed - capacity`` least
        recent entries, which must all be private runs' ones."""
        if scan is None:
            return False
        capacity, owed = self.host_capacity_blocks, self._owed
        if not capacity:
            return True
        if owed >= capacity:
            return False
        host = self._host_tier
        excess = len(host) + owed - capacity
        if excess > scan.host_cover and not scan.host_blocked:
            if scan.host_next and host.head_token() is not scan.host_head:
                scan.host_next, scan.host_cover = 0, 0  # (never while owed: the host tier changes only at a settle)
            scan.host_head = host.head_token()
            scan.host_next, scan.host_cover, scan.host_blocked = host.private_cover(scan.host_next, scan.host_cover)
        return excess <= scan.host_cover

    def _evict_private_heads(self, num: int) -> int:
        """Evict up to ``num`` of a normal requester's victims while they are
        private runs at the head of the normal idle order, and return how many
        are left to evict. Only when the policy takes heads and no shadow
        block is idle: then :meth:`KVClassPolicy.victim_runs` is the normal
        order's first ``num`` (one class), so this is :meth:`_evict` of those
        run by run, by count (no block map entry, no :class:`_HeadRun`): the
        same victims, counts and spills in the same order."""
        if not self.policy.takes_heads(KVClass.NORMAL):
            return num
        idle, private, left = self._idle[KVClass.NORMAL], self._private_runs, self._idle_left
        spills = self.policy.host is not None
        evicted = 0
        while num:
            head = idle.head()
            if head is None:
                break
            state, hashes = head
            release = state[3]
            if release not in private:
                break
            n = left[release]
            m = min(n, num)
            start = len(hashes) - n
            self._left_release(release, m)  # the run's first m live entries leave; the trim skips them
            idle.left(m)
            if spills:
                self._spill(hashes[start : start + m], KVClass.NORMAL, hashes[-1])
            num -= m
            evicted += m
        self._num_evicted_blocks[KVClass.NORMAL] += evicted
        self._eviction_count += evicted
        return num

    def _name_private(self, held: bool = True) -> None:
        """Give private blocks (``allocate(private=True)``) their entries in
        the block map: the idle ones (each with its release's idle state, so
        its idle-order entry is live as a named one), and with ``held`` the
        held ones too. A change of representation only: nothing a caller can
        see changes. Done before a per-block query or a lookup of a private
        chain (the idle orders and the policy's victim orders read private
        runs as they are)."""
        private, blocks = self._private_runs, self._blocks
        if private:
            left = self._idle_left
            for state, hashes in self._idle[KVClass.NORMAL].private_runs():
                blocks.update(zip(hashes[len(hashes) - left[state[3]] :], repeat(state)))
            for head in private.values():
                self._private_head(head, -1)
            private.clear()
        if held and self._num_private_held:
            for owner in self._owners.values():
                if owner.private:
                    self._name_held(owner)

    def _name_held(self, owner: _Owner) -> None:
        """A private owner's held blocks enter the block map (it is an ordinary owner from now on)."""
        blocks = self._blocks
        if not blocks.keys().isdisjoint(owner.hashes):
            raise AssertionError("a private owner's block hash is cached by another owner "
                                 "(allocate(private=True) promises none is)")
        blocks.update(zip(owner.hashes, repeat(_HELD[KVClass.NORMAL])))
        self._num_private_held -= len(owner.hashes)
        owner.private = False
        owner.hashes = list(owner.hashes)  # it may be a range
        if owner.hashes:
            self._private_head(owner.hashes[0], -1)

    def _private_head(self, block_hash: int, delta: int) -> None:
        """One private chain more (``delta`` 1) or less (-1) starting at ``block_hash``."""
        heads = self._private_heads
        n = heads.get(block_hash, 0) + delta
        if n > 0:
            heads[block_hash] = n
        elif n == 0:
            del heads[block_hash]
        else:
            raise AssertionError(f"no private chain starts at {block_hash} (a private run's head is wrong)")

    def class_of(self, block_hash: int) -> KVClass | None:
        if self._owed:
            self._settle()
        self._name_private()
        block = self._blocks.get(block_hash)
        return None if block is None else _KV_CLASS[block[0]]

    def is_cached(self, block_hash: int) -> bool:
        if self._owed:
            self._settle()
        self._name_private()
        return block_hash in self._blocks

    def in_host(self, block_hash: int) -> bool:
        if self._owed:
            self._settle()
        self._host_tier.name()
        return block_hash in self._host

    def host_order(self) -> list[tuple[int, KVClass]]:
        """The host tier's blocks with their classes, least recent (next to
        leave) first."""
        if self._owed:
            self._settle()
        return self._host_tier.order()

    def idle_order(self, kv_class: KVClass) -> list[int]:
        """Idle blocks of a class, next to be evicted first."""
        if self._owed:
            self._settle()
        return list(self._idle[kv_class])

    def idle_since(self, block_hash: int) -> float:
        if self._owed:
            self._settle()
        self._name_private()
        return self._blocks[block_hash][2]

    def cached_prefix_blocks(self, key: object, stamp: Hashable, hashes_of: Callable[[int], Sequence[int]]) -> int:
        """``match_prefix(hashes_of(block_size)).num_blocks``, remembered per
        ``key`` (by identity) until a named block enters or leaves the device
        or the host tier: a pending shadow job's refresh asks this for its
        session's history about once an iteration, and most iterations change
        only private blocks (normal requests'), which no session's chain
        names. The caller guarantees that ``stamp`` determines
        ``hashes_of(block_size)`` for ``key`` (a history's epoch and length:
        it only appends within an epoch) and that those hashes name no
        private chain (``allocate(private=True)``'s promise). Settles first,
        as every query does, so the answer is ``match_prefix``'s, except for a
        remembered answer when the owed evictions are private only
        (:meth:`_settle_names_nothing`): settling them would leave the
        version as it is, so the answer after it is the remembered one, and
        the debt stays owed for the next query (this one changed nothing)."""
        memo = self._prefix_memo
        if self._owed:
            hit = memo.get(id(key))
            if (hit is not None and hit[0] is key and hit[1] == stamp and self._key_sets_version() == self._prefix_version
                    and self._settle_names_nothing(self._owed_scan_now())):
                return hit[2]
            self._settle()
        version = self._key_sets_version()
        if version != self._prefix_version:
            memo.clear()
            self._prefix_version = version
        else:
            hit = memo.get(id(key))
            if hit is not None and hit[0] is key and hit[1] == stamp:
                return hit[2]
        n = self.match_prefix(hashes_of(self.block_size)).num_blocks
        memo[id(key)] = (key, stamp, n)  # (a lookup that named private blocks grew the map: the next call clears)
        return n

    def _key_sets_version(self) -> tuple:
        """The named key sets' version: a key set changes iff its size does or
        a removal ran (sizes only grow between removals, and each removal
        event bumps its counter), so equal versions mean equal key sets."""
        host = self._host_tier
        return len(self._blocks), self._named_removals, len(host.blocks), host.removals

    def match_prefix(self, hashes: Sequence[int]) -> PrefixMatch:
        if self._owed:
            self._settle()
        n_dev = _run_length(self._blocks, hashes)
        if not n_dev and self._private_heads and hashes and hashes[0] in self._private_heads:
            self._name_private()  # a lookup of a private chain (its owner's own, or a test's): by hash from now on
            n_dev = _run_length(self._blocks, hashes)
        if self._host_tier.heads and hashes and hashes[0] in self._host_tier.heads:
            self._host_tier.name()  # the same for the chain's private runs in the host tier
        n_host = _run_length(self._host, itertools.islice(hashes, n_dev, None)) if self._host else 0
        return PrefixMatch(n_dev, n_host)

    def may_hold_prefix(self, first_hash: int) -> bool:
        """Whether a prefix whose first block is ``first_hash`` may be cached
        (on the device, in the host tier, or as a private chain's head, on the
        device or in the host tier), read without settling the owed
        evictions: O(1). False is exact: then :meth:`match_prefix` of any
        hashes starting with ``first_hash`` finds no block, now and after any
        ``extend_private`` calls and owed evictions in between (those only
        take blocks away, or spill blocks to the host tier, named ones into
        its dict, a private chain's under its head, which this reads; a
        private chain's other blocks start no other history's prefix, as
        ``allocate(private=True)`` promises). Also the check that a private
        allocation's promise holds where it is cheap (see :meth:`allocate`):
        a count-only history hashes by its id, so a session with a normal
        request's id hashes alike; count-only chains share blocks from the
        first (a cached block further on would need a 64-bit coincidence)."""
        return (first_hash in self._blocks or first_hash in self._host or first_hash in self._private_heads
                or first_hash in self._host_tier.heads)

    def shadow_room_blocks(self, now_s: float) -> int:
        """Blocks a shadow chunk could take now: cap room, free and cold.
        Owed evictions whose victims are all private head runs
        (:meth:`_owed_scan_now`) stay owed: settling them changes
        neither the shadow count nor the free count, and takes from the cold
        count exactly their blocks of cold releases, which this subtracts."""
        scan = None
        if self._owed:
            scan = self._owed_scan_now()
            if scan is None:
                self._settle()
        room = self.cap_blocks - self._num_shadow_blocks
        if room <= 0:
            return 0
        if self.num_free_blocks >= room:
            return room
        self._refresh_cold(now_s)
        cold = self._num_cold_idle
        if scan is not None:  # the settle takes its victims' blocks of cold releases from the cold count
            cold -= scan.cold_victims(self._owed, self._live)
        return min(room, self.num_free_blocks + cold)

    def _refresh_cold(self, now_s: float) -> None:
        """Count idle blocks that became cold since the last call: O(1) per
        release (a release's blocks go idle at its time, so they turn cold
        together; those that left idle since have left its live count)."""
        q, live = self._cold_queue, self._live
        while q and self.policy.shadow_may_displace(q[0][0], now_s):
            self._num_cold_idle += live.pop(q.popleft()[1])

    def _new_release(self, release: int, num_idle: int, now_s: float) -> None:
        """Record release ``release`` (the next id) that made ``num_idle`` > 0 blocks idle at ``now_s``."""
        self._num_releases = release
        self._live[release] = num_idle
        self._idle_left[release] = num_idle
        self._cold_queue.append((now_s, release))

    def _leave_idle(self, releases: Iterator[int]) -> None:
        """Idle blocks of these releases leave idle: out of their release's
        live count, or out of the cold count once their release is cold. A
        release's blocks usually come together (eviction takes them in release
        order; a hit takes a chain one release made idle), so this counts
        runs of one release."""
        for release, group in itertools.groupby(releases):  # a run per release: O(runs) in Python
            self._left_release(release, len(list(group)))

    def _left_release(self, release: int, num: int) -> None:
        """``num`` idle blocks of release ``release`` left idle (hit or evicted)."""
        left = self._live.get(release)
        if left is None:
            self._num_cold_idle -= num
        else:
            self._live[release] = left - num
        left = self._idle_left[release] - num
        if left:
            self._idle_left[release] = left
        else:
            del self._idle_left[release]
            self._mixed.discard(release)
            if release in self._private_runs:
                self._private_head(self._private_runs.pop(release), -1)

    def _evicted_from_idle(self, releases: list[int]) -> None:
        """:meth:`_leave_idle` for the releases of evicted blocks of one
        class, in eviction order: a class's idle order is its release order,
        so ``releases`` is sorted and its runs are found by bisection (Python
        work per release, not per block)."""
        i, n = 0, len(releases)
        while i < n:
            release = releases[i]
            j = n if releases[-1] == release else bisect.bisect_right(releases, release, i)
            self._left_release(release, j - i)
            i = j

    def _cold(self, block_hash: int) -> bool:
        """Idle and counted cold (for tests: the cold count is this, summed)."""
        if self._owed:
            self._settle()
        self._name_private()
        _, ref, _, release = self._blocks[block_hash]
        return ref == 0 and release not in self._live

    # -- allocation --------------------------------------------------------------
    def allocate(
        self,
        owner_id: str,
        hashes: Sequence[int],
        num_private_blocks: int,
        kv_class: KVClass,
        now_s: float,
        *,
        private: bool = False,
    ) -> Allocation | None:
        """Give ``owner_id`` the blocks for ``hashes`` (hits are shared, misses
        and host hits take new device blocks) plus private unhashed blocks.

        All or nothing: ``None`` when the blocks cannot be found under the rules
        of ``kv_class``; the pool is then unchanged.

        ``private`` (a normal owner): the caller guarantees that ``hashes`` are
        distinct, that none is cached or in the host tier, and that no other
        owner ever names one of them, nor does any later ``hashes`` passed to
        this manager except this owner's own ``release_and_cache`` (a normal
        request's fresh prompt, whose history is its own). Then nothing can hit
        these blocks but the owner itself after a ``release`` (a preemption),
        and the manager keeps them as counts and runs, out of its block map:
        the result, and everything a caller can see afterwards, is exactly that
        of the same call without ``private``. Checked where it is cheap: a
        chain whose first block may be cached already (:meth:`may_hold_prefix`)
        is allocated as without ``private``. This check is the one owner of the
        rule for a re-admitted owner too: a preempted normal request passes
        ``private`` again, and its released blocks, while any is still cached
        (its head goes last: an idle run is evicted tail first), make it named.
        """
        if owner_id in self._owners:
            raise ValueError(f"owner {owner_id!r} already holds blocks")
        if private and not (hashes and self.may_hold_prefix(hashes[0])):  # (else the promise is broken: named)
            # a normal take that reads no idle order and no host tier: it owes, unsettled (see _settle)
            return self._allocate_private(owner_id, hashes, num_private_blocks, kv_class, now_s)
        if self._owed:
            self._settle()
        match = self.match_prefix(hashes)
        hits = hashes[: match.num_device_blocks]
        # Blocks past the first miss may still be cached (a chain's head can be
        # evicted before its tail): share them as extend() does, never
        # overwrite them (that leaked blocks and left in-use blocks idle).
        rest = hashes[match.num_device_blocks :]
        blocks = self._blocks
        if blocks.keys().isdisjoint(rest):  # the usual case, tested in C (rest[0] is the first miss: not cached)
            shared, fresh = [], rest
        else:
            shared = [h for h in rest[1:] if h in blocks]
            fresh = [h for h in rest if h not in blocks]
        num_new = len(fresh) + num_private_blocks
        if not self._can_take(num_new, kv_class, now_s, exclude=[*hits, *shared]):
            return None
        used = self._ref_hits(hits, kv_class)
        if kv_class is KVClass.NORMAL and self._host:  # a host-tier shadow block served to a normal owner: used
            host_used = self._host_shadow(hashes[match.num_device_blocks : match.num_blocks])
            self.num_shadow_blocks_used += host_used
            used += host_used
        self._ref_hits(shared, kv_class)
        # Nothing of ``hashes`` is idle now (hits and shared are referenced, the rest is not cached), so no
        # eviction can touch it.
        host = self._host
        in_host = bool(host) and not host.keys().isdisjoint(fresh)  # fresh blocks to take out of the host tier
        self._take(num_new, kv_class, now_s, owe=not in_host)
        host_hits = hashes[match.num_device_blocks : match.num_blocks]
        if in_host:
            self._host_tier.take(fresh)  # device and host tier stay disjoint
        blocks.update(zip(fresh, repeat(_HELD[kv_class])))
        self._owners[owner_id] = _Owner(kv_class, list(hashes), num_private_blocks)
        self.num_reloaded_blocks += len(host_hits)
        reload_s = self.reload_seconds(len(host_hits))
        return Allocation(match.num_device_blocks, len(host_hits), num_new, reload_s, used)

    def _allocate_private(self, owner_id: str, hashes: Sequence[int], num_private_blocks: int, kv_class: KVClass,
                          now_s: float) -> Allocation | None:
        """allocate(private=True): what the general path does when nothing of
        ``hashes`` is cached anywhere (no hit, all fresh, no reload), without
        the block map."""
        if kv_class is not KVClass.NORMAL:
            raise ValueError("a private allocation is for a normal owner")
        num_new = len(hashes) + num_private_blocks
        free = self.num_free_blocks
        if num_new > free:
            if free + self._idle_s.count + self._idle_n.count - self._owed < num_new:
                return None  # _can_take of a normal owner with nothing excluded
            self.num_free_blocks = 0  # _take of a normal owner that owes: the free blocks, then owed evictions
            self._owed += num_new - free
        else:
            self.num_free_blocks = free - num_new
        # A range (consecutive hashes) is kept as it is: slices, reversal and comparisons of ranges are O(1).
        kept = hashes if isinstance(hashes, range) else list(hashes)
        self._owners[owner_id] = _Owner(kv_class, kept, num_private_blocks, private=True)
        self._num_private_held += len(hashes)
        if hashes:
            self._private_head(hashes[0], 1)
        alloc = _PRIVATE_ALLOCATIONS.get(num_new)
        if alloc is None:  # (frozen values: one per size, shared)
            alloc = _PRIVATE_ALLOCATIONS[num_new] = Allocation(0, 0, num_new, 0.0, 0)
        return alloc

    def extend(self, owner_id: str, hashes: Sequence[int], num_private_blocks: int, now_s: float) -> bool:
        """Grow an owner (decode): new hashed and private blocks; all or nothing."""
        owner = self._owners[owner_id]
        if self._owed:
            self._settle()
        if hashes and owner.private:
            self._name_held(owner)
        if not hashes and num_private_blocks <= self.num_free_blocks and owner.kv_class is KVClass.NORMAL:
            self.num_free_blocks -= num_private_blocks  # the general path below, when only free blocks are taken
            owner.num_private_blocks += num_private_blocks
            return True
        fresh = list(itertools.filterfalse(self._blocks.__contains__, hashes))
        shared = list(filter(self._blocks.__contains__, hashes))
        num_new = len(fresh) + num_private_blocks
        if not self._can_take(num_new, owner.kv_class, now_s, exclude=shared):
            return False
        self._ref_hits(shared, owner.kv_class)
        host = self._host
        in_host = bool(host) and not host.keys().isdisjoint(fresh)
        self._take(num_new, owner.kv_class, now_s, owe=not in_host)  # as in allocate: nothing idle
        if in_host:
            self._host_tier.take(fresh)
        self._blocks.update(zip(fresh, repeat(_HELD[owner.kv_class])))
        if hashes:  # (a private owner's may be a range; it is named above when it grows by hashes)
            owner.hashes.extend(hashes)
        owner.num_private_blocks += num_private_blocks
        return True

    def extend_private(self, needs: Sequence[tuple[str, int]], now_s: float) -> bool:
        """``extend(owner, (), n)`` for each (owner, n) in order, when together
        they fit in free and idle blocks (then each of them would succeed: a
        normal owner may take any idle block); False, with nothing changed,
        otherwise. Taken in one go: free blocks first,
        then LRU evictions, as the calls one by one would. A shadow owner is an
        error (its cap rules differ)."""
        owners = self._owners
        if len(needs) == 1:  # the usual: the decode pool's phase blocks alone
            ((owner_id, total),) = needs
            grown = ((owners[owner_id], total),)
            if grown[0][0].kv_class is KVClass.SHADOW:
                raise ValueError("extend_private grows normal owners only")
        else:
            grown = [(owners[owner_id], n) for owner_id, n in needs]  # a few per call: plain Python is the fastest
            total = 0
            for owner, n in grown:
                if owner.kv_class is KVClass.SHADOW:
                    raise ValueError("extend_private grows normal owners only")
                total += n
        free = self.num_free_blocks
        if total > free and total > free + self._idle_s.count + self._idle_n.count - self._owed:
            return False
        for owner, n in grown:
            owner.num_private_blocks += n
        if total <= free:
            self.num_free_blocks = free - total
        else:  # _take of a normal owner: the free blocks, then evictions (owed)
            self.num_free_blocks = 0
            self._owed += total - free
        return True

    def pool_owner(self, owner_id: str) -> None:
        """Make ``owner_id`` a normal owner holding nothing, if it is not one
        yet: a pool that :meth:`extend_private` grows and
        :meth:`move_private` hands out (changes nothing else)."""
        owner = self._owners.get(owner_id)
        if owner is None:
            self._owners[owner_id] = _Owner(KVClass.NORMAL, [], 0)
        elif owner.kv_class is not KVClass.NORMAL:
            raise ValueError(f"owner {owner_id!r} is not a normal owner")

    def move_private(self, src_id: str, dst_id: str, num: int) -> None:
        """Hand ``num`` private blocks of normal owner ``src_id`` to normal
        owner ``dst_id``: who holds them changes, nothing else (the pool, the
        cache and the idle orders are as they were)."""
        src, dst = self._owners[src_id], self._owners[dst_id]
        if num < 0 or num > src.num_private_blocks or KVClass.SHADOW in (src.kv_class, dst.kv_class):
            raise ValueError(f"cannot move {num} private blocks from {src_id!r} "
                             f"({src.num_private_blocks}, {src.kv_class.name}) to {dst_id!r} ({dst.kv_class.name})")
        src.num_private_blocks -= num
        dst.num_private_blocks += num

    def release(self, owner_id: str, now_s: float) -> None:
        """Drop an owner's references; its hashed blocks stay cached (idle)."""
        if self._owed:
            self._settle()
        owner = self._owners.pop(owner_id)
        if owner.private:  # its blocks stay cached: by hash from now on (the owner's next allocation may hit them)
            self._name_held(owner)
        self._unref(reversed(owner.hashes), (), now_s)  # tail first, so LRU evicts a context's tail first (as vLLM)
        self._free(owner.num_private_blocks, owner.kv_class)

    def _unref(self, hashes, keep: set[int] | tuple, now_s: float) -> None:
        """One reference less on each block of ``hashes`` (those in ``keep``
        excepted); the blocks left unreferenced go idle now, in that order
        (appended to their class's LRU order), as one release. A run of
        distinct blocks of one class that one owner alone holds (a released
        request's or shadow chunk's, the usual case) goes idle in two
        ``dict.update`` over one shared state."""
        blocks, idle = self._blocks, self._idle
        release = self._num_releases + 1
        idle_state = ((False, 0, now_s, release), (True, 0, now_s, release))
        hashes = list(hashes)
        if not keep and len(hashes) >= 4:
            states = list(map(blocks.__getitem__, hashes))
            n = len(hashes)
            if list(map(_REF, states)).count(1) == n and len(set(hashes)) == n:  # one holder each: all go idle
                flags = list(map(_KV_CLASS_FLAG, states))
                num_shadow = sum(flags)
                if num_shadow in (0, n):  # one class (a released request's or a fresh shadow chunk's)
                    shadow = num_shadow > 0
                    blocks.update(zip(hashes, repeat(idle_state[shadow])))
                    idle[_KV_CLASS[shadow]].append(idle_state[shadow], hashes)
                else:  # both (a shadow chunk over a prefix of normal blocks): the loop's lists, by class in order
                    self._mixed.add(release)
                    for shadow, run in ((False, list(compress(hashes, map(not_, flags)))),
                                        (True, list(compress(hashes, flags)))):
                        blocks.update(zip(run, repeat(idle_state[shadow])))
                        idle[_KV_CLASS[shadow]].append(idle_state[shadow], run)
                self._new_release(release, n, now_s)
                return
        newly_idle = ([], [])  # by the shadow flag, in order
        for h in hashes:
            shadow, ref, since, rel = blocks[h]
            if not keep or h not in keep:
                ref -= 1
            if ref == 0:
                blocks[h] = idle_state[shadow]
                newly_idle[shadow].append(h)
            else:
                blocks[h] = (shadow, ref, since, rel)
        if newly_idle[0] or newly_idle[1]:
            if newly_idle[0] and newly_idle[1]:
                self._mixed.add(release)
            for shadow in (False, True):
                idle[_KV_CLASS[shadow]].append(idle_state[shadow], newly_idle[shadow])
            self._new_release(release, len(newly_idle[0]) + len(newly_idle[1]), now_s)

    def release_and_cache(self, owner_id: str, hashes: Sequence[int], cache_owner_id: str, now_s: float) -> None:
        """A finished request: exactly ``release(owner_id)``, then, if it fits,
        ``allocate(cache_owner_id, hashes, 0, NORMAL)`` and
        ``release(cache_owner_id)`` (its computed full blocks stay cached),
        without the owner's blocks going idle and back in between. The short
        way runs when the owner is normal, holds only blocks of ``hashes`` and
        the new ones fit in free blocks (no eviction); otherwise the three
        calls run."""
        owner = self._owners[owner_id]
        if owner.private and self._release_and_cache_private(owner_id, owner, hashes, now_s):
            return  # (with evictions still owed: see _settle)
        if self._owed:
            self._settle()
        blocks = self._blocks
        if owner.private:
            self._name_held(owner)
        if self._release_and_cache_chain(owner_id, owner, hashes, now_s):
            return
        held = set(owner.hashes)
        match = self.match_prefix(hashes)
        fresh = [h for h in hashes[match.num_device_blocks :] if h not in blocks]
        if (owner.kv_class is not KVClass.NORMAL or len(held) != len(owner.hashes) or not held.issubset(hashes)
                or len(fresh) > self.num_free_blocks + owner.num_private_blocks):
            self.release(owner_id, now_s)
            if self.allocate(cache_owner_id, hashes, 0, KVClass.NORMAL, now_s) is not None:
                self.release(cache_owner_id, now_s)
            return
        del self._owners[owner_id]
        self.num_free_blocks += owner.num_private_blocks - len(fresh)
        used = 0
        hits = set()  # allocate's hits besides the owner's own blocks: +1 there, -1 in the last release
        left_idle = []
        for h in hashes:
            block = blocks.get(h)
            if block is None or h in held or h in hits:
                continue
            hits.add(h)
            shadow, ref, since, rel = block
            if ref == 0:
                left_idle.append(block)
            if shadow:
                shadow = False
                self._num_shadow_blocks -= 1
                used += 1
            blocks[h] = (shadow, ref, since, rel)
        num_shadow_left = sum(map(_KV_CLASS_FLAG, left_idle))  # their idle entries are stale now
        self._idle[KVClass.SHADOW].left(num_shadow_left)
        self._idle[KVClass.NORMAL].left(len(left_idle) - num_shadow_left)
        self._leave_idle(map(_RELEASE, left_idle))
        if match.num_host_blocks:  # allocate's host hits: a shadow block there served to the normal cache owner
            used += self._host_shadow(hashes[match.num_device_blocks : match.num_blocks])
        self.num_shadow_blocks_used += used
        self.num_reloaded_blocks += match.num_host_blocks
        self._host_tier.take(fresh)
        blocks.update(zip(fresh, repeat(_HELD[KVClass.NORMAL])))
        self._unref(reversed(hashes), hits, now_s)  # the cache owner's release

    def _release_and_cache_chain(self, owner_id: str, owner: _Owner, hashes: Sequence[int], now_s: float) -> bool:
        """release_and_cache's usual case, a chain at once: a normal owner
        whose blocks are the head of ``hashes`` (no repeats) and whose tail is
        not cached at all and fits in free blocks plus the owner's private
        ones. The general short way would find the head held, no other hit,
        the tail fresh; the cache owner's release then makes the tail idle
        (last block first) and the head loses the owner's reference, in that
        order, as one release. When the owner alone holds its head (each block
        normal with one reference: the usual case), the whole chain goes idle
        last block first in two ``dict.update`` over one shared state, no
        Python step per block. False (nothing changed) when the case does not
        apply."""
        head = owner.hashes
        k = len(head)
        blocks = self._blocks
        if not isinstance(hashes, list):
            hashes = list(hashes)
        if owner.kv_class is not KVClass.NORMAL or len(hashes) < k or hashes[:k] != head:
            return False
        tail = hashes[k:]
        if (len(tail) > self.num_free_blocks + owner.num_private_blocks or not blocks.keys().isdisjoint(tail)
                or len(set(hashes)) != len(hashes)):
            return False
        del self._owners[owner_id]
        self.num_free_blocks += owner.num_private_blocks - len(tail)
        host = self._host
        if host and not host.keys().isdisjoint(tail):
            num_host = _run_length(host, tail)  # match_prefix's host part: the tail's run there
            self.num_shadow_blocks_used += self._host_shadow(tail[:num_host])  # as allocate counts host hits
            self.num_reloaded_blocks += num_host
            self._host_tier.take(tail)
        release = self._num_releases + 1
        idle_state = (False, 0, now_s, release)
        # A block a normal owner holds is normal (see _ref_hits), so one reference each is the whole test.
        if countOf(map(_REF, map(blocks.__getitem__, head)), 1) == k:
            if hashes:  # tail last block first, then the head last block first
                order = hashes[::-1]
                blocks.update(zip(order, repeat(idle_state)))
                self._idle[KVClass.NORMAL].append(idle_state, order)
                self._new_release(release, len(order), now_s)
            return True
        newly_idle = list(reversed(tail))  # the tail goes idle last block first
        blocks.update(zip(newly_idle, repeat(idle_state)))
        shadow_idle, shadow_state = [], (True, 0, now_s, release)
        for h in reversed(head):  # then the head loses the owner's reference, last block first
            shadow, ref, since, rel = blocks[h]
            if ref == 1:
                blocks[h] = idle_state if not shadow else shadow_state
                (shadow_idle if shadow else newly_idle).append(h)
            else:
                blocks[h] = (shadow, ref - 1, since, rel)
        idle = self._idle
        if newly_idle and shadow_idle:
            self._mixed.add(release)
        idle[KVClass.NORMAL].append(idle_state, newly_idle)
        idle[KVClass.SHADOW].append(shadow_state, shadow_idle)
        if newly_idle or shadow_idle:
            self._new_release(release, len(newly_idle) + len(shadow_idle), now_s)
        return True

    def _release_and_cache_private(self, owner_id: str, owner: _Owner, hashes: Sequence[int], now_s: float) -> bool:
        """:meth:`_release_and_cache_chain` of a private owner (whose blocks
        only it holds, none in the block map): the chain goes idle last block
        first as one release, kept as one private run (no block map entry).
        False (nothing changed) when the chain case does not apply. It may run
        with evictions owed (:meth:`_settle`): it reads neither idle order,
        appends its release at the normal order's tail, and returns False
        before it would reload from the host tier while any is owed."""
        head = owner.hashes
        k = len(head)
        if type(hashes) is not type(head):  # (a list or a range) a list and a range never compare equal
            if type(head) is not list:
                return False  # a range head: only a range can extend it as the chain case needs
            hashes = list(hashes)
        if len(hashes) < k or hashes[:k] != head:
            return False
        tail = hashes[k:]
        distinct = isinstance(hashes, range) or len(set(hashes)) == len(hashes)  # a range's are (step 1)
        blocks = self._blocks  # (an empty map first: isdisjoint walks a range tail block by block)
        if (len(tail) > self.num_free_blocks + owner.num_private_blocks or (blocks and not blocks.keys().isdisjoint(tail))
                or not distinct):
            return False
        host = self._host
        reload = bool(host) and not host.keys().isdisjoint(tail)
        if reload and self._owed:  # the owed evictions' spills come first: the caller settles, the general way
            return False
        del self._owners[owner_id]
        self._num_private_held -= k
        self.num_free_blocks += owner.num_private_blocks - len(tail)
        if reload:
            self.num_reloaded_blocks += _run_length(host, tail)
            self._host_tier.take(tail)
        if hashes and not k:
            self._private_head(hashes[0], 1)  # an empty head: the chain starts with its tail
        if hashes:
            release = self._num_releases + 1
            idle_state = (False, 0, now_s, release)
            order = hashes[::-1]
            self._private_runs[release] = hashes[0]
            self._idle_n.append(idle_state, order)
            self._new_release(release, len(order), now_s)
        return True

    def _host_shadow(self, hashes: Sequence[int]) -> int:
        """How many of ``hashes`` (all in the host tier) are shadow blocks
        there: host hits of a normal owner, each one a shadow block used."""
        return sum(map(is_, map(_FIRST, map(self._host.__getitem__, hashes)), repeat(KVClass.SHADOW)))

    def reload_seconds(self, num_blocks: int) -> float:
        host = self.policy.host
        if host is None or num_blocks == 0:
            return 0.0
        return num_blocks * self.block_bytes / host.pcie_bytes_per_s

    # -- internals ---------------------------------------------------------------
    def _can_take(self, num: int, kv_class: KVClass, now_s: float, exclude: Sequence[int]) -> bool:
        if kv_class is KVClass.SHADOW and self._num_shadow_blocks + num > self.cap_blocks:
            return False
        if num <= self.num_free_blocks:
            return True
        excluded = set(compress(exclude, map(not_, map(_REF, map(self._blocks.__getitem__, exclude)))))  # the idle
        if kv_class is KVClass.NORMAL:  # any idle block but the excluded ones (all idle: ref count 0)
            return self.num_free_blocks + self.num_idle_blocks - len(excluded) >= num
        wanted = num - self.num_free_blocks
        victims = self.policy.victims(self._idle, kv_class, now_s, excluded)
        return sum(1 for _ in itertools.islice(victims, wanted)) == wanted

    def _ref_hits(self, hits: Sequence[int], requester: KVClass) -> int:
        """One reference more on each cached block of ``hits``: an idle one
        leaves its class's LRU order (and its release's or the cold count); a
        normal requester promotes a shadow block to normal (used; the count
        is returned). In C-level passes over the run when its blocks are
        distinct (a chain's are), with one new state per distinct old state
        (a run released together shares one)."""
        if len(hits) < 4 or len(set(hits)) != len(hits):
            return self._ref_hits_one_by_one(hits, requester)
        blocks = self._blocks
        states = list(map(blocks.__getitem__, hits))
        refs = list(map(_REF, states))
        if requester is KVClass.NORMAL and refs.count(0) == len(refs):  # a normal hit on idle blocks: the usual
            return self._ref_idle_hits(hits, states)
        if 0 in refs:  # some are idle
            shadows = list(map(_KV_CLASS_FLAG, states))
            idle_flags = list(map(not_, refs))
            idle_shadow = list(map(and_, idle_flags, shadows))
            n_idle, n_idle_shadow = sum(idle_flags), sum(idle_shadow)
            self._leave_idle(map(_RELEASE, compress(states, idle_flags)))
        normal = requester is KVClass.NORMAL
        new = {s: (s[0] and not normal, s[1] + 1, s[2], s[3]) for s in set(states)}
        used = 0
        if normal:
            used = sum(map(_KV_CLASS_FLAG, states))
            self._num_shadow_blocks -= used
            self.num_shadow_blocks_used += used
        blocks.update(zip(hits, map(new.__getitem__, states)))
        if 0 in refs:  # the idle hits' entries in the idle orders are stale now
            if n_idle_shadow:
                self._idle[KVClass.SHADOW].left(n_idle_shadow)
            if n_idle > n_idle_shadow:  # idle and normal
                self._idle[KVClass.NORMAL].left(n_idle - n_idle_shadow)
        return used

    def _ref_idle_hits(self, hits: Sequence[int], states: list[tuple]) -> int:
        """:meth:`_ref_hits` of a normal requester when every block is idle:
        the blocks one release made idle share their idle time, so the new
        (held, normal) states are one per release."""
        used = sum(map(_KV_CLASS_FLAG, states))
        releases = list(map(_RELEASE, states))
        first = releases[0]
        if releases.count(first) == len(releases):  # one release (a chain released at once): one new state
            self._left_release(first, len(releases))
            self._blocks.update(zip(hits, repeat((False, 1, states[0][2], first))))
        else:
            self._leave_idle(releases)
            new = {release: (False, 1, since, release)
                   for release, since in dict(zip(releases, map(_SINCE, states))).items()}
            self._blocks.update(zip(hits, map(new.__getitem__, releases)))
        idle = self._idle  # the hits' entries in the idle orders are stale now
        if used:
            idle[KVClass.SHADOW].left(used)
        if used < len(hits):
            idle[KVClass.NORMAL].left(len(hits) - used)
        self._num_shadow_blocks -= used
        self.num_shadow_blocks_used += used
        return used

    def _ref_hits_one_by_one(self, hits: Sequence[int], requester: KVClass) -> int:
        """:meth:`_ref_hits` a block at a time (short or repeating runs)."""
        used = 0
        blocks = self._blocks
        left_idle = [0, 0]  # by the shadow flag
        for h in hits:
            shadow, ref, since, rel = blocks[h]
            if ref == 0:
                left_idle[shadow] += 1
                self._left_release(rel, 1)
            if requester is KVClass.NORMAL and shadow:
                shadow = False
                self._num_shadow_blocks -= 1
                used += 1
            blocks[h] = (shadow, ref + 1, since, rel)
        for shadow in (False, True):
            if left_idle[shadow]:
                self._idle[_KV_CLASS[shadow]].left(left_idle[shadow])
        self.num_shadow_blocks_used += used
        return used

    def _take(self, num: int, kv_class: KVClass, now_s: float, owe: bool = False) -> None:
        """Free blocks, then evictions: owed (see :meth:`_settle`) when ``owe``
        (the caller changes nothing of the host tier after this: the spill
        would have come first) and the owner is normal; made now otherwise.
        No caller needs blocks kept from eviction: each takes after its hits
        are referenced, so nothing of its own is idle."""
        from_free = min(num, self.num_free_blocks)
        self.num_free_blocks -= from_free
        if num > from_free:
            if owe and kv_class is KVClass.NORMAL:
                self._owed += num - from_free
            else:
                self._evict(num - from_free, kv_class, now_s)
        if kv_class is KVClass.SHADOW:
            self._num_shadow_blocks += num

    def _evict(self, num: int, requester: KVClass, now_s: float) -> None:
        """Evict the first ``num`` of the policy's victims for ``requester``
        (:meth:`KVClassPolicy.victim_runs`, nothing protected), in that order."""
        runs = self.policy.victim_runs(self._idle, requester, num, now_s)
        if sum(map(len, map(_SECOND, runs))) < num:
            raise AssertionError("_evict called without enough evictable blocks")  # _can_take checked
        for cls, run in runs:  # in order (the host tier keeps its own LRU)
            self._evict_blocks(run, cls)

    def _evict_blocks(self, victims: list[int], cls: KVClass) -> None:
        """Drop a run of idle blocks of one class from the device, in order
        (to the host tier if any): one C-level pass per step, not a Python
        call per block."""
        blocks = self._blocks
        if type(victims) is _HeadRun:  # the head's next blocks, per run (the idle order holds private runs)
            self._evict_head_run(victims, cls)
            return
        pieces = None  # with private runs among the victims: (piece, its private chain's head or None), in order
        if self._private_runs and cls is KVClass.NORMAL:
            pieces = self._evict_with_private(victims)
        else:
            self._evicted_from_idle(list(map(_RELEASE, map(blocks.pop, victims))))
            self._named_removals += 1
        self._idle[cls].evicted(victims)  # their idle entries are stale now
        if self.policy.host is not None:
            if pieces is None:
                self._spill(victims, cls)
            else:  # a private run's piece stays private in the host tier
                for piece, head in pieces:
                    self._spill(piece, cls, head)
        if cls is KVClass.SHADOW:
            self._num_shadow_blocks -= len(victims)
        self._num_evicted_blocks[cls] += len(victims)
        self._eviction_count += len(victims)

    def _evict_head_run(self, victims: _HeadRun, cls: KVClass) -> None:
        """:meth:`_evict_blocks` of a :class:`_HeadRun`: per run, a private
        one by count, a named one popped from the map; spilled run by run
        (an LRU keeps the same last ``capacity`` either way)."""
        blocks, private = self._blocks, self._private_runs
        heads = []  # per piece: its private chain's first hash, or None (a named run)
        for state, piece in victims.pieces:
            release = state[3]
            head = private.get(release)
            if head is None:
                deque(map(blocks.__delitem__, piece), 0)
                self._named_removals += 1
            heads.append(head)
            self._left_release(release, len(piece))
        self._idle[cls].left(len(victims))
        if self.policy.host is not None:
            for (_, piece), head in zip(victims.pieces, heads):
                self._spill(piece, cls, head)
        if cls is KVClass.SHADOW:
            self._num_shadow_blocks -= len(victims)
        self._num_evicted_blocks[cls] += len(victims)
        self._eviction_count += len(victims)

    def _evict_with_private(self, victims: list[int]) -> list[tuple[Sequence[int], int | None]]:
        """The block map and release counts of evicting ``victims``, the next
        idle normal blocks from the head of the normal idle order, some of
        them private, given as a list (the lru order's victims, an order
        that takes every idle normal block, or the entries of a private run
        after a compaction of the idle order): a private run's victims are
        counted per run, the rest popped from the map. Returns the victims
        per run, in order, each with its private chain's first hash (None: a
        named run), for the spill."""
        blocks, left, private = self._blocks, self._idle_left, self._private_runs
        pieces = []  # (release, private, victims of the run), in order
        spills = []
        i, n = 0, len(victims)
        for state, hashes in self._idle[KVClass.NORMAL].runs_from_head():
            release = state[3]
            if release not in left:
                continue
            if release in private:
                start = len(hashes) - left[release]
                m = min(n - i, left[release])
                if list(hashes[start : start + m]) != list(victims[i : i + m]):
                    break
                pieces.append((release, True, m))
                spills.append((hashes[start : start + m], private[release]))
            else:
                live = list(islice(compress(hashes, map(is_, map(blocks.get, hashes), repeat(state))), n - i))
                m = len(live)
                if live != list(victims[i : i + m]):
                    break
                pieces.append((release, False, live))
                spills.append((live, None))
            i += m
            if i == n:
                break
        if i != n:
            raise AssertionError("victims with private blocks are not the head of the normal idle order")
        for release, is_private, run in pieces:
            if is_private:
                self._left_release(release, run)
            else:
                deque(map(blocks.__delitem__, run), 0)
                self._named_removals += 1
                self._left_release(release, len(run))
        return spills

    def _spill(self, victims: Sequence[int], kv_class: KVClass, head: int | None = None) -> None:
        """Put evicted blocks of one class in the host tier, in order, each as
        its most recent entry, trimming its least recent to capacity: exactly
        one block at a time with a trim after each (an LRU keeps the last
        ``capacity`` of its insertions either way), with one capacity check
        (:class:`_HostTier`). ``head``: the victims are a piece of the private
        chain starting there (kept private in the tier)."""
        capacity = self.host_capacity_blocks
        if capacity:
            self._host_tier.spill(victims, kv_class, capacity, head)

    def _free(self, num_private: int, kv_class: KVClass) -> None:
        self.num_free_blocks += num_private
        if kv_class is KVClass.SHADOW:
            self._num_shadow_blocks -= num_private
