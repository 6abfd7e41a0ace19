"""Mooncake trace JSON Lines (https://github.com/kvcache-ai/Mooncake,
``FAST25-release/traces``): ``timestamp`` (ms), ``input_length``,
``output_length``, ``hash_ids``.

Invariants: records stay in file order (a decreasing timestamp is an error);
``hash_ids`` are kept as they are, not checked against the prompt length. They
are what normal traffic shares: :func:`shadowcore.workloads.prefix.trace_prefix`
turns them into a request's prompt prefix (equal leading ids, shared KV).
"""

from __future__ import annotations

import math
import os

from shadowcore.workloads.reading import count_field, default_name, json_field, jsonl_records, open_trace
from shadowcore.workloads.trace import MOONCAKE_BLOCK_TOKENS, Trace, TraceError, TraceRequest

__all__ = ["MOONCAKE_BLOCK_TOKENS", "load_mooncake"]


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
    with open_trace(p) as fh:
        for line, rec in jsonl_records(p, fh):
            ts, where = json_field(p, line, "", rec, "timestamp")
            if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
                raise TraceError(p, line, where, ts, "timestamp: not a number of milliseconds")
            if stamps and ts < stamps[-1]:
                raise TraceError(p, line, where, ts,
                                 "timestamp decreases: earlier than the previous record")
            prompt = count_field(p, line, "", rec, "input_length")
            output = count_field(p, line, "", rec, "output_length")
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
    return Trace(name or default_name(p), reqs)
