"""BurstGPT CSV (https://github.com/HPMLL/BurstGPT): ``Timestamp,Model,Request
tokens,Response tokens,Total tokens,Log Type``.

Invariants: failed requests (``Response tokens`` 0) are kept, not filtered; rows
stay in file order, and a decreasing timestamp is an error.
"""

from __future__ import annotations

import math
import os

from shadowcore.workloads.reading import DECIMAL, csv_count, csv_rows, default_name, open_trace
from shadowcore.workloads.trace import Trace, TraceError, TraceRequest

__all__ = ["BURSTGPT_COLUMNS", "load_burstgpt"]

BURSTGPT_COLUMNS: tuple[str, ...] = (
    "Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")


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
    with open_trace(p) as fh:
        for line, row, idx in csv_rows(p, fh, BURSTGPT_COLUMNS, "BurstGPT"):
            i_ts = idx["Timestamp"]
            text = row[i_ts].strip()
            ts = float(text) if DECIMAL.fullmatch(text) else math.nan
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
                counts.append(csv_count(row[i].strip(), p, line, i + 1, col))
            rows.append((counts[0], counts[1], row[idx["Model"]]))
    t0 = stamps[0]
    reqs = tuple(TraceRequest(ts - t0, pr, out, model=model)
                 for ts, (pr, out, model) in zip(stamps, rows, strict=True))
    return Trace(name or default_name(p), reqs)
