"""Latency models: the predicted duration of one engine iteration.

The slack controller asks a :class:`LatencyModel` how long an iteration would
take with ``n`` extra shadow tokens; the simulator asks the same object how
long the iteration it runs does take. Both must therefore see the same batch
description, :class:`BatchShape`.

Invariants every implementation keeps (the conformance check tests them):

* ``predict_s`` is pure: same shape, same answer; no wall time, no RNG.
* It is non-decreasing in every token count: adding a prefill token, a decode
  or context never makes an iteration faster. The controller's search for the
  largest shadow chunk relies on this.
* An empty batch costs ``0.0``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import attrs

from shadowcore._validators import non_negative, non_negative_int


@attrs.frozen
class PrefillChunk:
    """One prefill chunk in a batch.

    ``num_new_tokens`` are computed this iteration on top of
    ``num_context_tokens`` that are already in the KV cache (cached prefix or
    earlier chunks), so attention reads ``num_context_tokens + num_new_tokens``.
    """

    num_new_tokens: int = attrs.field(validator=non_negative_int)
    num_context_tokens: int = attrs.field(default=0, validator=non_negative_int)


@attrs.frozen
class BatchShape:
    """What a latency model needs to know about one iteration's batch.

    ``decode_context_tokens`` holds one entry per decoding sequence: the KV
    length it attends over. ``reload_bytes`` is KV brought back from the host
    tier for this iteration (charged by models that know the PCIe bandwidth).
    """

    prefills: tuple[PrefillChunk, ...] = attrs.field(default=(), converter=tuple)
    decode_context_tokens: tuple[int, ...] = attrs.field(default=(), converter=tuple)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.prefills)

    @property
    def num_decodes(self) -> int:
        return len(self.decode_context_tokens)

    @property
    def num_tokens(self) -> int:
        """Tokens scheduled this iteration (the engine's token budget unit)."""
        return self.num_prefill_tokens + self.num_decodes

    @property
    def is_empty(self) -> bool:
        return self.num_tokens == 0

    @property
    def is_decode_only(self) -> bool:
        return self.num_decodes > 0 and self.num_prefill_tokens == 0

    def with_prefills(self, chunks: tuple[PrefillChunk, ...]) -> BatchShape:
        """This batch plus ``chunks`` appended after the existing prefills."""
        return BatchShape(self.prefills + tuple(chunks), self.decode_context_tokens)


@runtime_checkable
class LatencyModel(Protocol):
    """Port: predicted iteration time of a batch on one instance (seconds)."""

    def predict_s(self, batch: BatchShape) -> float:
        """Duration of one iteration that runs ``batch``; 0.0 when empty."""
        ...

    def predict_decodes_s(self, num_decodes: int, total_context: int, max_context: int) -> float | None:
        """Optional; the default (and a model that does not define it) gives
        ``None``. Otherwise exactly, bit for bit, what :meth:`predict_s` gives
        for a decode-only batch of ``num_decodes`` sequences whose contexts sum
        to ``total_context`` tokens, the longest ``max_context``; or ``None``
        when the model cannot tell from these aggregates. Engines time steady
        decode iterations with it and, on ``None``, build the batch and call
        :meth:`predict_s`; results are the same either way."""
        return None

    def predict_batch_s(
        self, prefills: tuple[PrefillChunk, ...], num_decodes: int, total_context: int, max_context: int
    ) -> float | None:
        """Optional, as :meth:`predict_decodes_s` but for any batch: exactly,
        bit for bit, what :meth:`predict_s` gives for ``BatchShape(prefills,
        contexts)`` where the decode ``contexts`` are ``num_decodes`` sequences
        summing to ``total_context`` tokens, the longest ``max_context`` (same
        errors); or ``None`` when the model cannot tell from these aggregates.
        Engines time mixed iterations of a large decode batch with it."""
        return None


@attrs.frozen
class LinearLatencyModel:
    """A small analytic model with no data behind it.

    ``t = overhead + prefill_s_per_token * prefill_tokens
    + attention_s_per_token_pair * sum(new * (context + new / 2))
    + decode_s_per_seq * decodes + decode_s_per_context_token * sum(context)``.

    It is the default for the in-memory fake engine and the unit tests; the
    simulator backend ships Vidur-grounded and roofline models with the same
    Protocol.
    """

    overhead_s: float = attrs.field(default=0.003, validator=non_negative)
    prefill_s_per_token: float = attrs.field(default=2.5e-5, validator=non_negative)
    attention_s_per_token_pair: float = attrs.field(default=1.0e-9, validator=non_negative)
    decode_s_per_seq: float = attrs.field(default=5.0e-5, validator=non_negative)
    decode_s_per_context_token: float = attrs.field(default=2.0e-8, validator=non_negative)

    def predict_s(self, batch: BatchShape) -> float:
        if batch.is_empty:
            return 0.0
        prefill_tokens = 0
        attention_pairs = 0.0
        for chunk in batch.prefills:
            prefill_tokens += chunk.num_new_tokens
            attention_pairs += chunk.num_new_tokens * (
                chunk.num_context_tokens + chunk.num_new_tokens / 2.0
            )
        return (
            self.overhead_s
            + self.prefill_s_per_token * prefill_tokens
            + self.attention_s_per_token_pair * attention_pairs
            + self.decode_s_per_seq * batch.num_decodes
            + self.decode_s_per_context_token * sum(batch.decode_context_tokens)
        )

    def predict_decodes_s(self, num_decodes: int, total_context: int, max_context: int) -> float | None:
        """:meth:`predict_s` of a decode-only batch from its aggregates (the
        same float operations in the same order: bit-identical)."""
        if num_decodes <= 0:
            return None
        return (
            self.overhead_s
            + self.prefill_s_per_token * 0
            + self.attention_s_per_token_pair * 0.0
            + self.decode_s_per_seq * num_decodes
            + self.decode_s_per_context_token * total_context
        )

    def predict_batch_s(
        self, prefills: tuple[PrefillChunk, ...], num_decodes: int, total_context: int, max_context: int
    ) -> float | None:
        """:meth:`predict_s` from the decode aggregates (the same float
        operations in the same order: bit-identical)."""
        prefill_tokens = 0
        attention_pairs = 0.0
        for chunk in prefills:
            prefill_tokens += chunk.num_new_tokens
            attention_pairs += chunk.num_new_tokens * (chunk.num_context_tokens + chunk.num_new_tokens / 2.0)
        if prefill_tokens + num_decodes == 0:
            return 0.0
        return (
            self.overhead_s
            + self.prefill_s_per_token * prefill_tokens
            + self.attention_s_per_token_pair * attention_pairs
            + self.decode_s_per_seq * num_decodes
            + self.decode_s_per_context_token * total_context
        )


__all__ = ["BatchShape", "LatencyModel", "LinearLatencyModel", "PrefillChunk", "chunked_prefill_s", "decode_run_s"]


def decode_run_s(latency: LatencyModel, num_decodes: int, total_context: int, max_context: int,
                 num_steps: int) -> list[float]:
    """The times of a run of steady decode iterations after one of ``num_decodes``
    sequences with these aggregates, every context one token longer at each:
    ``predict_decodes_s(num_decodes, total_context + k * num_decodes, max_context + k)``
    for ``k`` = 1 .. ``num_steps``, stopping before the first step that gives ``None``
    or raises (a look-ahead: the caller meets that step itself). A model may answer
    it faster with a method ``predict_decode_run_s`` of the same arguments, which must
    give exactly this list (``tests/sim/test_speed_equivalence_latency.py``)."""
    run = getattr(latency, "predict_decode_run_s", None)
    if run is not None:
        return run(num_decodes, total_context, max_context, num_steps)
    predict = getattr(latency, "predict_decodes_s", None)
    out: list[float] = []
    if predict is None:
        return out
    total, longest = total_context, max_context
    for _ in range(num_steps):
        total += num_decodes
        longest += 1
        try:
            d = predict(num_decodes, total, longest)
        except Exception:  # noqa: BLE001 (a look-ahead, see above)
            break
        if d is None:
            break
        out.append(d)
    return out


def windowed_prefill_s(latency: LatencyModel, num_tokens: int, chunk_tokens: int, window_tokens: int) -> float:
    """The placement estimate of ``num_tokens`` of queued prefill work: requests of at
    most ``window_tokens`` each (0: no window), every one from an empty context. While
    the work fits one window this is :func:`chunked_prefill_s`; beyond it that would
    price one impossible prompt longer than the model's window (which a table-based
    latency model refuses)."""
    if window_tokens <= 0 or num_tokens <= window_tokens:
        return chunked_prefill_s(latency, num_tokens, chunk_tokens)  # context ignored: an estimate
    full, rest = divmod(num_tokens, window_tokens)
    t = full * chunked_prefill_s(latency, window_tokens, chunk_tokens)
    if rest:
        t += chunked_prefill_s(latency, rest, chunk_tokens)
    return t


def chunked_prefill_s(latency: LatencyModel, num_tokens: int, chunk_tokens: int, num_context_tokens: int = 0) -> float:
    """Predicted time to prefill ``num_tokens`` alone in chunks of ``chunk_tokens``
    on top of ``num_context_tokens`` already cached (the isolated prefill of SLOs
    and the placement estimate)."""
    fast = getattr(latency, "predict_batch_s", None)  # the same values (its contract), no BatchShape built
    total, done = 0.0, 0
    while done < num_tokens:
        n = min(chunk_tokens, num_tokens - done)
        chunk = PrefillChunk(n, num_context_tokens + done)
        t = fast((chunk,), 0, 0, 0) if fast is not None else None
        total += latency.predict_s(BatchShape((chunk,))) if t is None else t
        done += n
    return total
