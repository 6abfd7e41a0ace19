"""Normal-traffic traces: arrival times and token counts of production requests.

Four public formats load into one :class:`Trace` (a time-ordered tuple of
:class:`TraceRequest`):

* :func:`load_azure` -- Azure LLM inference trace CSV (2023 and 2024 releases:
  ``TIMESTAMP,ContextTokens,GeneratedTokens``).
* :func:`load_burstgpt` -- BurstGPT CSV (``Timestamp,Model,Request tokens,Response
  tokens,Total tokens,Log Type``).
* :func:`load_mooncake` -- Mooncake trace JSONL (``timestamp``, ``input_length``,
  ``output_length``, ``hash_ids``).
* :func:`load_copilot` -- GitHub Copilot coding-agent traces 2026 (sessions ->
  turns -> llm_calls).

:func:`load_trace` picks the loader from the file's content.

Every loader streams the file with the standard library (``csv``/``json``; a
gzip-compressed file, recognised by its magic bytes, is decompressed on the fly) and
checks every row. A malformed row stops the load with a :class:`TraceError` whose
message is ``"{path}:{line}:{column}: {problem} ({value!r})"``; nothing is silently
dropped, clamped or reordered except where a loader's docstring says so.

* ``line`` is the 1-based physical line of the file (for gzip files, of the
  decompressed text).
* ``column`` is, in CSV files, the 1-based field number; in JSON files, the 1-based
  character column for JSON syntax errors and the JSON path of the offending field
  (``turns[1].llm_calls[0].tokens.prompt``; ``$`` for the record itself) for schema
  errors.

Arrival times are seconds from the trace's first request. Trace data is never part
of this package: loaders take the path as an argument.
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import os
import re
from collections.abc import Callable, Iterator, Sequence
from datetime import date
from typing import IO, Any

import attrs
import numpy as np

from shadowcore import _validators as _v
from shadowcore.errors import ConfigError, ShadowError

__all__ = [
    "AZURE_COLUMNS",
    "BURSTGPT_COLUMNS",
    "FORMATS",
    "MOONCAKE_BLOCK_TOKENS",
    "Trace",
    "TraceError",
    "TraceRequest",
    "load_azure",
    "load_burstgpt",
    "load_copilot",
    "load_mooncake",
    "load_trace",
]

AZURE_COLUMNS: tuple[str, ...] = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_COLUMNS: tuple[str, ...] = (
    "Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")
MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` block in Mooncake's published traces (the KV page size)."""


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
    ids of formats that carry them (Mooncake), ``model`` and ``session_id`` are empty
    where the format has none, and ``num_cached_tokens`` (<= ``num_prompt_tokens``)
    is the prompt prefix the original system served from cache (Copilot)."""

    arrival_s: float = attrs.field(validator=_finite_non_negative)
    num_prompt_tokens: int = attrs.field(validator=_v.non_negative_int)
    num_output_tokens: int = attrs.field(validator=_v.non_negative_int)
    hash_ids: tuple[int, ...] = attrs.field(default=(), validator=_hash_id_tuple)
    model: str = attrs.field(default="", validator=_string)
    session_id: str = attrs.field(default="", validator=_string)
    num_cached_tokens: int = attrs.field(default=0, validator=_v.non_negative_int)

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
               hash_block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> tuple[Trace, int]:
        """Cap token counts, for models with a smaller context or output limit.

        Returns ``(trace, n_capped)``: the new trace and how many requests had their
        prompt or output count lowered. Capping is never silent: the caller gets the
        count and should report it. A capped prompt also caps ``num_cached_tokens``
        to the new prompt length and keeps only the ``hash_ids`` blocks that still
        hold prompt tokens (``ceil(max_prompt / hash_block_tokens)``). ``None`` leaves
        that count uncapped. Requests are never dropped."""
        for field, cap in (("max_prompt", max_prompt), ("max_output", max_output)):
            if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
                raise ConfigError(field, cap, "must be an integer >= 1 or None")
        if isinstance(hash_block_tokens, bool) or not isinstance(hash_block_tokens, int) \
                or hash_block_tokens < 1:
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
                changes["hash_ids"] = r.hash_ids[:-(-max_prompt // hash_block_tokens)]
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


# -- reading ------------------------------------------------------------------------------


class _Lines:
    """Text lines of a (possibly gzip-compressed) UTF-8 file, counting physical lines,
    so a decoding error names its line. A leading byte-order mark is dropped."""

    def __init__(self, path: str, fh: IO[bytes]) -> None:
        self.path = path
        self._fh = fh
        self.line = 0  # lines handed out so far

    def __iter__(self) -> Iterator[str]:
        for raw in self._fh:
            self.line += 1
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TraceError(self.path, self.line, e.start + 1,
                                 raw[e.start:e.start + 8].rstrip(b"\r\n"), "not UTF-8 text") from None
            if self.line == 1 and text.startswith("\ufeff"):
                text = text[1:]
            yield text


def _open(path: str) -> IO[bytes]:
    """The file as bytes, gunzipped when it starts with the gzip magic bytes. A
    missing or unreadable file raises the usual OSError."""
    fh = open(path, "rb")  # noqa: SIM115 -- returned to the caller's `with`
    if fh.peek(2)[:2] == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=fh, mode="rb")  # type: ignore[return-value]
    return fh


def _default_name(path: str) -> str:
    base = os.path.basename(path)
    base = base.removesuffix(".gz")
    stem = os.path.splitext(base)[0]
    return stem or base or "trace"


_WALLCLOCK = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[T ](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?(Z|[+-]\d{2}:?\d{2})?",
    re.ASCII)
_EPOCH_ORDINAL = date(1970, 1, 1).toordinal()
_WALLCLOCK_FORMAT = "expected YYYY-MM-DD HH:MM:SS[.up to 9 fraction digits][Z|+HH:MM]"


def _wallclock_ns(text: str, days_cache: dict[str, int]) -> tuple[int, bool]:
    """(integer nanoseconds since the Unix epoch, whether the text carried a UTC
    offset). Exact for any number of fraction digits up to 9 (datetime keeps 6).
    Raises ValueError naming the problem."""
    m = _WALLCLOCK.fullmatch(text)
    if m is None:
        raise ValueError(f"unparsable timestamp: {_WALLCLOCK_FORMAT}")
    y, mo, d, hh, mm, ss, frac, tz = m.groups()
    days = days_cache.get(text[:10])
    if days is None:
        try:
            days = date(int(y), int(mo), int(d)).toordinal() - _EPOCH_ORDINAL
        except ValueError as e:
            raise ValueError(f"invalid date in timestamp: {e}") from None
        days_cache[text[:10]] = days
    h, mi, s = int(hh), int(mm), int(ss)
    if h > 23 or mi > 59 or s > 59:
        raise ValueError("invalid time of day in timestamp")
    ns = (days * 86400 + h * 3600 + mi * 60 + s) * 1_000_000_000
    if frac:
        ns += int(frac) * 10 ** (9 - len(frac))
    if tz is None:
        return ns, False
    if tz != "Z":
        th, tm = int(tz[1:3]), int(tz[-2:])
        if th > 23 or tm > 59:
            raise ValueError("invalid UTC offset in timestamp")
        offset = (th * 3600 + tm * 60) * 1_000_000_000
        ns = ns - offset if tz[0] == "+" else ns + offset
    return ns, True


class _Clock:
    """Parses a file's wall-clock timestamps; all must agree on carrying a UTC offset
    (a naive timestamp next to an offset one has no defined order)."""

    def __init__(self) -> None:
        self._days: dict[str, int] = {}
        self._aware: bool | None = None

    def ns(self, text: str) -> int:
        ns, aware = _wallclock_ns(text, self._days)
        if self._aware is None:
            self._aware = aware
        elif aware != self._aware:
            raise ValueError("timestamp mixes UTC-offset and naive forms in one file")
        return ns


_DECIMAL = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?", re.ASCII)
_NEGATIVE_INT = re.compile(r"-\d+", re.ASCII)


def _csv_count(text: str, path: str, line: int, col: int, name: str) -> int:
    if text.isdigit() and text.isascii():
        return int(text)
    if _NEGATIVE_INT.fullmatch(text):
        raise TraceError(path, line, col, text, f"{name}: negative token count")
    if text == "":
        raise TraceError(path, line, col, text, f"{name}: empty field, expected a token count")
    raise TraceError(path, line, col, text, f"{name}: not an integer token count")


def _csv_rows(path: str, fh: IO[bytes], expected: Sequence[str],
              fmt: str) -> Iterator[tuple[int, list[str], dict[str, int]]]:
    """Yield ``(line, row, column index by name)`` for each data row after checking
    the header holds every expected column (extra columns are allowed and ignored)
    and the row has exactly the header's number of fields. Blank lines are allowed
    only at the end of the file."""
    lines = _Lines(path, fh)
    reader = csv.reader(lines, strict=True)
    try:
        header = next(reader, None)
        if header is None:
            raise TraceError(path, 1, 1, "", f"empty file: expected a CSV header with the "
                             f"{fmt} columns {', '.join(expected)}")
        names = [h.strip() for h in header]
        index = {n: i for i, n in enumerate(names)}
        missing = [c for c in expected if c not in index]
        if missing or len(index) != len(names):
            problem = (f"wrong header: missing {', '.join(missing)}" if missing
                       else "wrong header: duplicate column names")
            raise TraceError(path, reader.line_num, 1, ",".join(header),
                             f"{problem}; {fmt} CSV columns are {', '.join(expected)}")
        width = len(names)
        header_line = reader.line_num
        blank_line = 0
        n_rows = 0
        for row in reader:
            line = reader.line_num
            if not row:
                blank_line = blank_line or line
                continue
            if blank_line:
                raise TraceError(path, blank_line, 1, "", "empty row (blank line) before more rows")
            if len(row) < width:
                raise TraceError(path, line, len(row) + 1, ",".join(row),
                                 f"missing column {names[len(row)]} (row has {len(row)} of "
                                 f"{width} fields)")
            if len(row) > width:
                raise TraceError(path, line, width + 1, row[width],
                                 f"extra field (row has {len(row)} fields, header has {width})")
            n_rows += 1
            yield line, row, index
        if n_rows == 0:
            raise TraceError(path, header_line + 1, 1, "", "no data rows after the header")
    except csv.Error as e:
        raise TraceError(path, reader.line_num or lines.line, 1, "", f"CSV syntax error: {e}") from None


def load_azure(path: str | os.PathLike[str], *, name: str | None = None) -> Trace:
    """Load an Azure LLM inference trace CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``;
    AzurePublicDataset 2023 and 2024).

    ``TIMESTAMP`` is a wall-clock time such as ``2023-11-16 18:17:03.9799600``: all 7
    (up to 9) fraction digits are kept exactly (integer nanoseconds), and an optional
    UTC offset (``Z``, ``+00:00``) is honoured. ``ContextTokens`` becomes
    ``num_prompt_tokens`` and ``GeneratedTokens`` ``num_output_tokens``.

    The published files are sorted by time, so a timestamp earlier than the row before
    it is an error (a damaged or concatenated file), as are a missing column, a
    non-integer or negative count, an unparsable timestamp, a wrong header and an
    empty file. Equal timestamps are kept in file order."""
    p = os.fspath(path)
    clock = _Clock()
    stamps: list[int] = []
    prompts: list[int] = []
    outputs: list[int] = []
    with _open(p) as fh:
        for line, row, idx in _csv_rows(p, fh, AZURE_COLUMNS, "Azure LLM inference"):
            i_ts = idx["TIMESTAMP"]
            text = row[i_ts]
            try:
                ns = clock.ns(text)
            except ValueError as e:
                raise TraceError(p, line, i_ts + 1, text, f"TIMESTAMP: {e}") from None
            if stamps and ns < stamps[-1]:
                raise TraceError(p, line, i_ts + 1, text,
                                 "TIMESTAMP decreases: earlier than the previous row "
                                 "(Azure traces are sorted by time)")
            stamps.append(ns)
            i = idx["ContextTokens"]
            prompts.append(_csv_count(row[i], p, line, i + 1, "ContextTokens"))
            i = idx["GeneratedTokens"]
            outputs.append(_csv_count(row[i], p, line, i + 1, "GeneratedTokens"))
    t0 = stamps[0]
    reqs = tuple(TraceRequest((ns - t0) / 1e9, pr, out)
                 for ns, pr, out in zip(stamps, prompts, outputs, strict=True))
    return Trace(name or _default_name(p), reqs)


def load_burstgpt(path: str | os.PathLike[str], *, name: str | None = None) -> Trace:
    """Load a BurstGPT CSV (``Timestamp,Model,Request tokens,Response tokens,Total
    tokens,Log Type``; https://github.com/HPMLL/BurstGPT).

    ``Timestamp`` is seconds (integer or decimal) from the trace start; arrivals are
    re-based to the first row. ``Request tokens`` becomes ``num_prompt_tokens``,
    ``Response tokens`` ``num_output_tokens`` and ``Model`` ``model``. ``Total tokens``
    is checked to be a token count but not used; ``Log Type`` (conversation or API
    log) is not kept.

    Failed requests: BurstGPT's ``BurstGPT_*.csv`` files (unlike
    ``*_without_fails_*.csv``) record failures as rows with ``Response tokens`` 0.
    They are kept, as requests with ``num_output_tokens == 0`` (they still arrived
    and were prefilled); filter them yourself if you want the without-fails view.

    The files are sorted by time, so a decreasing ``Timestamp`` is an error, as are a
    missing column, a non-integer or negative count, a non-numeric timestamp, a wrong
    header and an empty file."""
    p = os.fspath(path)
    stamps: list[float] = []
    rows: list[tuple[int, int, str]] = []
    with _open(p) as fh:
        for line, row, idx in _csv_rows(p, fh, BURSTGPT_COLUMNS, "BurstGPT"):
            i_ts = idx["Timestamp"]
            text = row[i_ts].strip()
            ts = float(text) if _DECIMAL.fullmatch(text) else math.nan
            if not math.isfinite(ts):
                raise TraceError(p, line, i_ts + 1, row[i_ts],
                                 "Timestamp: not a number of seconds")
            if stamps and ts < stamps[-1]:
                raise TraceError(p, line, i_ts + 1, row[i_ts],
                                 "Timestamp decreases: earlier than the previous row "
                                 "(BurstGPT traces are sorted by time)")
            stamps.append(ts)
            counts = []
            for col in ("Request tokens", "Response tokens", "Total tokens"):
                i = idx[col]
                counts.append(_csv_count(row[i].strip(), p, line, i + 1, col))
            rows.append((counts[0], counts[1], row[idx["Model"]]))
    t0 = stamps[0]
    reqs = tuple(TraceRequest(ts - t0, pr, out, model=model)
                 for ts, (pr, out, model) in zip(stamps, rows, strict=True))
    return Trace(name or _default_name(p), reqs)


# -- JSON ---------------------------------------------------------------------------------


def _excerpt(text: str, pos: int) -> str:
    """Up to 24 characters of ``text`` from ``pos``, stopping at the end of the line."""
    part = text[pos:pos + 24]
    return part.splitlines()[0] if part.strip() else part


def _json_error(path: str, line: int, e: json.JSONDecodeError, text: str) -> TraceError:
    return TraceError(path, line, e.colno, _excerpt(text, e.pos), f"invalid JSON: {e.msg}")


def _jsonl_records(path: str, fh: IO[bytes]) -> Iterator[tuple[int, Any]]:
    """``(line, value)`` per non-blank line; blank lines only at the end of the file."""
    blank_line = 0
    n = 0
    for text in (lines := _Lines(path, fh)):
        if not text.strip():
            blank_line = blank_line or lines.line
            continue
        if blank_line:
            raise TraceError(path, blank_line, 1, "", "empty line before more records")
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise _json_error(path, lines.line, e, text) from None
        n += 1
        yield lines.line, value
    if n == 0:
        raise TraceError(path, 1, 1, "", "empty file: expected one JSON object per line")


def _join(prefix: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{prefix}[{key}]"
    return f"{prefix}.{key}" if prefix else key


def _field(path: str, line: int, prefix: str, obj: Any, key: str) -> tuple[Any, str]:
    """``obj[key]`` and its JSON path; a missing key is an error."""
    if not isinstance(obj, dict):
        raise TraceError(path, line, prefix or "$", obj, "expected a JSON object")
    where = _join(prefix, key)
    if key not in obj:
        raise TraceError(path, line, where, sorted(obj), f"missing field {key!r}")
    return obj[key], where


def _json_count(path: str, line: int, where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(path, line, where, value, "not an integer token count")
    if value < 0:
        raise TraceError(path, line, where, value, "negative token count")
    return value


def _count_field(path: str, line: int, prefix: str, obj: Any, key: str) -> int:
    value, where = _field(path, line, prefix, obj, key)
    return _json_count(path, line, where, value)


def _str_field(path: str, line: int, prefix: str, obj: Any, key: str) -> str:
    value, where = _field(path, line, prefix, obj, key)
    return _json_str(path, line, where, value)


def _json_str(path: str, line: int, where: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TraceError(path, line, where, value, "not a string")
    return value


def load_mooncake(path: str | os.PathLike[str], *, name: str | None = None) -> Trace:
    """Load a Mooncake trace JSONL (https://github.com/kvcache-ai/Mooncake,
    ``FAST25-release/traces``; the format AIPerf and Dynamo replay).

    One JSON object per line: ``timestamp`` (milliseconds from the first request, a
    number), ``input_length`` and ``output_length`` (token counts) and ``hash_ids``
    (a list of integers, one per 512-token block of the prompt,
    :data:`MOONCAKE_BLOCK_TOKENS`; equal leading ids mean a shared prefix). Arrivals
    are ``timestamp / 1000`` re-based to the first line. ``hash_ids`` may be absent
    (then ``()``); its length is not checked against ``input_length``, since other
    producers use other block sizes. Other keys are ignored.

    Records must be in time order (equal timestamps are simultaneous arrivals and
    keep file order): a decreasing ``timestamp`` is an error, as are a missing field,
    a non-integer or negative count, a non-numeric timestamp, a non-integer hash id,
    invalid JSON and an empty file."""
    p = os.fspath(path)
    stamps: list[float] = []
    rows: list[tuple[int, int, tuple[int, ...]]] = []
    with _open(p) as fh:
        for line, rec in _jsonl_records(p, fh):
            ts, where = _field(p, line, "", rec, "timestamp")
            if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
                raise TraceError(p, line, where, ts, "timestamp: not a number of milliseconds")
            if stamps and ts < stamps[-1]:
                raise TraceError(p, line, where, ts,
                                 "timestamp decreases: earlier than the previous record")
            prompt = _count_field(p, line, "", rec, "input_length")
            output = _count_field(p, line, "", rec, "output_length")
            ids = rec.get("hash_ids", [])
            if not isinstance(ids, list):
                raise TraceError(p, line, "hash_ids", ids, "not a list of integers")
            for k, h in enumerate(ids):
                if isinstance(h, bool) or not isinstance(h, int) or h < 0:
                    raise TraceError(p, line, f"hash_ids[{k}]", h, "not an integer >= 0")
            stamps.append(ts)
            rows.append((prompt, output, tuple(ids)))
    t0 = stamps[0]
    reqs = tuple(TraceRequest((ts - t0) / 1000.0, pr, out, hash_ids=ids)
                 for ts, (pr, out, ids) in zip(stamps, rows, strict=True))
    return Trace(name or _default_name(p), reqs)


_JSON_WS = " \t\n\r"


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _JSON_WS:
        i += 1
    return i


def _document_sessions(path: str, text: str) -> Iterator[tuple[int, str, Any]]:
    """``(line, JSON path prefix, session)`` of a single JSON document that is a list
    of sessions or an object with a ``sessions`` list; the line is where the session
    object starts."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise _json_error(path, e.lineno, e, text) from None
    dec = json.JSONDecoder()
    i = _skip_ws(text, 0)
    if isinstance(doc, list):
        sessions, prefix = doc, ""
    elif isinstance(doc, dict) and isinstance(doc.get("sessions"), list):
        sessions, prefix = doc["sessions"], "sessions"
        # Find the array's position: walk the (already valid) top-level object.
        i = _skip_ws(text, i + 1)
        while True:
            key, i = dec.raw_decode(text, i)
            i = _skip_ws(text, _skip_ws(text, i) + 1)  # past ':'
            if key == "sessions":
                break
            _, i = dec.raw_decode(text, i)
            i = _skip_ws(text, _skip_ws(text, i) + 1)  # past ','
    else:
        keys = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise TraceError(path, 1, "$", keys,
                         "expected a list of sessions or an object with a 'sessions' list")
    # ``i`` is at the sessions array's '['.
    i = _skip_ws(text, i + 1)
    line, upto = 1, 0
    for k, session in enumerate(sessions):
        line += text.count("\n", upto, i)
        upto = i
        yield line, f"{prefix}[{k}]", session
        _, i = dec.raw_decode(text, i)
        i = _skip_ws(text, _skip_ws(text, i) + 1)  # past ','


