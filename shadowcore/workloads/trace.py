"""Trace values: :class:`Trace` (a named, time-ordered tuple of
:class:`TraceRequest`) and :class:`TraceError`, the one error every loader raises.

Invariants: a ``Trace``'s arrivals never decrease and every request is validated
at construction (finite, non-negative times and counts; cached <= prompt); the
operations (``window``, ``scaled``, ``capped``, ``windows``) return new values and
never drop a request silently (``capped`` reports how many it changed).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from shadowcore import _validators as _v
from shadowcore.errors import ConfigError, ShadowError

__all__ = ["MOONCAKE_BLOCK_TOKENS", "Trace", "TraceError", "TraceRequest"]

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` block in Mooncake's published traces (the KV page size;
:meth:`Trace.capped`'s default)."""


# -- errors -------------------------------------------------------------------------------


class TraceError(ShadowError, ValueError):
    """A trace file is malformed. Names the file, the line, the column (CSV field
    number, JSON character column or JSON path) and the offending value."""

    def __init__(self, path: str | os.PathLike[str], line: int, column: int | str,
                 value: object, problem: str) -> None:
        self.path = os.fspath(path)
        self.line = line
        self.column = column
        self.value = value
        self.problem = problem
        super().__init__(f"{self.path}:{line}:{column}: {problem} ({value!r})")


# -- records ------------------------------------------------------------------------------


def _finite_non_negative(instance: Any, attribute: Any, value: Any) -> None:
    _v.non_negative(instance, attribute, value)
    if not math.isfinite(value):
        raise ConfigError(attribute.name, value, "must be finite")


def _hash_id_tuple(_instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, tuple) or any(
            isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in value):
        raise ConfigError(attribute.name, value, "must be a tuple of integers >= 0")


def _string(_instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, str):
        raise ConfigError(attribute.name, value, "must be a string")


@attrs.frozen
class TraceRequest:
    """One request of a trace.

    ``arrival_s`` is seconds from the start of the trace (its first request for a
    loaded trace, the window start for a window). ``hash_ids`` are the prefix-block
    ids of formats that carry them (Mooncake), one per ``hash_block_tokens`` prompt
    tokens (equal leading ids: a shared prefix; see
    :mod:`shadowcore.workloads.prefix`), ``model`` and ``session_id`` are empty
    where the format has none, and ``num_cached_tokens`` (<= ``num_prompt_tokens``)
    is the prompt prefix the original system served from cache (Copilot)."""

    arrival_s: float = attrs.field(validator=_finite_non_negative)
    num_prompt_tokens: int = attrs.field(validator=_v.non_negative_int)
    num_output_tokens: int = attrs.field(validator=_v.non_negative_int)
    hash_ids: tuple[int, ...] = attrs.field(default=(), validator=_hash_id_tuple)
    model: str = attrs.field(default="", validator=_string)
    session_id: str = attrs.field(default="", validator=_string)
    num_cached_tokens: int = attrs.field(default=0, validator=_v.non_negative_int)
    hash_block_tokens: int = attrs.field(default=MOONCAKE_BLOCK_TOKENS, validator=_v.positive_int)

    def __attrs_post_init__(self) -> None:
        if self.num_cached_tokens > self.num_prompt_tokens:
            raise ConfigError("num_cached_tokens", self.num_cached_tokens,
                              f"must be <= num_prompt_tokens ({self.num_prompt_tokens})")


def _requests(_instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, tuple) or not all(isinstance(r, TraceRequest) for r in value):
        raise ConfigError(attribute.name, type(value).__name__, "must be a tuple of TraceRequest")
    for i in range(1, len(value)):
        if value[i].arrival_s < value[i - 1].arrival_s:
            raise ConfigError(f"{attribute.name}[{i}].arrival_s", value[i].arrival_s,
                              f"must be >= the previous arrival ({value[i - 1].arrival_s})")


