"""What a run reports: one :class:`CallRecord` per finished routed call and
the backend's :class:`ScenarioResult` (the policy, the calls, the summary
metrics), with the summary helpers the in-memory backends share.

Invariants: records are frozen values; a call that was rejected (longer than
a whole KV pool) has no record (the driver counts it under ``rejected``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs
import numpy as np


@attrs.frozen
class CallRecord:
    """One finished routed call: where it ran, when it arrived, its TTFT and
    end-to-end latency, its prompt and the prompt tokens served from cache."""

    session_id: str
    call_index: int
    model: str
    is_switch: bool
    arrival_s: float
    ttft_s: float
    latency_s: float
    num_prompt_tokens: int
    num_cached_tokens: int


@attrs.frozen
class ScenarioResult:
    """A backend's answer to ``run``: the policy's name, every finished
    routed call, the summary metrics, the warnings about the policy on these
    engines (``ShadowRuntime.notices``) and the warm-up (calls arriving
    earlier are not in the metrics)."""

    policy: str
    calls: tuple[CallRecord, ...]
    metrics: Mapping[str, float]
    notices: tuple[str, ...] = ()
    warmup_s: float = 0.0


def mean(values: Iterable[float]) -> float:
    """The mean, NaN for no values."""
    v = list(values)
    return float(np.mean(v)) if v else float("nan")


def hit_rate(calls: Iterable[CallRecord]) -> float:
    """Cached prompt tokens over prompt tokens, NaN for no prompt tokens."""
    calls = list(calls)
    total = sum(c.num_prompt_tokens for c in calls)
    return sum(c.num_cached_tokens for c in calls) / total if total else float("nan")