def load_copilot(path: str | os.PathLike[str], *, name: str | None = None) -> Trace:
    """Load GitHub Copilot coding-agent traces 2026 (AzurePublicDataset,
    ``GitHubCopilotCodingAgentDataset2026.md``; field reference
    ``analysis/GitHubCopilotCodingAgents/schema.json``).

    The release is JSONL (gzip-compressed shards ``shard-NNNN.jsonl.gz``; both plain
    and gzip files load), one session per line. A single JSON document holding a list
    of sessions, or an object ``{"sessions": [...]}``, also loads. The fields read
    (others, e.g. ``date``, ``turn_id``, ``duration_ms``, ``tool_batches``,
    ``tokens.total``, ``message_metadata``, are ignored)::

        {"session_id": str,
         "turns": [{"llm_calls": [{"timestamp": "2026-06-01T12:00:00.123Z",
                                   "model": str,
                                   "tokens": {"prompt": int, "completion": int,
                                              "cached": int}}, ...]}, ...]}

    Each LLM call becomes one request: ``tokens.prompt`` -> ``num_prompt_tokens``,
    ``tokens.completion`` -> ``num_output_tokens``, ``tokens.cached`` ->
    ``num_cached_tokens`` (must be <= prompt), ``model`` and ``session_id`` as they
    are. ``timestamp`` is an ISO-8601 wall-clock time (``T`` or space, up to 9
    fraction digits, optional ``Z``/``+HH:MM``; all calls must agree on having an
    offset). Calls with zero prompt tokens are kept.

    Ordering: sessions are stored one per line and overlap in time, so the calls of
    the whole file are sorted by timestamp (stably: equal times keep file order);
    this is the only reordering. Arrivals are seconds from the earliest call.

    Errors name the line of the session (JSONL: its line; a single document: the line
    where the session object starts) and, as the column, the JSON path of the field,
    e.g. ``turns[1].llm_calls[0].tokens.prompt`` (``sessions[3].turns[...]`` in a
    document). A missing field, a wrong type, a negative count, cached > prompt, an
    unparsable timestamp, invalid JSON and a file without any LLM call are errors."""
    p = os.fspath(path)
    with _open(p) as fh:
        first = _first_nonblank(fh)
    calls: list[tuple[int, int, int, int, int, str, str]] = []
    clock = _Clock()
    if first.lstrip().startswith("[") or not _is_jsonl_session(first):
        with _open(p) as fh:
            data = fh.read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TraceError(p, data.count(b"\n", 0, e.start) + 1,
                             e.start - data.rfind(b"\n", 0, e.start),
                             data[e.start:e.start + 8], "not UTF-8 text") from None
        text = text.removeprefix("\ufeff")
        if not text.strip():
            raise TraceError(p, 1, 1, "", "empty file: expected Copilot sessions")
        for line, prefix, session in _document_sessions(p, text):
            _copilot_session(p, line, prefix, session, clock, calls)
    else:
        with _open(p) as fh:
            for line, session in _jsonl_records(p, fh):
                _copilot_session(p, line, "", session, clock, calls)
    if not calls:
        raise TraceError(p, 1, "$", 0, "no llm_calls in the file")
    calls.sort(key=lambda c: (c[0], c[1]))
    t0 = calls[0][0]
    reqs = tuple(TraceRequest((ns - t0) / 1e9, pr, out, model=model, session_id=sid,
                              num_cached_tokens=cached)
                 for ns, _seq, pr, out, cached, model, sid in calls)
    return Trace(name or _default_name(p), reqs)


