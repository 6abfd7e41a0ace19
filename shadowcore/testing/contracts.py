"""The contract a policy's strategies keep, written as plain checks that
return what is wrong (an empty list when nothing is). Each rule has one owner
here; the conformance check (:mod:`shadowcore.testing.conformance`), the
state machines (:mod:`shadowcore.testing.machines`) and a plugin author's own
tests all apply these functions.

Needs only the core (no hypothesis).

Rules, per value checked:

* A plan (:func:`plan_problems`), made from a controller's budget for one
  snapshot:

  - ``gate``: no budget and no shadow token while ``num_waiting > 0`` or
    ``admission_blocked`` (Algorithm 1 line 1);
  - ``bounded`` (strict): the budget is at most the iteration's TPOT SLO ``T``
    (the paper's ``beta * T`` with ``beta <= 1``);
  - ``slo`` (strict): a budget that bounds the whole iteration leaves, on a
    busy batch with shadow tokens, every request within its slack: a decode's
    ``T_r (k_r + 1) - (t - f_r)`` (Eq. 1 at margin 0), a prefill's
    ``F_r - (t - a_r)`` (no chunks left counted): looser than any margin, so
    any SLO-aware controller passes it;
  - ``fit``: the predicted iteration (the stretch, for ``bounds_stretch``
    budgets) is within the budget;
  - ``room``: shadow tokens <= min(free token budget, shadow KV room);
  - ``order``: grants in non-increasing switch probability; in a plan made
    ``imminent_first``, imminent grants first, then the others, each group
    in non-increasing switch probability;
  - ``blocks``: grants of whole blocks.

  A ``normal_priority`` plan (Eager) is exempt from ``gate``, ``bounded``
  and ``slo``: it is normal work by definition.
* A KV pool after an iteration (:func:`kv_problems`): shadow blocks at most
  the *declared* cap, ``int(shadow_cap_fraction * num_blocks)`` (not the
  pool's own ``cap_blocks``, which a policy's class rules compute); the host
  tier within its capacity.
* A switch predictor's answers (:func:`predictor_problems`): a switch
  probability in [0, 1]; a next-model distribution over the models other
  than the current one only, each entry in [0, 1], summing to 1 (within
  ``1e-6``) whenever there is another model.
* A targeting's choice (:func:`targeting_problems`): a subsequence of the
  ranked list it was given -- every target one of the ranked ones (same model,
  same probability), in the ranked order, no model twice.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from shadowcore.latency import BatchShape, LatencyModel, PrefillChunk
from shadowcore.switch import Target
from shadowcore.types import Phase, StepPlan, StepSnapshot

#: Absolute tolerance (seconds) of every time comparison.
EPS_S = 1e-9
#: Absolute tolerance of a distribution's sum.
EPS_SUM = 1e-6


def decode_slack_reference_s(r: Any, now_s: float, margin: float) -> float:
    """Eq. 1, written out independently of :mod:`shadowcore.slack`."""
    k, f, t_r = r.num_decode_steps, r.first_token_s, r.tpot_slo_s
    return (1.0 - margin) * t_r * (k + 1) - (now_s - f)


def prefill_slack_reference_s(r: Any, now_s: float, margin: float, latency: LatencyModel, chunk: int) -> float:
    """``(1-m) F_r - (t - a_r) - p_r`` with ``p_r`` the remaining chunks run alone."""
    rest, ctx, p = r.num_remaining_prefill_tokens, r.num_context_tokens + r.num_scheduled_tokens, 0.0
    while rest > 0:
        n = min(chunk, rest)
        p += latency.predict_s(BatchShape((PrefillChunk(n, ctx),)))
        ctx, rest = ctx + n, rest - n
    return (1.0 - margin) * r.ttft_slo_s - (now_s - r.arrival_s) - p


def loosest_slack_s(snapshot: StepSnapshot) -> float:
    """The ``slo`` rule's bound: the smallest per-request slack of the batch
    at margin 0, prefills counted without their remaining chunks (``inf`` for
    an empty batch)."""
    out = math.inf
    for r in snapshot.batch:
        if r.phase is Phase.DECODE:
            out = min(out, decode_slack_reference_s(r, snapshot.now_s, 0.0))
        else:
            out = min(out, r.ttft_slo_s - (snapshot.now_s - r.arrival_s))
    return out


def plan_problems(snapshot: StepSnapshot, plan: StepPlan, block_size: int | None = None,
                  strict: bool = False) -> list[str]:
    """What ``plan`` (for ``snapshot``) breaks of the plan rules; ``strict``
    adds ``bounded`` and ``slo``; ``block_size`` (when known) ``blocks``."""
    out: list[str] = []
    budget = plan.budget
    exempt = plan.normal_priority
    gated = snapshot.num_waiting > 0 or snapshot.admission_blocked
    why = f"{snapshot.num_waiting} waiting, admission_blocked={snapshot.admission_blocked}"
    if gated and not exempt and budget.budget_s > 0:
        out.append(f"gate: budget {budget.budget_s:.6f}s ({budget.reason.value}) with {why}")
    if gated and not exempt and plan.grants:
        out.append(f"gate: {plan.num_shadow_tokens} shadow tokens planned with {why}")
    if strict and not exempt and budget.budget_s > snapshot.tpot_slo_s + EPS_S:
        out.append(
            f"bounded: budget {budget.budget_s:.6f}s ({budget.reason.value}) > the TPOT SLO "
            f"T = {snapshot.tpot_slo_s:.6f}s"
        )
    if not plan.grants:
        return out
    used = plan.predicted_stretch_s if budget.bounds_stretch else plan.predicted_s
    if used > budget.budget_s + EPS_S:
        out.append(f"fit: predicted {used:.6f}s exceeds budget {budget.budget_s:.6f}s")
    if strict and not exempt and not budget.bounds_stretch and snapshot.batch:
        slack = loosest_slack_s(snapshot)
        if plan.predicted_s > slack + EPS_S:
            out.append(
                f"slo: iteration predicted {plan.predicted_s:.6f}s with {plan.num_shadow_tokens} shadow tokens "
                f"exceeds the batch's slack {slack:.6f}s ({budget.reason.value} budget {budget.budget_s:.6f}s)"
            )
    limit = min(snapshot.num_free_token_budget, snapshot.num_shadow_room_tokens)
    if plan.num_shadow_tokens > limit:
        out.append(
            f"room: {plan.num_shadow_tokens} shadow tokens > min(token budget "
            f"{snapshot.num_free_token_budget}, shadow KV room {snapshot.num_shadow_room_tokens})"
        )
    keys = [(plan.imminent_first and g.imminent, g.switch_probability) for g in plan.grants]
    if any(a < b for a, b in itertools.pairwise(keys)):
        shown = keys if plan.imminent_first else [p for _, p in keys]
        what = "(imminent, switch probability)" if plan.imminent_first else "switch probability"
        out.append(f"order: grants not in non-increasing {what}: {shown}")
    if block_size and any(g.num_tokens % block_size or g.start_token % block_size for g in plan.grants):
        out.append(f"blocks: a grant is not whole blocks of {block_size}: {plan.grants}")
    return out


def declared_cap_blocks(kv: Any) -> int:
    """The shadow cap the policy declares for ``kv``'s pool:
    ``int(shadow_cap_fraction * num_blocks)``."""
    return int(kv.policy.shadow_cap_fraction * kv.num_blocks)


def kv_problems(kv: Any) -> list[str]:
    """What a KV pool (a :class:`~shadowcore.kv.KVClassManager` or anything
    with its counters and ``policy``) breaks of the KV rules now."""
    out = []
    cap = declared_cap_blocks(kv)
    if kv.num_shadow_blocks > cap:
        out.append(
            f"cap: shadow KV {kv.num_shadow_blocks} blocks > the declared cap {cap} "
            f"({kv.policy.shadow_cap_fraction} x {kv.num_blocks} blocks)"
        )
    if kv.num_host_blocks > kv.host_capacity_blocks:
        out.append(f"host: host tier {kv.num_host_blocks} blocks > capacity {kv.host_capacity_blocks}")
    return out


def _probability_problem(what: str, p: Any) -> str | None:
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p) or not 0.0 <= p <= 1.0:
        return f"{what} = {p!r}: not a probability in [0, 1]"
    return None


def predictor_problems(predictor: Any, session_id: str, task: str, current_model: str,
                       models: Sequence[str]) -> list[str]:
    """Ask ``predictor`` once about (``session_id``, ``task``,
    ``current_model``) among ``models``; what its answers break."""
    where = f"session {session_id!r}, task {task!r}, current {current_model!r}, models {list(models)}"
    out = []
    p = predictor.switch_probability(session_id, task, current_model)
    problem = _probability_problem("switch_probability", p)
    if problem:
        out.append(f"predictor: {problem} ({where})")
    dist = predictor.next_model_distribution(session_id, task, current_model, tuple(models))
    out.extend(f"predictor: {p} ({where})" for p in distribution_problems(dist, current_model, models))
    return out


def distribution_problems(dist: Any, current_model: str, models: Sequence[str]) -> list[str]:
    """What a next-model distribution breaks (see the module docstring)."""
    if not isinstance(dist, Mapping):
        return [f"next_model_distribution returned {type(dist).__name__}, not a mapping"]
    out = []
    others = [m for m in models if m != current_model]
    stray = sorted(str(m) for m in dist if m not in others)
    if stray:
        out.append(f"next_model_distribution has entries for models that are not other models: {stray}")
    for m, q in dist.items():
        problem = _probability_problem(f"next_model_distribution[{m!r}]", q)
        if problem:
            out.append(problem)
    if others and not out:
        total = math.fsum(float(q) for q in dist.values())
        if abs(total - 1.0) > EPS_SUM:
            out.append(f"next_model_distribution sums to {total!r}, not 1: {dict(dist)}")
    return out


def targeting_problems(ranked: Sequence[Target], chosen: Any) -> list[str]:
    """What ``chosen`` (a targeting's answer to ``ranked``) breaks."""
    if not isinstance(chosen, (list, tuple)):
        return [f"targeting: choose returned {type(chosen).__name__}, not a list"]
    where = f"ranked {[(t.model, t.switch_probability) for t in ranked]}"
    position = {t.model: i for i, t in enumerate(ranked)}
    out, last, seen = [], -1, set()
    for t in chosen:
        model = getattr(t, "model", None)
        i = position.get(model)
        if i is None:
            out.append(f"targeting: chose {t!r}, a model outside the ranked list ({where})")
            continue
        if t != ranked[i]:
            out.append(f"targeting: chose {t!r} but the ranked list has {ranked[i]!r} ({where})")
        if model in seen:
            out.append(f"targeting: chose {model!r} twice ({where})")
        elif i < last:
            out.append(f"targeting: {model!r} chosen out of the ranked order ({where})")
        seen.add(model)
        last = max(last, i)
    return out


__all__ = [
    "EPS_S",
    "EPS_SUM",
    "declared_cap_blocks",
    "decode_slack_reference_s",
    "distribution_problems",
    "kv_problems",
    "loosest_slack_s",
    "plan_problems",
    "predictor_problems",
    "prefill_slack_reference_s",
    "targeting_problems",
]
