"""Azure LLM inference trace CSV (AzurePublicDataset 2023 and 2024 releases):
``TIMESTAMP,ContextTokens,GeneratedTokens``.

Invariants: timestamps keep all their fraction digits (integer nanoseconds);
rows stay in file order, and a decreasing timestamp is an error, not a sort.
"""

from __future__ import annotations

import os

from shadowcore.workloads.reading import Clock, csv_count, csv_rows, default_name, open_trace
from shadowcore.workloads.trace import Trace, TraceError, TraceRequest

__all__ = ["AZURE_COLUMNS", "load_azure"]

AZURE_COLUMNS: tuple[str, ...] = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


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
    clock = Clock()
    stamps: list[int] = []
    prompts: list[int] = []
    outputs: list[int] = []
    with open_trace(p) as fh:
        for line, row, idx in csv_rows(p, fh, AZURE_COLUMNS, "Azure LLM inference"):
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
            prompts.append(csv_count(row[i], p, line, i + 1, "ContextTokens"))
            i = idx["GeneratedTokens"]
            outputs.append(csv_count(row[i], p, line, i + 1, "GeneratedTokens"))
    t0 = stamps[0]
    reqs = tuple(TraceRequest((ns - t0) / 1e9, pr, out)
                 for ns, pr, out in zip(stamps, prompts, outputs, strict=True))
    return Trace(name or default_name(p), reqs)
