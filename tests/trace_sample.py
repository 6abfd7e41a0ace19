"""A small Azure-2023-format trace sample the project writes itself.

The real Azure LLM inference traces 2023 live outside the repository
(``../shared/traces/azure-llm-2023``, see :func:`conftest.shared_traces`); what
must always run is tested on this sample instead. It is not a copy of the traces:
prompt and output lengths are drawn from the EMBEDDED quantile tables
(:class:`shadow_sim.experiments.normal.LengthSource`, statistics of the traces) and
arrivals from a Poisson process whose rate swings over the span, so peak, median
and trough windows differ as they do in real traffic.

The file keeps the published files' quirks that the loader must handle: a
``TIMESTAMP,ContextTokens,GeneratedTokens`` header, 7 fraction digits, CRLF line
ends and no newline after the last row.

Invariants: the bytes are a pure function of (kind, rows, seed); the committed
files under ``tests/data/azure-sample/`` are exactly what :func:`write_sample`
writes (a test checks it). Rewrite them with ``python tests/trace_sample.py``.
"""

from __future__ import annotations

import sys
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np

SAMPLE_DIR = Path(__file__).resolve().parent / "data" / "azure-sample"
#: (embedded length table, rows, seed) per sample file.
SAMPLES: dict[str, tuple[str, int, int]] = {
    "code": ("azure-code", 300, 2023),
    "conv": ("azure-conv", 400, 2024),
}
SPAN_S = 1800.0  # 30 minutes: long enough for 600 s windows, shorter than an hour
START = datetime(2026, 1, 1, 9, 0, 0)
TICK_NS = 100  # 7 fraction digits


def sample_path(which: str) -> Path:
    return SAMPLE_DIR / f"AzureLLMInferenceTrace_{which}_sample.csv"


def _arrivals_ns(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` sorted arrival offsets (ns, multiples of 100) of a Poisson process with
    rate proportional to ``1 + 0.6 sin(2 pi t / span)`` over :data:`SPAN_S`
    (order statistics of uniform draws mapped through the inverse cumulative rate)."""
    grid = np.linspace(0.0, SPAN_S, 4097)
    rate = 1.0 + 0.6 * np.sin(2 * np.pi * grid / SPAN_S)
    cum = np.concatenate([[0.0], np.cumsum((rate[1:] + rate[:-1]) / 2 * np.diff(grid))])
    u = np.sort(rng.random(n)) * cum[-1]
    t_s = np.interp(u, cum, grid)
    return np.rint(t_s * 1e9 / TICK_NS).astype(np.int64) * TICK_NS


def sample_text(which: str) -> bytes:
    from shadow_sim.experiments.normal import LengthSource

    table, rows, seed = SAMPLES[which]
    rng = np.random.default_rng(seed)
    offsets = _arrivals_ns(rng, rows)
    prompts, outputs = LengthSource(table).draw(rng, rows)
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for ns, p, o in zip(offsets.tolist(), prompts.tolist(), outputs.tolist(), strict=True):
        stamp = START + timedelta(microseconds=ns // 1000)
        lines.append(f"{stamp:%Y-%m-%d %H:%M:%S}.{stamp.microsecond:06d}{(ns % 1000) // TICK_NS},{p},{o}")
    return "\r\n".join(lines).encode("ascii")  # no newline after the last row, as published


def write_sample(which: str, directory: Path = SAMPLE_DIR) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / sample_path(which).name
    path.write_bytes(sample_text(which))
    return path


if __name__ == "__main__":
    for w in SAMPLES:
        print(write_sample(w), file=sys.stderr)