def _first_nonblank(fh: IO[bytes]) -> str:
    for raw in fh:
        text = raw.decode("utf-8", errors="replace").lstrip("\ufeff")
        if text.strip():
            return text
    return ""


def _is_jsonl_session(text: str) -> bool:
    """Whether a file's first line is a complete JSON session record (JSONL), as
    opposed to the start of a multi-line document or a one-line ``{"sessions":..}``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        # Not a whole value on its own line: JSONL with a broken first record if the
        # line looks like one (``{...}`` on one line), otherwise a document.
        s = text.strip()
        return s.startswith("{") and s.endswith("}")
    return isinstance(value, dict) and "sessions" not in value


def _copilot_session(path: str, line: int, prefix: str, session: Any, clock: _Clock,
                     out: list[tuple[int, int, int, int, int, str, str]]) -> None:
    sid = _str_field(path, line, prefix, session, "session_id")
    turns, where = _field(path, line, prefix, session, "turns")
    if not isinstance(turns, list):
        raise TraceError(path, line, where, turns, "not a list of turns")
    for ti, turn in enumerate(turns):
        calls, where = _field(path, line, _join(_join(prefix, "turns"), ti), turn, "llm_calls")
        if not isinstance(calls, list):
            raise TraceError(path, line, where, calls, "not a list of LLM calls")
        for ci, call in enumerate(calls):
            cp = _join(where, ci)
            ts, ts_where = _field(path, line, cp, call, "timestamp")
            if not isinstance(ts, str):
                raise TraceError(path, line, ts_where, ts, f"timestamp: {_WALLCLOCK_FORMAT}")
            try:
                ns = clock.ns(ts)
            except ValueError as e:
                raise TraceError(path, line, ts_where, ts, f"timestamp: {e}") from None
            model = _str_field(path, line, cp, call, "model")
            tokens, tw = _field(path, line, cp, call, "tokens")
            prompt = _count_field(path, line, tw, tokens, "prompt")
            completion = _count_field(path, line, tw, tokens, "completion")
            cached, cw = _field(path, line, tw, tokens, "cached")
            cached = _json_count(path, line, cw, cached)
            if cached > prompt:
                raise TraceError(path, line, cw, cached,
                                 f"cached tokens exceed prompt tokens ({prompt})")
            out.append((ns, len(out), prompt, completion, cached, model, sid))


# -- format choice ------------------------------------------------------------------------

FORMATS: dict[str, Callable[..., Trace]] = {
    "azure": load_azure,
    "burstgpt": load_burstgpt,
    "mooncake": load_mooncake,
    "copilot": load_copilot,
}


def load_trace(path: str | os.PathLike[str], format: str | None = None, *,
               name: str | None = None) -> Trace:
    """Load a trace in any of :data:`FORMATS` (``azure``, ``burstgpt``, ``mooncake``,
    ``copilot``). Without ``format``, the file's first non-blank line decides: a CSV
    header with the Azure or BurstGPT columns, or a JSON line with ``input_length``
    (Mooncake) or ``turns``/``sessions`` (Copilot); a JSON document starting with
    ``[`` or spread over lines (a ``.json`` file) is read as Copilot. Anything else
    raises TraceError listing the formats."""
    p = os.fspath(path)
    if format is not None:
        if format not in FORMATS:
            raise ConfigError("format", format, f"must be one of {', '.join(FORMATS)}")
        return FORMATS[format](p, name=name)
    return FORMATS[_sniff(p)](p, name=name)


def _sniff(path: str) -> str:
    with _open(path) as fh:
        first = _first_nonblank(fh)
    s = first.strip()
    base = os.path.basename(path.removesuffix(".gz"))
    if s.startswith(("{", "[")):
        try:
            value = json.loads(s)
        except json.JSONDecodeError:
            value = None
        if value is None and s.startswith("{"):
            # A broken first record: guess by its keys so the loader reports the
            # JSON error with its position.
            if '"input_length"' in s:
                return "mooncake"
            if '"turns"' in s or '"sessions"' in s:
                return "copilot"
        if isinstance(value, dict) and "input_length" in value:
            return "mooncake"
        if isinstance(value, dict) and ("turns" in value or "sessions" in value):
            return "copilot"
        if s.startswith("[") or (value is None and base.endswith(".json")):
            return "copilot"
    elif s:
        header = {h.strip() for h in next(csv.reader([s]), [])}
        if set(AZURE_COLUMNS) <= header:
            return "azure"
        if set(BURSTGPT_COLUMNS) <= header:
            return "burstgpt"
    raise TraceError(path, 1, 1, s[:80],
                     "cannot tell the trace format from the first line; pass format= one of "
                     f"{', '.join(FORMATS)} (azure: CSV {','.join(AZURE_COLUMNS)}; burstgpt: CSV "
                     f"{','.join(BURSTGPT_COLUMNS)}; mooncake: JSONL with input_length; copilot: "
                     "JSON/JSONL sessions with turns)")
