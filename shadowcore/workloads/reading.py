"""What every trace loader shares: opening (gzip by magic bytes), UTF-8 lines that
count physical lines, CSV rows checked against a header, JSON Lines records, JSON
field access that names the JSON path, token counts and wall-clock timestamps
(integer nanoseconds). A new format's loader is built from these (see
:mod:`shadowcore.workloads.azure` for the smallest one).

Invariants: every helper either returns a checked value or raises one
:class:`~shadowcore.workloads.trace.TraceError` naming the file, the 1-based
physical line, the column (CSV field number, JSON character column or JSON path)
and the offending value; nothing is skipped except blank lines at the end of a
file.
"""

from __future__ import annotations

import csv
import gzip
import json
import os
import re
from collections.abc import Iterator, Sequence
from datetime import date
from typing import IO, Any

from shadowcore.workloads.trace import TraceError

__all__ = [
    "DECIMAL", "WALLCLOCK_FORMAT", "Clock", "Lines", "count_field", "csv_count", "csv_rows", "default_name",
    "first_nonblank", "json_count", "json_error", "json_field", "json_path", "json_str", "jsonl_records",
    "open_trace", "str_field", "wallclock_ns",
]


# -- files and CSV ------------------------------------------------------------------------------


class Lines:
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


def open_trace(path: str) -> IO[bytes]:
    """The file as bytes, gunzipped when it starts with the gzip magic bytes. A
    missing or unreadable file raises the usual OSError."""
    fh = open(path, "rb")  # noqa: SIM115 -- returned to the caller's `with`
    if fh.peek(2)[:2] == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=fh, mode="rb")  # type: ignore[return-value]
    return fh


def default_name(path: str) -> str:
    base = os.path.basename(path)
    base = base.removesuffix(".gz")
    stem = os.path.splitext(base)[0]
    return stem or base or "trace"


_WALLCLOCK = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[T ](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?(Z|[+-]\d{2}:?\d{2})?",
    re.ASCII)
_EPOCH_ORDINAL = date(1970, 1, 1).toordinal()
WALLCLOCK_FORMAT = "expected YYYY-MM-DD HH:MM:SS[.up to 9 fraction digits][Z|+HH:MM]"


def wallclock_ns(text: str, days_cache: dict[str, int]) -> tuple[int, bool]:
    """(integer nanoseconds since the Unix epoch, whether the text carried a UTC
    offset). Exact for any number of fraction digits up to 9 (datetime keeps 6).
    Raises ValueError naming the problem."""
    m = _WALLCLOCK.fullmatch(text)
    if m is None:
        raise ValueError(f"unparsable timestamp: {WALLCLOCK_FORMAT}")
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


class Clock:
    """Parses a file's wall-clock timestamps; all must agree on carrying a UTC offset
    (a naive timestamp next to an offset one has no defined order)."""

    def __init__(self) -> None:
        self._days: dict[str, int] = {}
        self._aware: bool | None = None

    def ns(self, text: str) -> int:
        ns, aware = wallclock_ns(text, self._days)
        if self._aware is None:
            self._aware = aware
        elif aware != self._aware:
            raise ValueError("timestamp mixes UTC-offset and naive forms in one file")
        return ns


DECIMAL = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?", re.ASCII)
_NEGATIVE_INT = re.compile(r"-\d+", re.ASCII)


def csv_count(text: str, path: str, line: int, col: int, name: str) -> int:
    if text.isdigit() and text.isascii():
        return int(text)
    if _NEGATIVE_INT.fullmatch(text):
        raise TraceError(path, line, col, text, f"{name}: negative token count")
    if text == "":
        raise TraceError(path, line, col, text, f"{name}: empty field, expected a token count")
    raise TraceError(path, line, col, text, f"{name}: not an integer token count")


def csv_rows(path: str, fh: IO[bytes], expected: Sequence[str],
              fmt: str) -> Iterator[tuple[int, list[str], dict[str, int]]]:
    """Yield ``(line, row, column index by name)`` for each data row after checking
    the header holds every expected column (extra columns are allowed and ignored)
    and the row has exactly the header's number of fields. Blank lines are allowed
    only at the end of the file."""
    lines = Lines(path, fh)
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


# -- JSON ---------------------------------------------------------------------------------


def _excerpt(text: str, pos: int) -> str:
    """Up to 24 characters of ``text`` from ``pos``, stopping at the end of the line."""
    part = text[pos:pos + 24]
    return part.splitlines()[0] if part.strip() else part


def json_error(path: str, line: int, e: json.JSONDecodeError, text: str) -> TraceError:
    return TraceError(path, line, e.colno, _excerpt(text, e.pos), f"invalid JSON: {e.msg}")


def jsonl_records(path: str, fh: IO[bytes]) -> Iterator[tuple[int, Any]]:
    """``(line, value)`` per non-blank line; blank lines only at the end of the file."""
    blank_line = 0
    n = 0
    for text in (lines := Lines(path, fh)):
        if not text.strip():
            blank_line = blank_line or lines.line
            continue
        if blank_line:
            raise TraceError(path, blank_line, 1, "", "empty line before more records")
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise json_error(path, lines.line, e, text) from None
        n += 1
        yield lines.line, value
    if n == 0:
        raise TraceError(path, 1, 1, "", "empty file: expected one JSON object per line")


def json_path(prefix: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{prefix}[{key}]"
    return f"{prefix}.{key}" if prefix else key


def json_field(path: str, line: int, prefix: str, obj: Any, key: str) -> tuple[Any, str]:
    """``obj[key]`` and its JSON path; a missing key is an error."""
    if not isinstance(obj, dict):
        raise TraceError(path, line, prefix or "$", obj, "expected a JSON object")
    where = json_path(prefix, key)
    if key not in obj:
        raise TraceError(path, line, where, sorted(obj), f"missing field {key!r}")
    return obj[key], where


def json_count(path: str, line: int, where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(path, line, where, value, "not an integer token count")
    if value < 0:
        raise TraceError(path, line, where, value, "negative token count")
    return value


def count_field(path: str, line: int, prefix: str, obj: Any, key: str) -> int:
    value, where = json_field(path, line, prefix, obj, key)
    return json_count(path, line, where, value)


def str_field(path: str, line: int, prefix: str, obj: Any, key: str) -> str:
    value, where = json_field(path, line, prefix, obj, key)
    return json_str(path, line, where, value)


def json_str(path: str, line: int, where: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TraceError(path, line, where, value, "not a string")
    return value


def first_nonblank(fh: IO[bytes]) -> str:
    for raw in fh:
        text = raw.decode("utf-8", errors="replace").lstrip("\ufeff")
        if text.strip():
            return text
    return ""
