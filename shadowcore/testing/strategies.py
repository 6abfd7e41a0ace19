"""Hypothesis strategies over the core types, for plugin authors' property tests.

Needs hypothesis (the ``dev`` extra); :mod:`shadowcore` itself never imports
this module. Every strategy builds valid values only (the core's validators
accept them) and shrinks towards small, simple ones.

Times are drawn on a grid of ``TIME_QUANTUM_S`` wherever an exact comparison
matters (cold ages, idle times), so that boundaries such as "idle for exactly
``cold_age_s``" are actually reached; latency coefficients and SLOs are
arbitrary non-negative floats of realistic magnitude.

Main entry points:

* :func:`request_views`, :func:`batches`, :func:`snapshots` -- what an engine
  shows the hook (options force waiting/blocked/idle/routed batches);
* :func:`batch_shapes`, :func:`latency_models` -- the latency model's inputs
  and :class:`~shadowcore.latency.LinearLatencyModel` instances;
* :func:`kv_policies`, :func:`host_tier_params`, :func:`hash_chains` -- the KV
  classes;
* :func:`slack_controllers`, :func:`switch_predictors`, :func:`targetings`,
  :func:`ranked_targets` -- the strategy objects shipped with the core;
* :func:`step_outcomes` -- an engine's report for a given plan.

The composite strategies ``request_views``, ``batches``, ``snapshots``,
``hash_chains`` and ``step_outcomes`` wrap plain functions ``draw_*(draw,
...)`` with the same arguments; state machines call those with ``data.draw``
(much faster than building a new strategy object per step).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from hypothesis import strategies as st

from shadowcore.kv import EVICTION_ORDERS, HostTierParams, KVClassPolicy
from shadowcore.latency import BatchShape, LinearLatencyModel, PrefillChunk
from shadowcore.slack import (
    EagerController,
    HarvestController,
    NoShadowController,
    PrefillInstanceController,
    SlackController,
    SloSlackController,
)
from shadowcore.switch import (
    AllOthers,
    EmpiricalSwitchPredictor,
    FixedSwitchPredictor,
    NoTargets,
    ProbabilityGate,
    SwitchPredictor,
    Target,
    Targeting,
    TopK,
    rank_targets,
)
from shadowcore.types import (
    ChunkResult,
    JobKey,
    Phase,
    RequestKind,
    RequestView,
    ShadowGrant,
    StepOutcome,
    StepPlan,
    StepSnapshot,
)

#: Grid of times where exact equality matters (binary fraction: exact in floats).
TIME_QUANTUM_S = 0.5

Draw = Callable[[st.SearchStrategy[Any]], Any]


def grid_times(max_s: float = 20.0) -> st.SearchStrategy[float]:
    """Non-negative times on the ``TIME_QUANTUM_S`` grid (exact in floats)."""
    return st.integers(0, int(max_s / TIME_QUANTUM_S)).map(lambda i: i * TIME_QUANTUM_S)


def _coefficient(max_value: float) -> st.SearchStrategy[float]:
    """A non-negative coefficient: exactly 0 one time in five, otherwise in
    ``[max_value / 50, max_value]``."""
    return st.tuples(st.integers(0, 4), st.floats(max_value / 50, max_value)).map(
        lambda t: 0.0 if t[0] == 0 else t[1]
    )


_PROBABILITIES = st.one_of(st.sampled_from((0.0, 0.25, 0.5, 1.0)), st.floats(0.0, 1.0))
_KINDS = st.sampled_from(RequestKind)
_PHASES = st.sampled_from(Phase)
_CHOICES = st.sampled_from(("full", "full", "zero", "part", "ragged", "omit"))
_CHOICES_REPORTED = st.sampled_from(("full", "full", "zero", "part", "ragged"))


def probabilities() -> st.SearchStrategy[float]:
    """Probabilities in [0, 1], with the edges and ties common."""
    return _PROBABILITIES


# -- latency -----------------------------------------------------------------------
def prefill_chunks(max_tokens: int = 4096) -> st.SearchStrategy[PrefillChunk]:
    return st.builds(PrefillChunk, st.integers(0, max_tokens), st.integers(0, 8 * max_tokens))


def batch_shapes(max_prefills: int = 4, max_decodes: int = 16) -> st.SearchStrategy[BatchShape]:
    """Arbitrary batches (possibly empty) as a latency model sees them."""
    return st.builds(
        BatchShape,
        st.lists(prefill_chunks(), max_size=max_prefills).map(tuple),
        st.lists(st.integers(0, 32768), max_size=max_decodes).map(tuple),
    )


def latency_models() -> st.SearchStrategy[LinearLatencyModel]:
    """:class:`LinearLatencyModel` with random non-negative coefficients (of the
    magnitude of the defaults, up to a few times them; zeros included)."""
    return st.builds(
        LinearLatencyModel,
        overhead_s=_coefficient(0.01),
        prefill_s_per_token=_coefficient(1.5e-4),
        attention_s_per_token_pair=_coefficient(1e-8),
        decode_s_per_seq=_coefficient(1e-3),
        decode_s_per_context_token=_coefficient(2e-7),
    )


# -- snapshots -----------------------------------------------------------------------
# Each ``draw_*`` function takes hypothesis' ``draw`` (``data.draw`` in a state
# machine) and draws only from cached primitive strategies; the composite
# strategies below wrap them. State machines call the functions directly:
# building a fresh composite strategy per step costs more than the step.
def draw_request_view(
    draw: Draw,
    now_s: float | None = None,
    *,
    kind: RequestKind | None = None,
    phase: Phase | None = None,
    tpot_slo_s: float | None = None,
    request_id: str | None = None,
) -> RequestView:
    """One request of a batch, consistent with ``now_s``: arrival <= first
    token <= now. Decodes are drawn around their SLO pace (most on track, some
    behind), prefills around their TTFT deadline, so Eq. 1 slack is sometimes
    positive, sometimes negative."""
    if now_s is None:
        now_s = draw(st.floats(0.0, 1000.0))
    kind = draw(_KINDS) if kind is None else kind
    phase = draw(_PHASES) if phase is None else phase
    tpot = draw(st.floats(0.005, 0.2)) if tpot_slo_s is None else tpot_slo_s
    ttft = draw(st.floats(0.05, 2.0))
    rid = request_id if request_id is not None else f"r{draw(st.integers(0, 10**6))}"
    context = draw(st.integers(0, 32768))
    if phase is Phase.DECODE:
        steps = draw(st.integers(0, 12))
        if steps == 12:
            steps = draw(st.integers(12, 500))
        # fraction of the SLO pace used so far; near (1 - margin) the slack is tight
        pace = draw(st.floats(0.0, 1.3)) if draw(st.booleans()) else draw(st.floats(0.75, 1.0))
        since_first = min(now_s, pace * tpot * (steps + 1))
        first = now_s - since_first
        arrival = max(0.0, first - draw(st.floats(0.0, ttft)))
        return RequestView(
            rid, kind, phase, arrival, 1, context, ttft, tpot,
            num_remaining_prefill_tokens=0, first_token_s=first, num_decode_steps=steps,
        )
    waited = min(now_s, (draw(st.floats(0.0, 1.2)) if draw(st.booleans()) else draw(st.floats(0.75, 1.0))) * ttft)
    return RequestView(
        rid, kind, phase, now_s - waited, draw(st.integers(0, 4096)), context, ttft, tpot,
        num_remaining_prefill_tokens=draw(st.integers(0, 16384)),
    )


def draw_batch(
    draw: Draw,
    now_s: float,
    *,
    min_size: int = 0,
    max_size: int = 8,
    has_routed: bool | None = None,
    tpot_slo_s: float | None = None,
    phases: Sequence[Phase] | None = None,
) -> tuple[RequestView, ...]:
    """A batch of distinct requests. ``has_routed`` forces (True) or forbids
    (False) a routed call in it; ``phases`` restricts the phases drawn."""
    if has_routed:
        min_size = max(min_size, 1)
    n = draw(st.integers(min_size, max(min_size, max_size)))
    phase_st = st.sampled_from(tuple(phases)) if phases else _PHASES
    routed_at = draw(st.integers(0, n - 1)) if has_routed else -1  # the routed call need not be first
    out = []
    for i in range(n):
        kind = RequestKind.NORMAL if has_routed is False else None
        if i == routed_at:
            kind = RequestKind.ROUTED
        out.append(draw_request_view(draw, now_s, kind=kind, phase=draw(phase_st), tpot_slo_s=tpot_slo_s,
                                     request_id=f"r{i}"))
    return tuple(out)


def draw_snapshot(
    draw: Draw,
    *,
    instance_id: str = "i0",
    iteration: int | None = None,
    now_s: float | None = None,
    tpot_slo_s: float | None = None,
    waiting: bool | None = None,
    blocked: bool | None = None,
    idle: bool | None = None,
    has_routed: bool | None = None,
    decode_only: bool | None = None,
    max_batch: int = 8,
    max_free_token_budget: int = 8192,
    max_shadow_room_tokens: int = 16384,
    request_tpot_is_instance_tpot: bool | None = None,
) -> StepSnapshot:
    """A :class:`StepSnapshot` with an arbitrary batch.

    Options (``None``: drawn): ``waiting`` forces a non-empty (True) or empty
    (False) waiting queue; ``blocked`` an admission blocked by memory;
    ``idle`` an empty batch (True) or a non-empty one (False); ``has_routed``
    a routed call in the batch (True) or none (False); ``decode_only`` a batch
    of decodes only (True). Requests use the instance's TPOT SLO when
    ``request_tpot_is_instance_tpot`` (default: drawn).
    """
    iteration = draw(st.integers(0, 10**6)) if iteration is None else iteration
    now_s = draw(st.floats(0.0, 1000.0)) if now_s is None else now_s
    tpot = draw(st.floats(0.01, 0.2)) if tpot_slo_s is None else tpot_slo_s
    if idle is None:
        idle = False if (has_routed or decode_only) else draw(st.booleans())
    if idle and (has_routed or decode_only):
        raise ValueError("an idle snapshot has no routed call and no decode")
    same_tpot = draw(st.booleans()) if request_tpot_is_instance_tpot is None else request_tpot_is_instance_tpot
    if idle:
        batch: tuple[RequestView, ...] = ()
    else:
        batch = draw_batch(
            draw, now_s, min_size=1, max_size=max_batch, has_routed=has_routed,
            tpot_slo_s=tpot if same_tpot else None, phases=(Phase.DECODE,) if decode_only else None,
        )
    if waiting is None:
        waiting = draw(st.integers(0, 3)) == 0  # drawn: one snapshot in four has a queue
    num_waiting = draw(st.integers(1, 16)) if waiting else 0
    adm_blocked = draw(st.integers(0, 4)) == 0 if blocked is None else blocked
    return StepSnapshot(
        instance_id, iteration, now_s, batch, num_waiting, adm_blocked, tpot,
        draw(st.integers(0, max_free_token_budget)), draw(st.integers(0, max_shadow_room_tokens)),
    )


request_views = st.composite(draw_request_view)
request_views.__doc__ = draw_request_view.__doc__
batches = st.composite(draw_batch)
batches.__doc__ = draw_batch.__doc__
snapshots = st.composite(draw_snapshot)
snapshots.__doc__ = draw_snapshot.__doc__


# -- KV ---------------------------------------------------------------------------------
def host_tier_params(block_bytes: float | None = None, max_blocks: int = 8) -> st.SearchStrategy[HostTierParams]:
    """A host tier. With ``block_bytes`` its capacity is a small number of
    blocks (0..``max_blocks``, plus a fraction of one) so that it fills up."""
    pcie = st.floats(1e6, 1e11)
    if block_bytes is None:
        return st.builds(HostTierParams, st.floats(0.0, 64e9), pcie)
    return st.builds(
        HostTierParams,
        st.tuples(st.integers(0, max_blocks), st.floats(0.0, 0.99)).map(lambda t: (t[0] + t[1]) * block_bytes),
        pcie,
    )


def kv_policies(
    *, host: bool | None = None, block_bytes: float | None = None, max_cold_age_s: float = 4.0
) -> st.SearchStrategy[KVClassPolicy]:
    """:class:`KVClassPolicy` with any cap fraction in (0, 1], a cold age on the
    time grid, a host tier when ``host`` (None: sometimes) and either eviction
    order."""
    cap = st.one_of(st.sampled_from([0.1, 0.25, 0.5, 1.0]), st.floats(0.01, 1.0))
    tier = (
        st.none() if host is False
        else host_tier_params(block_bytes) if host
        else st.one_of(st.none(), host_tier_params(block_bytes))
    )
    return st.builds(KVClassPolicy, cap, grid_times(max_cold_age_s), tier, st.sampled_from(EVICTION_ORDERS))


def draw_hash_chain(draw: Draw, known: Sequence[Sequence[int]] = (), *, next_hash: int = 1,
                    max_new: int = 6) -> list[int]:
    """A block-hash chain: usually a prefix of a ``known`` chain (often all of
    it) followed by fresh hashes ``next_hash, next_hash+1, ...``. As with real
    chained hashes, a hash always follows the same prefix."""
    prefix: list[int] = []
    if known and draw(st.integers(0, 2)) > 0:
        base = known[draw(st.integers(0, len(known) - 1))]
        cut = len(base) if draw(st.booleans()) else draw(st.integers(0, len(base)))
        prefix = list(base[:cut])
    n_new = draw(st.integers(0 if prefix else 1, max_new))
    return prefix + list(range(next_hash, next_hash + n_new))


hash_chains = st.composite(draw_hash_chain)
hash_chains.__doc__ = draw_hash_chain.__doc__


# -- strategies shipped with the core ----------------------------------------------------
def slack_controllers(*, include_eager: bool = True, include_disabled: bool = True,
                      n_min: st.SearchStrategy[int] | None = None) -> st.SearchStrategy[SlackController]:
    """Fresh instances of the shipped controllers with random parameters."""
    n_min = st.sampled_from([0, 1, 16, 64, 256]) if n_min is None else n_min
    beta = st.floats(0.05, 1.0)
    options = [
        st.builds(SloSlackController, beta=beta, delta=st.floats(0.0, 0.5), n_min=n_min,
                  margin=st.floats(0.0, 0.5), chunk_tokens=st.integers(16, 4096)),
        st.builds(HarvestController, beta=beta, delta=st.floats(0.0, 0.5), n_min=n_min),
        st.builds(PrefillInstanceController, max_iteration_s=st.floats(0.005, 0.2),
                  margin=st.floats(0.0, 0.5), n_min=n_min, chunk_tokens=st.integers(16, 4096)),
    ]
    if include_eager:
        options.append(st.builds(EagerController, n_min=n_min))
    if include_disabled:
        options.append(st.just(None).map(lambda _: NoShadowController()))
    return st.one_of(*options)


def switch_predictors() -> st.SearchStrategy[SwitchPredictor]:
    """Fresh instances of the shipped predictors with random parameters."""
    return st.one_of(
        st.builds(EmpiricalSwitchPredictor, pseudo_count=st.sampled_from([0.0, 1.0]) | st.floats(0.0, 10.0)),
        st.builds(FixedSwitchPredictor, probabilities()),
    )


def targetings(max_k: int = 4) -> st.SearchStrategy[Targeting]:
    return st.one_of(
        st.just(AllOthers()), st.just(NoTargets()),
        st.builds(TopK, st.integers(1, max_k)), st.builds(ProbabilityGate, probabilities()),
    )


@st.composite
def ranked_targets(draw, max_models: int = 6) -> list[Target]:
    """Candidates as :func:`~shadowcore.switch.rank_targets` returns them (ties likely)."""
    models = draw(st.lists(st.sampled_from("ABCDEFGH"), unique=True, max_size=max_models))
    weights = [draw(st.sampled_from([0.0, 0.5, 1.0, 2.0]) | st.floats(0.0, 10.0)) for _ in models]
    total = sum(weights)
    dist = {m: (w / total if total > 0 else 1.0 / len(models)) for m, w in zip(models, weights)}
    return rank_targets(draw(probabilities()), dist)


def job_keys(max_sessions: int = 8, models: Sequence[str] = ("A", "B", "C")) -> st.SearchStrategy[JobKey]:
    return st.builds(JobKey, st.integers(0, max_sessions).map(lambda i: f"s{i}"), st.sampled_from(list(models)))


@st.composite
def shadow_grants(draw, block_size: int = 16) -> ShadowGrant:
    return ShadowGrant(
        draw(job_keys()), draw(st.integers(0, 3)), block_size * draw(st.integers(0, 64)),
        block_size * draw(st.integers(1, 16)), draw(probabilities()),
    )


def draw_step_outcome(
    draw: Draw, plan: StepPlan, *, block_size: int = 1, duration_s: float | None = None, allow_omitted: bool = True
) -> StepOutcome:
    """An engine's report for ``plan``: each grant computed in full, dropped
    (0), cut to a whole number of blocks, cut anywhere, or (``allow_omitted``)
    not reported at all. ``duration_s`` defaults to the plan's prediction
    times a factor in [0.5, 2]."""
    results = []
    for g in plan.grants:
        choice = draw(_CHOICES if allow_omitted else _CHOICES_REPORTED)
        if choice == "omit":
            continue
        if choice == "full":
            n = g.num_tokens
        elif choice == "zero":
            n = 0
        elif choice == "part":
            n = block_size * draw(st.integers(0, g.num_tokens // block_size))
        else:
            n = draw(st.integers(0, g.num_tokens))
        results.append(ChunkResult(g, n))
    if duration_s is None:
        duration_s = plan.predicted_s * draw(st.floats(0.5, 2.0))
    if not math.isfinite(duration_s) or duration_s < 0:
        duration_s = 0.0
    return StepOutcome(plan.instance_id, plan.iteration, duration_s, tuple(results))


step_outcomes = st.composite(draw_step_outcome)
step_outcomes.__doc__ = draw_step_outcome.__doc__


__all__ = [
    "TIME_QUANTUM_S", "batch_shapes", "batches", "draw_batch", "draw_hash_chain", "draw_request_view",
    "draw_snapshot", "draw_step_outcome", "grid_times", "hash_chains", "host_tier_params", "job_keys",
    "kv_policies", "latency_models", "prefill_chunks", "probabilities", "ranked_targets", "request_views",
    "shadow_grants", "slack_controllers", "snapshots", "step_outcomes", "targetings",
]
