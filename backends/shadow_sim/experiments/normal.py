"""Normal traffic for experiments: Poisson arrivals or a replayed trace, at a
load set relative to an instance's calibrated capacity (§5.1).

Request lengths come from a :class:`LengthSource`:

* ``azure-conv`` / ``azure-code`` -- EMBEDDED quantile tables (5% steps) of the
  prompt and output lengths of the Azure LLM inference traces 2023
  (conversation / code, capped at 8,192 and 1,024 tokens as in Appendix D.1).
  They are statistics of the traces, not the traces: prompts and outputs are
  drawn independently by log-linear interpolation between quantiles. This is
  what "Azure-conversation-like" means in the embedded default; it works offline
  without the trace files.
* a trace file (any format :func:`shadowcore.workloads.traces.load_trace`
  reads): (prompt, output) pairs are drawn jointly from its rows.

Arrivals (:class:`NormalTraffic`):

* ``poisson`` -- per instance, a Poisson process at ``rho * capacity * load``,
  where ``load`` is the window's request rate relative to the trace's peak window
  (1.0 for ``peak``; the embedded relative loads of the 2023 traces otherwise).
* ``trace`` -- replay of a trace file's ``window`` (peak, median or trough, by
  :meth:`Trace.windows`), time-scaled by the single factor that makes the PEAK
  window's rate ``rho * capacity``: the pool is provisioned for the peak hour and
  every window runs at its relative trace load (§5.1). A window shorter than the
  run is tiled (repeated end to end); instance ``k`` starts its copy at offset
  ``k / n`` of the window, so instances do not see identical bursts.

Caps: a trace file's prompts and outputs are capped at ``max_prompt_tokens`` /
``max_output_tokens`` (default 8,192 / 1,024 as in Appendix D.1; ``None``: no
cap), because the small models' windows are short. The caps are never silent:
:meth:`NormalTraffic.cap_report` counts the capped requests of the trace
(prompt and output separately), and ``simulate`` / ``sweep`` print the counts
under the table and store them in ``summary.json``. The embedded tables are
statistics of already-capped traces: other caps are an error there.

Prefix sharing (``prefix_sharing``, default on): a trace file whose requests
carry prefix-block hashes (Mooncake's ``hash_ids``) gives each normal request
its :class:`~shadowcore.workloads.prefix.PromptPrefix`, replayed or drawn by
Poisson alike, so requests with equal leading hashes share cached KV (and
compete with shadow KV for blocks); ``normal_hit_rate`` reports it. Off, or for
a source without hashes, every prompt is fresh (as before).

Invariants: arrivals are deterministic for (seed, instance index); no request is
dropped, and none is clamped beyond the caps above, which are reported.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import attrs
import numpy as np

from shadowcore._validators import positive
from shadowcore.errors import ConfigError
from shadowcore.workloads.prefix import PromptPrefix, trace_prefix
from shadowcore.workloads.traces import Trace, load_trace

MAX_PROMPT_TOKENS = 8192
MAX_OUTPUT_TOKENS = 1024
WINDOWS = ("peak", "median", "trough")

#: Quantiles 0, 0.05, ..., 1 of (prompt, output) tokens, capped at 8,192 / 1,024,
#: computed from the 2023 Azure traces (19,365 conversation and 8,818 code requests).
_QUANTILES: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "azure-conv": (
        (2, 181, 207, 372, 387, 396, 403, 414, 703, 984, 1020, 1045, 1071, 1097, 1130, 1189, 1315, 1876, 2734,
         4083, 8192),
        (7, 41, 54, 67, 77, 85, 91, 96, 103, 113, 129, 151, 177, 217, 384, 395, 400, 411, 424, 451, 1000),
    ),
    "azure-code": (
        (3, 75, 147, 232, 386, 578, 770, 939, 1075, 1261, 1469, 1690, 1909, 2164, 2433, 2744, 3192, 3920, 5188,
         7303, 7437),
        (6, 6, 7, 7, 8, 9, 9, 10, 11, 12, 13, 14, 16, 18, 20, 24, 29, 39, 55, 90, 1024),
    ),
}

#: Request rate of the median and trough 600 s windows relative to the peak one
#: (``Trace.windows(600, 30)`` on the 2023 traces).
_RELATIVE_LOAD: dict[str, dict[str, float]] = {
    "azure-conv": {"peak": 1.0, "median": 0.733, "trough": 0.553},
    "azure-code": {"peak": 1.0, "median": 0.705, "trough": 0.151},
}
EMBEDDED = tuple(_QUANTILES)
REPLAY_WINDOW_S = 600.0  # trace seconds per window (the 2023 traces span about 58 minutes)


def _check_window(_instance: object, attribute: attrs.Attribute, value: str) -> None:
    if value not in WINDOWS:
        raise ConfigError(attribute.name, value, f"unknown window (valid: {', '.join(WINDOWS)})")


def _check_bool(_instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(attribute.name, value, "must be true or false")


def _check_kind(_instance: object, attribute: attrs.Attribute, value: str) -> None:
    if value not in ("poisson", "trace"):
        raise ConfigError(attribute.name, value, "unknown normal-traffic kind (valid: poisson, trace)")


@functools.lru_cache(maxsize=8)
def _load(path: str) -> Trace:
    trace = load_trace(path)
    if len(trace) == 0:
        raise ConfigError("normal.source", path, "the trace holds no requests")
    return trace


@functools.lru_cache(maxsize=8)
def _capped(path: str, max_prompt: int | None = MAX_PROMPT_TOKENS,
            max_output: int | None = MAX_OUTPUT_TOKENS) -> tuple[Trace, int]:
    return _load(path).capped(max_prompt, max_output)


@functools.lru_cache(maxsize=8)
def _has_prefixes(path: str) -> bool:
    return any(r.hash_ids for r in _load(path).requests)


def _optional_cap(_instance: object, attribute: attrs.Attribute, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(attribute.name, value, "must be an integer >= 1, or null for no cap")


@attrs.frozen
class CapReport:
    """How many requests of a trace file the caps shortened (a request may count in both)."""

    source: str
    num_requests: int
    num_prompt_capped: int
    num_output_capped: int
    max_prompt_tokens: int | None
    max_output_tokens: int | None

    def line(self) -> str:
        def part(n: int, cap: int | None, what: str) -> str:
            if cap is None:
                return f"{what}s uncapped"
            return f"{n} {what}s > {cap} capped ({n / self.num_requests:.2%})"
        return (f"normal traffic {self.source}: {self.num_requests} requests; "
                f"{part(self.num_prompt_capped, self.max_prompt_tokens, 'prompt')}, "
                f"{part(self.num_output_capped, self.max_output_tokens, 'output')} "
                "(caps: normal.max_prompt_tokens / normal.max_output_tokens, null for none)")


@functools.lru_cache(maxsize=8)
def cap_report(path: str, max_prompt: int | None, max_output: int | None) -> CapReport:
    reqs = _load(path).requests
    return CapReport(path, len(reqs),
                     sum(max_prompt is not None and r.num_prompt_tokens > max_prompt for r in reqs),
                     sum(max_output is not None and r.num_output_tokens > max_output for r in reqs),
                     max_prompt, max_output)


@attrs.frozen
class LengthSource:
    """Where prompt/output lengths come from: an embedded table name or a trace path
    (with its caps; see the module docstring)."""

    source: str = "azure-conv"
    max_prompt_tokens: int | None = attrs.field(default=MAX_PROMPT_TOKENS, validator=_optional_cap)
    max_output_tokens: int | None = attrs.field(default=MAX_OUTPUT_TOKENS, validator=_optional_cap)

    def __attrs_post_init__(self) -> None:
        if self.source not in _QUANTILES and not self.is_file:
            raise ConfigError("normal.source", self.source,
                              f"neither an embedded length table ({', '.join(EMBEDDED)}) nor a trace file path")
        if self.is_file:
            self.capped()  # malformed rows stop here with file:line:column
        elif self.caps != (MAX_PROMPT_TOKENS, MAX_OUTPUT_TOKENS):
            raise ConfigError("max_prompt_tokens", self.caps,
                              f"the embedded table {self.source!r} is a statistic of traces capped at "
                              f"{MAX_PROMPT_TOKENS}/{MAX_OUTPUT_TOKENS}; other caps need a trace file")

    @property
    def caps(self) -> tuple[int | None, int | None]:
        return self.max_prompt_tokens, self.max_output_tokens

    def capped(self) -> Trace:
        return _capped(self.source, *self.caps)[0]

    @property
    def is_file(self) -> bool:
        return self.source not in _QUANTILES

    def draw(self, rng: np.random.Generator, n: int, *, prefixes: bool = False,
             ) -> tuple[np.ndarray, np.ndarray] | tuple[np.ndarray, np.ndarray, list[PromptPrefix | None]]:
        """``n`` (prompt, output) lengths as int64 arrays, each >= 1; with
        ``prefixes`` (a trace file), also each drawn request's prefix (the same
        draws: the lengths do not change)."""
        if self.is_file:
            reqs = self.capped().requests
            idx = rng.integers(len(reqs), size=n)
            p = np.fromiter((reqs[i].num_prompt_tokens for i in idx), np.int64, n)
            o = np.fromiter((reqs[i].num_output_tokens for i in idx), np.int64, n)
            if prefixes:
                return np.maximum(p, 1), np.maximum(o, 1), [trace_prefix(reqs[i]) for i in idx]
            return np.maximum(p, 1), np.maximum(o, 1)
        qp, qo = _QUANTILES[self.source]
        return _interp(qp, rng.random(n)), _interp(qo, rng.random(n))

    @property
    def has_prefixes(self) -> bool:
        """The trace file's requests carry prefix-block hashes (an embedded table: never)."""
        return self.is_file and _has_prefixes(self.source)

    def relative_load(self, window: str) -> float:
        """The window's request rate relative to the peak window."""
        if self.is_file:
            ws = _load(self.source).windows(REPLAY_WINDOW_S, 30.0)
            return ws[window].rate_per_s / ws["peak"].rate_per_s
        return _RELATIVE_LOAD[self.source][window]


