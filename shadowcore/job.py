"""Session histories and shadow jobs.

A :class:`SessionHistory` is the append-only token stream of one agent
session (prompts, outputs, tool results); compaction starts a new epoch whose
blocks share nothing with the previous one. A :class:`ShadowJob` is one per
(session, target model): it tracks the prefix of that history the target's
sticky instance already holds.

Invariants of a job (property-tested in ``tests/test_invariants.py``):

* Incremental: a grant always starts at ``num_held_tokens + num_inflight_tokens``;
  nothing below the held prefix is granted again unless the engine reported
  that it lost it (eviction), so after A->B->A->B only deltas are computed.
* Streamed: the job's target is the block-aligned length of the *current*
  history, so input appended at call arrival and output appended as it is
  generated extend the job without any call into it.
* Sticky: a job is bound to one instance for its whole life.
* Superseded, never stale: a result whose epoch or start position no longer
  matches the job is ignored.
* A job's owner learns when its held prefix is lowered (``on_held_lowered``,
  called by :meth:`ShadowJob.refresh`): with held >= target and nothing in
  flight, that and the history growing are the only ways tokens go missing
  again (the manager's index of pending jobs relies on it).
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Callable, Iterable, Sequence

import attrs

from shadowcore.types import JobKey

_MASK64 = (1 << 64) - 1


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


TOKEN_TYPECODE = "i"  # a C int: every tokenizer's ids fit in 31 bits


def token_array(ids: Iterable[int]) -> array:
    """Token ids as a history keeps them (an ``array('i')``; one already is, as is)."""
    if isinstance(ids, array) and ids.typecode == TOKEN_TYPECODE:
        return ids
    return array(TOKEN_TYPECODE, ids)


@attrs.define(eq=False)
class SessionHistory:
    """Append-only token history of one session.

    With ``token_ids`` (real engines) block hashes chain over the real tokens,
    as vLLM's prefix cache does. The ids are kept in an ``array('i')``
    (:func:`token_array`: 4 bytes a token, no object per token, nothing for
    the garbage collector to walk: a gateway holds thousands of long
    histories); compare them with a list through :func:`token_array` or
    ``.tolist()``. Without them (simulation) the ``i``-th block of
    an epoch hashes ``(session, epoch, i)``: for an append-only stream this
    names exactly the same prefixes, at a fraction of the cost.
    """

    session_id: str
    epoch: int = 0
    num_tokens: int = 0
    token_ids: array | None = None  # token_array()
    _hash_cache: dict[int, list[int]] = attrs.field(factory=dict, repr=False)
    _base: int = attrs.field(default=0, repr=False, init=False)  # _count_base's digest for epoch _base_epoch
    _base_epoch: int = attrs.field(default=-1, repr=False, init=False)

    def append(self, num_tokens: int, token_ids: Sequence[int] | None = None) -> None:
        if num_tokens < 0:
            raise ValueError(f"session {self.session_id}: cannot append {num_tokens} tokens")
        if token_ids is not None:
            if len(token_ids) != num_tokens:
                raise ValueError(
                    f"session {self.session_id}: {len(token_ids)} token ids for {num_tokens} tokens"
                )
            if self.token_ids is None and self.num_tokens:
                raise ValueError(f"session {self.session_id}: token ids after counts only")
            try:  # converted whole first: a bad id appends nothing
                new = token_array(token_ids)
            except (TypeError, OverflowError) as e:
                raise ValueError(f"session {self.session_id}: token ids must be integers in "
                                 f"[-2**31, 2**31) ({e})") from None
            if self.token_ids is None:
                self.token_ids = token_array(())
            self.token_ids.extend(new)
        elif self.token_ids is not None and num_tokens:
            raise ValueError(f"session {self.session_id}: this history needs token ids")
        self.num_tokens += num_tokens

    def compact(self, num_summary_tokens: int, token_ids: Sequence[int] | None = None) -> None:
        """Replace the history with a summary; a new epoch shares no block."""
        self.epoch += 1
        self.num_tokens = 0
        self.token_ids = None
        self._hash_cache.clear()
        self.append(num_summary_tokens, token_ids)

    def num_full_blocks(self, block_size: int) -> int:
        return self.num_tokens // block_size

    def block_hashes(self, block_size: int, num_blocks: int | None = None) -> list[int]:
        """Hashes of the first ``num_blocks`` full blocks (default: all), a new list."""
        full = self.num_full_blocks(block_size)
        n = full if num_blocks is None else min(num_blocks, full)
        cache = self._hash_cache.setdefault(block_size, [])
        if len(cache) < n:
            cache.extend(self._hashes(block_size, len(cache), n, cache[-1] if cache else 0))
        return cache[:n]

    def block_hash_run(self, block_size: int, num_blocks: int | None = None) -> Sequence[int]:
        """The values of :meth:`block_hashes`, as a ``range`` where they are
        consecutive (count-only blocks whose digest does not wrap): no list
        built, nothing cached. Otherwise :meth:`block_hashes`' list."""
        cls = type(self)
        if cls is SessionHistory:  # the usual: num_full_blocks and _count_base inlined (a normal request's twice)
            n = self.num_tokens // block_size
            if num_blocks is not None and num_blocks < n:
                n = num_blocks
            if self.token_ids is None:
                base = self._base if self._base_epoch == self.epoch else self._count_base()
                if base + n <= _MASK64:
                    return range(base + 1, base + n + 1)
            return self.block_hashes(block_size, n)
        full = self.num_full_blocks(block_size)
        n = full if num_blocks is None else min(num_blocks, full)
        if self.token_ids is None and cls._hashes is SessionHistory._hashes:
            base = self._count_base()
            if base + n <= _MASK64:
                return range(base + 1, base + n + 1)
        return self.block_hashes(block_size, n)

    def _count_base(self) -> int:
        """The 64-bit digest of (session, epoch) that count-only block hashes offset (one digest per epoch)."""
        if self._base_epoch != self.epoch:  # session_id never changes
            self._base = _digest(f"{self.session_id}\x00{self.epoch}".encode())
            self._base_epoch = self.epoch
        return self._base

    def _hashes(self, block_size: int, start: int, end: int, parent: int) -> Iterable[int]:
        if self.token_ids is None:
            # (session, epoch, i): a 64-bit digest of (session, epoch) plus i + 1 mod 2**64 (a bijection of i):
            # distinct within an epoch, independent across them; one digest per call, not per block. Consecutive
            # values on purpose: a chain's blocks then sit in neighbouring slots of the KV manager's dicts
            # (Python hashes an int to itself mod 2**61 - 1), which keeps its per-block work in cache.
            base = self._count_base()
            if base + end <= _MASK64:  # no wrap (all but ~end / 2**64 of bases): the same values, built in C
                return range(base + start + 1, base + end + 1)  # the cache's extend makes the ints
            return [(base + i + 1) & _MASK64 for i in range(start, end)]
        out = []
        for i in range(start, end):
            block = self.token_ids[i * block_size : (i + 1) * block_size]
            parent = _digest(struct.pack("<Q", parent) + struct.pack(f"<{len(block)}q", *block))
            out.append(parent)
        return out