def _optional_span(_instance: Any, attribute: Any, value: Any) -> None:
    if value is not None:
        _finite_non_negative(_instance, attribute, value)


@attrs.frozen
class Trace:
    """A named, time-ordered request list.

    ``span_s`` is the length of time the trace covers; it is set for windows (the
    window length, so an empty tail still counts) and otherwise ``None``, meaning the
    trace ends at its last arrival."""

    name: str = attrs.field(validator=_v.non_empty_str)
    requests: tuple[TraceRequest, ...] = attrs.field(validator=_requests)
    span_s: float | None = attrs.field(default=None, kw_only=True, validator=_optional_span)
    _arrivals: np.ndarray = attrs.field(init=False, repr=False, eq=False, hash=False)

    def __attrs_post_init__(self) -> None:
        arrivals = np.fromiter((r.arrival_s for r in self.requests), dtype=np.float64,
                               count=len(self.requests))
        arrivals.flags.writeable = False
        object.__setattr__(self, "_arrivals", arrivals)
        if self.span_s is not None and len(arrivals) and arrivals[-1] > self.span_s:
            raise ConfigError("span_s", self.span_s,
                              f"must be >= the last arrival ({float(arrivals[-1])})")

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def arrivals_s(self) -> np.ndarray:
        """Arrival times in seconds (a read-only array)."""
        return self._arrivals

    @property
    def duration_s(self) -> float:
        """``span_s`` if set, else the last arrival (0.0 for an empty trace)."""
        if self.span_s is not None:
            return float(self.span_s)
        return float(self._arrivals[-1]) if len(self._arrivals) else 0.0

    @property
    def rate_per_s(self) -> float:
        """Requests per second over ``duration_s``: 0.0 for an empty trace, ``inf``
        when every request arrives at the same instant (zero duration)."""
        n = len(self.requests)
        if n == 0:
            return 0.0
        d = self.duration_s
        return n / d if d > 0 else math.inf

    def window(self, start_s: float, length_s: float) -> Trace:
        """The requests arriving in ``[start_s, start_s + length_s)``, re-based so the
        window starts at 0; ``span_s`` is ``length_s``. The window must lie inside the
        trace (``start_s + length_s <= duration_s``): a window running past the end
        would understate the rate, so it raises ConfigError instead."""
        _check_number("start_s", start_s, lambda x: x >= 0, "must be >= 0")
        _check_number("length_s", length_s, lambda x: x > 0, "must be > 0")
        end = start_s + length_s
        if end > self.duration_s * (1 + 1e-12) + 1e-9:
            raise ConfigError("length_s", length_s,
                              f"window [{start_s:g}, {end:g}) s runs past the trace end "
                              f"({self.duration_s:g} s)")
        lo = int(np.searchsorted(self._arrivals, start_s, side="left"))
        hi = int(np.searchsorted(self._arrivals, end, side="left"))
        reqs = tuple(attrs.evolve(r, arrival_s=max(0.0, r.arrival_s - start_s))
                     for r in self.requests[lo:hi])
        return Trace(f"{self.name}[{start_s:g}s+{length_s:g}s]", reqs, span_s=float(length_s))

    def scaled(self, rate_factor: float) -> Trace:
        """The same requests with arrivals divided by ``rate_factor``: 2.0 doubles the
        request rate (compresses time), 0.5 halves it. Token counts are unchanged."""
        _check_number("rate_factor", rate_factor, lambda x: 0 < x < math.inf, "must be > 0 and finite")
        reqs = tuple(attrs.evolve(r, arrival_s=r.arrival_s / rate_factor) for r in self.requests)
        span = None if self.span_s is None else self.span_s / rate_factor
        return Trace(f"{self.name}*{rate_factor:g}", reqs, span_s=span)

    def capped(self, max_prompt: int | None = None, max_output: int | None = None, *,
               hash_block_tokens: int | None = None) -> tuple[Trace, int]:
        """Cap token counts, for models with a smaller context or output limit.

        Returns ``(trace, n_capped)``: the new trace and how many requests had their
        prompt or output count lowered. Capping is never silent: the caller gets the
        count and should report it. A capped prompt also caps ``num_cached_tokens``
        to the new prompt length and keeps only the ``hash_ids`` blocks that still
        hold prompt tokens (``ceil(max_prompt / hash_block_tokens)``; default: each
        request's own ``hash_block_tokens``). ``None`` leaves
        that count uncapped. Requests are never dropped."""
        for field, cap in (("max_prompt", max_prompt), ("max_output", max_output)):
            if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
                raise ConfigError(field, cap, "must be an integer >= 1 or None")
        if hash_block_tokens is not None and (isinstance(hash_block_tokens, bool)
                                              or not isinstance(hash_block_tokens, int) or hash_block_tokens < 1):
            raise ConfigError("hash_block_tokens", hash_block_tokens, "must be an integer >= 1")
        out: list[TraceRequest] = []
        n_capped = 0
        for r in self.requests:
            prompt_cut = max_prompt is not None and r.num_prompt_tokens > max_prompt
            output_cut = max_output is not None and r.num_output_tokens > max_output
            if not (prompt_cut or output_cut):
                out.append(r)
                continue
            n_capped += 1
            changes: dict[str, Any] = {}
            if prompt_cut:
                assert max_prompt is not None
                changes["num_prompt_tokens"] = max_prompt
                changes["num_cached_tokens"] = min(r.num_cached_tokens, max_prompt)
                block = r.hash_block_tokens if hash_block_tokens is None else hash_block_tokens
                changes["hash_ids"] = r.hash_ids[:-(-max_prompt // block)]
            if output_cut:
                changes["num_output_tokens"] = max_output
            out.append(attrs.evolve(r, **changes))
        return Trace(self.name, tuple(out), span_s=self.span_s), n_capped

    def windows(self, length_s: float = 3600.0, step_s: float = 60.0) -> dict[str, Trace]:
        """Peak, median and trough windows by request rate.

        Slides a window of ``length_s`` over the trace in steps of ``step_s`` (starts
        0, step, 2*step, ... while the window fits) and counts the arrivals in each.
        Returns ``{"peak", "median", "trough"}``: the windows with the most requests,
        the median count (the lower median for an even number of windows) and the
        fewest; ties go to the earliest window. So ``peak.rate_per_s >=
        median.rate_per_s >= trough.rate_per_s``. Each is a :meth:`window`.

        A trace shorter than ``length_s`` has no such window and raises ConfigError
        (rather than returning the whole trace three times, which would hide that):
        pass a smaller ``length_s`` (the 2023 Azure traces span about 57 minutes)."""
        _check_number("length_s", length_s, lambda x: 0 < x < math.inf, "must be > 0 and finite")
        _check_number("step_s", step_s, lambda x: 0 < x < math.inf, "must be > 0 and finite")
        duration = self.duration_s
        if duration < length_s:
            raise ConfigError("length_s", length_s,
                              f"trace {self.name!r} spans only {duration:g} s; "
                              "choose a window length no longer than the trace")
        n = math.floor((duration - length_s) / step_s * (1 + 1e-12) + 1e-9) + 1
        starts = np.arange(n, dtype=np.float64) * step_s
        counts = (np.searchsorted(self._arrivals, starts + length_s, side="left")
                  - np.searchsorted(self._arrivals, starts, side="left"))
        order = np.lexsort((starts, counts))  # by count, then by start
        picks = {
            "peak": int(np.flatnonzero(counts == counts.max())[0]),
            "median": int(order[(n - 1) // 2]),
            "trough": int(np.flatnonzero(counts == counts.min())[0]),
        }
        return {k: self.window(float(starts[i]), length_s) for k, i in picks.items()}


def _check_number(field: str, value: Any, ok: Callable[[float], bool], problem: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) \
            or not ok(value):
        raise ConfigError(field, value, problem)
