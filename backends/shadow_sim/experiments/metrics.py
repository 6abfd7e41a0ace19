"""Metrics of a comparison (§5, issue 4 item 4), over MATCHED calls: the calls of
measured sessions (arriving after the warm-up) that complete under every
compared policy, identified by (session, call index).

Per run (one seed and window) and policy, :func:`run_metrics` gives absolute
values; :func:`relative_metrics` turns them into changes against the baseline
run of the same seed and window; :func:`aggregate` gives mean and +-1 standard
error (sample standard deviation / sqrt(n)) over the runs.

Definitions:

* latencies: mean time-to-last-token and TTFT of all matched calls and of the
  matched switch calls; LLM time per task: mean over measured sessions of the
  sum of their matched calls' latencies (tool time excluded, Appendix D.1);
* hit rates: cached input tokens / input tokens, over all and switch calls;
* routed token cost: per call, ``price_in * (uncached + 0.1 * cached) +
  price_out * output`` with :data:`PRICES` (USD per million tokens);
* normal SLO attainment: share of normal requests arriving in the measured
  window that met both SLOs (a change is in percentage points);
* normal hit rate: cached prompt tokens / prompt tokens of the normal requests
  arriving in the measured window (prefix sharing of a trace with block hashes;
  0 for fresh prompts);
* energy per good request: GPU energy of the run / (completed routed calls +
  normal requests that met their SLO);
* shadow tokens used (ONE definition, the engine's): tokens of shadow-computed
  KV blocks that a routed call or a normal request was served from -- a prefix
  hit on a shadow block in HBM or reloaded from the host tier, counted once per
  block when the hit promotes it (``KVClassManager.num_shadow_blocks_used`` x
  block size, summed over instances; every completed request, warm-up included);
* unused shadow share (the table's "unused shadow"): 1 - shadow tokens used /
  shadow tokens computed (NaN without shadow work). Its cross-check,
  ``switch_extra_cached_share``, is the extra cached tokens the policy's switch
  calls found over the baseline's (same calls, every completed session) / shadow
  tokens computed: what shadow work bought on switch calls. The two agree when
  only switch calls hit shadow blocks and the baseline's hits are the policy's
  too (tests/sim/test_session_replay.py reconciles them on a run); they differ by
  shadow blocks hit by other requests and by hits the baseline had and the
  policy lost to eviction;
* prefill throughput: (uncached routed prompt tokens + normal prompt tokens +
  shadow tokens) / the run's makespan;
* oracle gain captured: (baseline - policy) / (baseline - oracle) of the
  switch-call latency (and of the all-call latency), per run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import attrs
import numpy as np

CACHED_PRICE_FACTOR = 0.1

#: Illustrative list prices, USD per million tokens (input, output), of public
#: API providers for these open models (2025). The paper uses each benchmark's
#: own prices; these are ours, and only their ratios matter for reductions.
PRICES: dict[str, tuple[float, float]] = {
    "Qwen2.5-7B": (0.30, 0.30),
    "Llama-3.1-8B": (0.18, 0.18),
    "Mistral-7B": (0.20, 0.20),
    "Mistral-Nemo-12B": (0.30, 0.30),
    "Gemma-7B": (0.20, 0.20),
    "Gemma-2-9B": (0.30, 0.30),
    "Gemma-2-27B": (0.80, 0.80),
    "gpt-oss-20b": (0.05, 0.20),
    "gpt-oss-120b": (0.15, 0.60),
    "Granite-34B-code": (0.80, 0.80),
    "SWE-agent-LM-7B": (0.30, 0.30),
    "SWE-agent-LM-32B": (0.80, 0.80),
    "Mixtral-8x7B": (0.60, 0.60),
    "Llama-3.1-70B": (0.88, 0.88),
    "Llama-3.3-70B": (0.88, 0.88),
    "Qwen2.5-72B": (1.20, 1.20),
    "Qwen3-Next-80B-A3B": (0.15, 1.50),
    "Mixtral-8x22B": (1.20, 1.20),
    "DeepSeek-R1": (3.00, 7.00),
}


@attrs.frozen
class Call:
    """One completed routed call with what the metrics need."""

    session_id: str
    call_index: int
    model: str
    is_switch: bool
    ttft_s: float
    latency_s: float
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int


@attrs.frozen
class RunRecord:
    """What one (experiment, seed, window, policy) run leaves for the metrics."""

    policy: str
    seed: int
    window: str
    calls: tuple[Call, ...]
    measured_sessions: frozenset[str]
    normal_met: tuple[bool, ...]  # normal requests arriving in the measured window
    normal_prompt_tokens: int  # every normal request of the run
    shadow_tokens: float
    shadow_tokens_used: float
    energy_j: float
    energy_per_good_request_j: float
    makespan_s: float
    summary: Mapping[str, float] = attrs.field(factory=dict)
    notices: tuple[str, ...] = ()  # warnings about the policy on the run's engines (ScenarioResult.notices)


def price(model: str) -> tuple[float, float]:
    from shadow_sim.models import get_model

    return PRICES[get_model(model).name]


def call_cost(c: Call) -> float:
    p_in, p_out = price(c.model)
    uncached = c.num_prompt_tokens - c.num_cached_tokens
    return (p_in * (uncached + CACHED_PRICE_FACTOR * c.num_cached_tokens) + p_out * c.num_output_tokens) / 1e6


def matched_keys(runs: Sequence[RunRecord]) -> set[tuple[str, int]]:
    """(session, call index) of measured sessions completed under every run."""
    keys: set[tuple[str, int]] | None = None
    for r in runs:
        ks = {(c.session_id, c.call_index) for c in r.calls if c.session_id in r.measured_sessions}
        keys = ks if keys is None else keys & ks
    return keys or set()


def _mean(xs: Iterable[float]) -> float:
    v = list(xs)
    return float(np.mean(v)) if v else math.nan


def _ratio(calls: Sequence[Call]) -> float:
    total = sum(c.num_prompt_tokens for c in calls)
    return sum(c.num_cached_tokens for c in calls) / total if total else math.nan


def run_metrics(run: RunRecord, keys: set[tuple[str, int]]) -> dict[str, float]:
    """Absolute metrics of one run over the matched calls ``keys``."""
    calls = [c for c in run.calls if (c.session_id, c.call_index) in keys]
    switch = [c for c in calls if c.is_switch]
    per_task: dict[str, float] = {}
    for c in calls:
        per_task[c.session_id] = per_task.get(c.session_id, 0.0) + c.latency_s
    routed_prefill = sum(c.num_prompt_tokens - c.num_cached_tokens for c in run.calls)
    prefill = routed_prefill + run.normal_prompt_tokens + run.shadow_tokens
    return {
        "calls": float(len(calls)),
        "switch_calls": float(len(switch)),
        "call_latency_s": _mean(c.latency_s for c in calls),
        "switch_latency_s": _mean(c.latency_s for c in switch),
        "ttft_s": _mean(c.ttft_s for c in calls),
        "switch_ttft_s": _mean(c.ttft_s for c in switch),
        "task_time_s": _mean(per_task.values()),
        "hit_rate": _ratio(calls),
        "switch_hit_rate": _ratio(switch),
        "token_cost_usd": float(sum(call_cost(c) for c in calls)),
        "normal_slo_attainment": _mean(1.0 if m else 0.0 for m in run.normal_met),
        "normal_hit_rate": float(run.summary.get("normal_hit_rate", math.nan)),
        "energy_per_good_request_j": run.energy_per_good_request_j,
        "shadow_tokens": run.shadow_tokens,
        "shadow_tokens_used": run.shadow_tokens_used,
        "prefill_tokens_per_s": prefill / run.makespan_s if run.makespan_s > 0 else math.nan,
    }


#: Relative metrics: name -> (absolute metric, kind). "red": 1 - x / base (a
#: reduction, positive is better); "inc": x / base - 1; "pp": x - base.
RELATIVE: dict[str, tuple[str, str]] = {
    "call_latency_red": ("call_latency_s", "red"),
    "switch_latency_red": ("switch_latency_s", "red"),
    "ttft_red": ("ttft_s", "red"),
    "switch_ttft_red": ("switch_ttft_s", "red"),
    "task_time_red": ("task_time_s", "red"),
    "token_cost_red": ("token_cost_usd", "red"),
    "hit_rate_pp": ("hit_rate", "pp"),
    "switch_hit_rate_pp": ("switch_hit_rate", "pp"),
    "normal_slo_pp": ("normal_slo_attainment", "pp"),
    "energy_inc": ("energy_per_good_request_j", "inc"),
    "prefill_tput_inc": ("prefill_tokens_per_s", "inc"),
}


def _rel(x: float, base: float, kind: str) -> float:
    if math.isnan(x) or math.isnan(base):
        return math.nan
    if kind == "pp":
        return x - base
    if base == 0:
        return math.nan
    return 1.0 - x / base if kind == "red" else x / base - 1.0


def relative_metrics(m: Mapping[str, float], base: Mapping[str, float],
                     oracle: Mapping[str, float] | None) -> dict[str, float]:
    out = {name: _rel(m[key], base[key], kind) for name, (key, kind) in RELATIVE.items()}
    for name, key in (("oracle_gain_switch", "switch_latency_s"), ("oracle_gain_call", "call_latency_s")):
        gap = (base[key] - oracle[key]) if oracle is not None else math.nan
        out[name] = (base[key] - m[key]) / gap if gap and not math.isnan(gap) else math.nan
    return out


def compare_runs(runs: Sequence[RunRecord], baseline: str, oracle: str | None) -> dict[str, dict[str, float]]:
    """Per policy of one (seed, window): absolute and relative metrics over the calls matched across ``runs``."""
    keys = matched_keys(runs)
    absolute = {r.policy: run_metrics(r, keys) for r in runs}
    base_run = next(r for r in runs if r.policy == baseline)
    for r in runs:
        absolute[r.policy]["shadow_unused_share"] = (1.0 - r.shadow_tokens_used / r.shadow_tokens
                                                     if r.shadow_tokens else math.nan)
        absolute[r.policy]["switch_extra_cached_share"] = switch_extra_cached_share(r, base_run)
    base = absolute[baseline]
    ora = absolute.get(oracle) if oracle else None
    return {p: {**m, **relative_metrics(m, base, ora)} for p, m in absolute.items()}


def switch_extra_cached_share(run: RunRecord, base: RunRecord) -> float:
    """Extra cached tokens of ``run``'s switch calls over ``base``'s (same calls) / shadow tokens."""
    if not run.shadow_tokens:
        return math.nan
    cached = {(c.session_id, c.call_index): c.num_cached_tokens for c in base.calls if c.is_switch}
    extra = sum(max(0, c.num_cached_tokens - cached[(c.session_id, c.call_index)])
                for c in run.calls if c.is_switch and (c.session_id, c.call_index) in cached)
    return extra / run.shadow_tokens


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error (ddof=1) of the non-NaN values; SE is NaN for fewer than two."""
    v = np.asarray([x for x in values if not math.isnan(x)], dtype=np.float64)
    if len(v) == 0:
        return math.nan, math.nan
    se = float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else math.nan
    return float(v.mean()), se


def aggregate(per_run: Sequence[Mapping[str, Mapping[str, float]]]) -> dict[str, dict[str, tuple[float, float]]]:
    """Policy -> metric -> (mean, SE) over runs (each a :func:`compare_runs` result)."""
    out: dict[str, dict[str, tuple[float, float]]] = {}
    policies = list(per_run[0]) if per_run else []
    for p in policies:
        names = per_run[0][p].keys()
        out[p] = {k: mean_se([r[p][k] for r in per_run]) for k in names}
    return out