def _interp(quantiles: Sequence[int], u: np.ndarray) -> np.ndarray:
    grid = np.linspace(0.0, 1.0, len(quantiles))
    x = np.exp(np.interp(u, grid, np.log(np.asarray(quantiles, dtype=np.float64))))
    return np.maximum(1, np.rint(x)).astype(np.int64)


@attrs.frozen
class NormalTraffic:
    """Normal traffic of every instance, relative to its capacity."""

    kind: str = attrs.field(default="poisson", validator=_check_kind)
    source: str = "azure-conv"
    rho: float = attrs.field(default=0.7, validator=positive)
    window: str = attrs.field(default="peak", validator=_check_window)
    max_prompt_tokens: int | None = attrs.field(default=MAX_PROMPT_TOKENS, validator=_optional_cap)
    max_output_tokens: int | None = attrs.field(default=MAX_OUTPUT_TOKENS, validator=_optional_cap)
    #: Requests of a trace with prefix-block hashes share their prefixes (module docstring).
    prefix_sharing: bool = attrs.field(default=True, validator=_check_bool)

    def __attrs_post_init__(self) -> None:
        lengths = self.lengths
        if self.kind == "trace" and not lengths.is_file:
            raise ConfigError("normal.source", self.source, "trace replay needs a trace file path")

    @property
    def lengths(self) -> LengthSource:
        return LengthSource(self.source, self.max_prompt_tokens, self.max_output_tokens)

    @property
    def shares_prefixes(self) -> bool:
        """Whether the requests carry prefixes: sharing on and a source with hashes."""
        return self.prefix_sharing and self.lengths.has_prefixes

    def cap_report(self) -> CapReport | None:
        """What the caps shortened in the trace file (None: an embedded table)."""
        if not self.lengths.is_file:
            return None
        return cap_report(self.source, self.max_prompt_tokens, self.max_output_tokens)

    def arrivals(self, capacity_per_s: float, end_s: float, seed: int, instance_index: int,
                 num_instances: int) -> list[tuple]:
        """(arrival_s, prompt, output) of one instance over ``[0, end_s)``, with
        a fourth item, the request's prefix, when :attr:`shares_prefixes`."""
        return self.peak_arrivals(self.rho * capacity_per_s, end_s, seed, instance_index, num_instances)

    def peak_arrivals(self, peak_rate_per_s: float, end_s: float, seed: int, instance_index: int,
                      num_instances: int, window: str | None = None) -> list[tuple]:
        """:meth:`arrivals` with the peak window's rate given (not ``rho`` x
        capacity) and optionally another ``window``: what calibration probes."""
        window = self.window if window is None else window
        rng = np.random.default_rng([seed, 2, instance_index])
        share = self.shares_prefixes
        if self.kind == "poisson":  # the peak window's load is 1 (a trace shorter than a window has no other)
            load = 1.0 if window == "peak" else self.lengths.relative_load(window)
            return poisson(rng, peak_rate_per_s * load, end_s, self.lengths, prefixes=share)
        return replay(self.source, window, peak_rate_per_s, end_s, instance_index, num_instances,
                      self.max_prompt_tokens, self.max_output_tokens, prefixes=share)

    def peak_window_requests(self) -> int:
        """Requests in the replayed trace's peak window (a replay's one pass of it)."""
        trace, _ = _capped(self.source, self.max_prompt_tokens, self.max_output_tokens)
        return len(trace.windows(min(REPLAY_WINDOW_S, trace.duration_s), 30.0)["peak"])


