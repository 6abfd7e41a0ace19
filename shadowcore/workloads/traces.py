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

Layout: the values live in :mod:`~shadowcore.workloads.trace`, one module per format
(:mod:`~shadowcore.workloads.azure`, :mod:`~shadowcore.workloads.burstgpt`,
:mod:`~shadowcore.workloads.mooncake`, :mod:`~shadowcore.workloads.copilot`), what
they share in :mod:`~shadowcore.workloads.reading`; this module picks the format
and re-exports the public names (import from here or from ``shadowcore.workloads``).
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable

from shadowcore.errors import ConfigError
from shadowcore.workloads.azure import AZURE_COLUMNS, load_azure
from shadowcore.workloads.burstgpt import BURSTGPT_COLUMNS, load_burstgpt
from shadowcore.workloads.copilot import load_copilot
from shadowcore.workloads.mooncake import MOONCAKE_BLOCK_TOKENS, load_mooncake
from shadowcore.workloads.reading import first_nonblank, open_trace
from shadowcore.workloads.trace import Trace, TraceError, TraceRequest

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
    with open_trace(path) as fh:
        first = first_nonblank(fh)
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