@attrs.define(eq=False)
class ShadowJob:
    """Shadow work of one session on one target model's sticky instance."""

    key: JobKey
    instance_id: str
    history: SessionHistory
    block_size: int
    switch_probability: float = 0.0
    sequence: int = 0  # creation order: the tie-break among equal probabilities
    epoch: int = 0
    num_held_tokens: int = 0
    num_inflight_tokens: int = 0
    num_computed_tokens: int = 0  # lifetime shadow tokens this job computed
    validated_at: int | None = None  # the port's eviction count when held was last checked
    #: The session's switch call may come any moment: its routed call has finished and its next call has
    #: not arrived (its tool gap is running). Set by the job source (``ShadowManager.on_call_done``, or the
    #: shadow request's tag); read by controllers with an imminent-job rule (``SlackController.reads_imminence``).
    imminent: bool = False
    #: Called with the job when :meth:`refresh` lowers its held prefix (the manager's index).
    on_held_lowered: Callable[[ShadowJob], None] | None = attrs.field(default=None, repr=False)

    @property
    def num_target_tokens(self) -> int:
        """Block-aligned length of the current history (shadows compute whole
        blocks only: a partial block is not cached by a block-level cache)."""
        return self.history.num_full_blocks(self.block_size) * self.block_size

    @property
    def next_token(self) -> int:
        return self.num_held_tokens + self.num_inflight_tokens

    @property
    def num_missing_tokens(self) -> int:
        if self.epoch != self.history.epoch:
            return self.num_target_tokens
        return max(0, self.num_target_tokens - self.next_token)

    def sync_epoch(self) -> None:
        """After compaction, forget everything held in the old epoch."""
        if self.epoch != self.history.epoch:
            self.epoch = self.history.epoch
            self.num_held_tokens = 0
            self.num_inflight_tokens = 0
            self.validated_at = None

    def refresh(self, num_cached_tokens: int, eviction_count: int) -> None:
        """Adopt what the instance reports as cached (block-aligned)."""
        before = self.num_held_tokens if self.epoch == self.history.epoch else 0
        self.sync_epoch()
        aligned = num_cached_tokens - num_cached_tokens % self.block_size
        self.num_held_tokens = min(aligned, self.num_target_tokens)
        self.validated_at = eviction_count
        if self.num_held_tokens < before and self.on_held_lowered is not None:
            self.on_held_lowered(self)

    def reserve(self, num_tokens: int) -> int:
        """Mark ``num_tokens`` as in flight; returns the first token position."""
        start = self.next_token
        self.num_inflight_tokens += num_tokens
        return start

    def commit(self, epoch: int, start_token: int, num_granted: int, num_computed: int) -> bool:
        """Apply an engine's result for a grant; False when it was stale."""
        self.num_inflight_tokens = max(0, self.num_inflight_tokens - num_granted)
        if epoch != self.epoch or start_token != self.num_held_tokens:
            return False
        # A block-level cache holds whole blocks only (as refresh() assumes): the
        # tail of a partially computed chunk is not held, so grants stay aligned.
        self.num_held_tokens += num_computed - num_computed % self.block_size
        self.num_computed_tokens += num_computed
        return True
