"""Prefix sharing in normal traffic: a trace's prefix-block hashes (Mooncake's
``hash_ids``) as the prompt a request sends, so that requests with equal
leading blocks share cached KV in every engine.

A :class:`PromptPrefix` is the block hashes of a prompt's leading tokens as a
trace records them (one hash per ``block_tokens``-token block; equal leading
hashes mean an equal prefix). Engines see it two ways, which name exactly the
same shared prefixes:

* by token ids (vLLM, real or in virtual time): :meth:`PromptPrefix.token_ids`
  turns each hash into ``block_tokens`` token ids, a pure function of the hash
  (and the vocabulary size), so equal hashes give equal ids and vLLM's own
  prefix cache finds the hit;
* by block hashes of counts (the simulator's KV model):
  :class:`PrefixHistory` is a :class:`~shadowcore.job.SessionHistory` whose
  engine blocks that lie inside the hashed tokens are named by the chain of
  trace hashes up to the trace block they end in, and the block's place in it.

Invariants:

* Two requests share an engine block (of any block size) exactly when that
  block lies inside both requests' hashed tokens (``min(prompt,
  len(hash_ids) * block_tokens)``) and their hash lists agree up to the trace
  block the engine block ends in. Tokens past the hashed ones (a prompt longer
  than its hashes, and the output) are the request's own.
* Without a prefix nothing changes: a request's prompt and block hashes are
  those of a fresh history (``PromptPrefix`` is optional everywhere).
* Deterministic: no RNG state, no wall time; the same hashes give the same ids
  and block hashes in every process.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from shadowcore._validators import positive_int
from shadowcore.errors import ConfigError
from shadowcore.job import SessionHistory

__all__ = ["PrefixHistory", "PromptPrefix", "prefix_reuse_tokens", "trace_prefix"]

_MASK64 = (1 << 64) - 1
_SPECIAL_IDS = 3  # token ids below this are left out (the usual special ids), as the fake sampler does


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _hash_ids(_instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, tuple) or not value or any(
            isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in value):
        raise ConfigError(attribute.name, value, "must be a non-empty tuple of integers >= 0")


@attrs.frozen
class PromptPrefix:
    """The block hashes of a prompt's leading tokens, one per ``block_tokens``
    tokens (the last block may be partial: it covers the prompt's rest)."""

    hash_ids: tuple[int, ...] = attrs.field(converter=tuple, validator=_hash_ids)
    block_tokens: int = attrs.field(validator=positive_int)
    _chain: tuple[int, ...] = attrs.field(init=False, repr=False, eq=False, hash=False)

    def __attrs_post_init__(self) -> None:
        chain, parent = [], _digest(struct.pack("<Q", self.block_tokens) + b"prefix")
        for h in self.hash_ids:  # parent, then this hash: equal chains mean equal hash lists so far
            parent = _digest(struct.pack("<QQ", parent, h & _MASK64))
            chain.append(parent)
        object.__setattr__(self, "_chain", tuple(chain))

    def num_hashed_tokens(self, num_prompt_tokens: int) -> int:
        """The prompt's tokens the hashes cover."""
        return min(num_prompt_tokens, len(self.hash_ids) * self.block_tokens)

    def token_ids(self, num_prompt_tokens: int, vocab_size: int) -> list[int]:
        """The first :meth:`num_hashed_tokens` token ids of the prompt: block
        ``k`` is ``block_tokens`` ids drawn from a function of ``hash_ids[k]``
        alone (ids in ``[3, vocab_size)``)."""
        n = self.num_hashed_tokens(num_prompt_tokens)
        if vocab_size <= _SPECIAL_IDS:
            raise ConfigError("vocab_size", vocab_size, f"must be > {_SPECIAL_IDS}")
        out: list[int] = []
        for h in self.hash_ids[: -(-n // self.block_tokens)]:
            out.extend(block_token_ids(h, self.block_tokens, vocab_size))
        return out[:n]

    def block_hashes(self, block_size: int, start: int, end: int) -> list[int]:
        """Hashes of the engine blocks ``start .. end - 1`` (of ``block_size``
        tokens), every one of which must end inside the hashed tokens: the chain
        value of the trace block the engine block ends in, plus one plus the
        block's place after that trace block's first engine block."""
        T = self.block_tokens
        out = []
        for i in range(start, end):
            m = ((i + 1) * block_size - 1) // T  # the trace block the engine block ends in
            out.append((self._chain[m] + i - (m * T) // block_size + 1) & _MASK64)
        return out


def trace_prefix(request: Any) -> PromptPrefix | None:
    """A trace request's prefix (a :class:`~shadowcore.workloads.trace.TraceRequest`:
    its ``hash_ids`` of ``hash_block_tokens`` each), None where it has no hashes."""
    if not request.hash_ids:
        return None
    return PromptPrefix(request.hash_ids, request.hash_block_tokens)


@functools.lru_cache(maxsize=4096)  # a trace's hot prefixes recur: their ids are made once
def block_token_ids(hash_id: int, block_tokens: int, vocab_size: int) -> tuple[int, ...]:
    """``block_tokens`` token ids in ``[3, vocab_size)``, a pure function of the arguments."""
    seed = hashlib.blake2b(struct.pack("<QQ", hash_id & _MASK64, block_tokens), digest_size=32).digest()
    ids: list[int] = []
    counter = 0
    span = vocab_size - _SPECIAL_IDS
    while len(ids) < block_tokens:  # 8 ids per 64-byte digest (8 bytes each)
        chunk = hashlib.blake2b(seed + struct.pack("<Q", counter), digest_size=64).digest()
        ids.extend(_SPECIAL_IDS + v % span for v in struct.unpack("<8Q", chunk))
        counter += 1
    return tuple(ids[:block_tokens])


@attrs.define(eq=False)
class PrefixHistory(SessionHistory):
    """A normal request's history whose leading blocks are named by a
    :class:`PromptPrefix` (see the module docstring); every later block (the
    rest of the prompt, the output) hashes as a fresh history's does. Made
    with :meth:`for_prompt` before any token is appended."""

    prefix: PromptPrefix | None = None
    num_shared_tokens: int = 0

    @classmethod
    def for_prompt(cls, request_id: str, num_prompt_tokens: int, prefix: PromptPrefix) -> PrefixHistory:
        history = cls(request_id, prefix=prefix, num_shared_tokens=prefix.num_hashed_tokens(num_prompt_tokens))
        history.append(num_prompt_tokens)
        return history

    def compact(self, num_summary_tokens: int, token_ids: Sequence[int] | None = None) -> None:
        raise ValueError(f"{self.session_id}: a normal request's prompt is not compacted")

    def _hashes(self, block_size: int, start: int, end: int, parent: int) -> Iterable[int]:
        if self.prefix is None or self.token_ids is not None:
            return super()._hashes(block_size, start, end, parent)
        shared = min(end, self.num_shared_tokens // block_size)  # blocks that end inside the hashed tokens
        out = self.prefix.block_hashes(block_size, start, shared) if start < shared else []
        if end > max(start, shared):
            out = [*out, *super()._hashes(block_size, max(start, shared), end, parent)]
        return out


def prefix_reuse_tokens(prefixes: Iterable[tuple[int, PromptPrefix | None]], block_size: int) -> list[int]:
    """What an engine with an unbounded prefix cache serves from cache for each
    of a sequence of requests, given as ``(prompt tokens, prefix)`` in arrival
    order, each arriving after the previous ones finished: the whole
    ``block_size`` blocks of its longest hash-list prefix that an earlier
    request also had, within both requests' hashed tokens, and at most
    ``(prompt - 1) // block_size`` blocks (the last prompt token is always
    computed). A reference for tests and reports, computed from the hash lists
    alone (no engine)."""
    seen: dict[tuple[int, ...], int] = {}  # hash-list prefix -> most hashed tokens of a request that had it
    out = []
    for prompt, prefix in prefixes:
        if prefix is None:
            out.append(0)
            continue
        ids, T = prefix.hash_ids, prefix.block_tokens
        own = prefix.num_hashed_tokens(prompt)
        best = 0
        for k in range(1, -(-own // T) + 1):
            other = seen.get(ids[:k])
            if other is None:
                break
            best = min(own, other, k * T)
        out.append(min(best // block_size, (prompt - 1) // block_size) * block_size)
        for k in range(1, -(-own // T) + 1):
            seen[ids[:k]] = max(seen.get(ids[:k], 0), min(own, k * T))
    return out