def poisson(rng: np.random.Generator, rate_per_s: float, end_s: float,
            lengths: LengthSource, *, prefixes: bool = False) -> list[tuple]:
    """Poisson arrivals over ``[0, end_s)`` with lengths from ``lengths``: (arrival,
    prompt, output), and with ``prefixes`` each drawn trace request's prefix too."""
    if rate_per_s <= 0:
        return []
    n_guess = int(rate_per_s * end_s + 6 * math.sqrt(rate_per_s * end_s) + 16)
    times = np.cumsum(rng.exponential(1.0 / rate_per_s, n_guess))
    while times[-1] < end_s:  # the guess is 6 sigma over the mean: practically never taken
        times = np.concatenate([times, times[-1] + np.cumsum(rng.exponential(1.0 / rate_per_s, n_guess))])
    times = times[times < end_s]
    if prefixes:
        p, o, pre = lengths.draw(rng, len(times), prefixes=True)
        return list(zip(times.tolist(), p.tolist(), o.tolist(), pre))  # float64 / int64 as Python floats / ints
    p, o = lengths.draw(rng, len(times))
    return list(zip(times.tolist(), p.tolist(), o.tolist()))


def replay(path: str, window: str, peak_rate_per_s: float, end_s: float, instance_index: int,
           num_instances: int, max_prompt: int | None = MAX_PROMPT_TOKENS,
           max_output: int | None = MAX_OUTPUT_TOKENS, *, prefixes: bool = False) -> list[tuple]:
    """The trace's ``window`` replayed as in the module docstring: (arrival,
    prompt, output), and with ``prefixes`` each request's prefix too."""
    trace, _ = _capped(path, max_prompt, max_output)
    windows = trace.windows(min(REPLAY_WINDOW_S, trace.duration_s), 30.0)
    factor = peak_rate_per_s / windows["peak"].rate_per_s
    w = windows[window].scaled(factor)
    span = w.duration_s
    if span <= 0 or len(w) == 0:
        return []
    times = w.arrivals_s
    offset = span * instance_index / max(1, num_instances)
    out: list[tuple] = []
    start = -offset
    while start < end_s:
        for t, r in zip(times, w.requests):
            at = start + float(t)
            if 0.0 <= at < end_s:
                out.append((at, r.num_prompt_tokens, r.num_output_tokens, trace_prefix(r)) if prefixes
                           else (at, r.num_prompt_tokens, r.num_output_tokens))
        start += span
    out.sort(key=lambda x: x[0])
    return out


def num_capped(path: str, max_prompt: int | None = MAX_PROMPT_TOKENS,
               max_output: int | None = MAX_OUTPUT_TOKENS) -> int:
    """How many requests of the trace file the caps shortened (prompt or output)."""
    return _capped(path, max_prompt, max_output)[1]
