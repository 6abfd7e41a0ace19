"""Diagnostics that keep a policy from silently doing nothing.

* :func:`unreachable_grant`: at policy load on an engine, whether the
  smallest grant the hook may plan (``n_min`` tokens, at least one block) can
  fit any budget the controller gives under that engine's latency model. If
  it never can, no shadow chunk is ever planned there, and the message says
  why with the numbers (``n_min 256 predicted 9.4 ms > idle budget 6.25 ms``).
* :data:`STEP_REASONS`: what decided each iteration's shadow work;
  :class:`~shadowcore.hook.EngineHook` counts its iterations by these
  (``EngineHook.step_counts``) and results report the sums. Every iteration
  of a hook whose controller may grant is counted once, planned or skipped by
  an engine's fast path, with the reason ``begin_step`` gives it, so the
  counts sum to the hook's iterations and do not depend on which path ran
  them (``tests/test_diagnostics.py``); a controller that never grants is
  not counted.

Invariants: :func:`unreachable_grant` never changes the controller it is
given (it asks a deep copy); it returns a message only when every budget it
obtained is positive-or-zero and none admits the smallest grant, and ``None``
when the controller never grants (nothing to warn about) or when some budget
admits it.
"""

from __future__ import annotations

import copy
import math

from shadowcore.latency import BatchShape, LatencyModel, PrefillChunk
from shadowcore.slack import SlackController
from shadowcore.types import (
    BudgetReason,
    Phase,
    RequestKind,
    RequestView,
    SlackBudget,
    StepOutcome,
    StepPlan,
    StepSnapshot,
)

#: Why an iteration got the shadow work it got, in the order they are decided:
#: ``no_jobs``: the jobs here take no grant whatever the budget (none is
#: pending, or together they miss fewer whole-block tokens than the smallest
#: grant, ``n_min`` tokens and at least one block: tails the switch call
#: computes); then, with jobs that could take one, ``waiting`` / ``blocked``:
#: the gate (Algorithm 1 line 1); ``zero_budget``: the controller gave no time
#: for another reason (no credit, no slack, disabled); ``no_room``: a budget
#: but less token budget or shadow KV room than the smallest grant (shadow
#: chunks take only free blocks and blocks idle longer than ``cold_age_s``);
#: ``below_n_min``: a budget and room, but nothing from the smallest grant up
#: fits the budget; ``granted``: shadow chunks planned.
STEP_REASONS = ("no_jobs", "waiting", "blocked", "zero_budget", "no_room", "below_n_min", "granted")

_CONTEXT_TOKENS = 1500  # the probe's decodes: a typical agentic context
_NUM_DECODES = 4


def smallest_grant_tokens(controller: SlackController, block_size: int) -> int:
    """The fewest shadow tokens the hook plans in one iteration: ``n_min``
    rounded up to whole blocks, and at least one block."""
    return max(block_size, -(-controller.n_min // block_size) * block_size)


def _decodes(tpot_slo_s: float, routed: bool) -> tuple[RequestView, ...]:
    steps = 1000  # a long-running decode far ahead of its TPOT SLO: its slack is large
    first = steps * tpot_slo_s * 0.5  # the probe's clock reads steps * tpot_slo_s
    views = []
    for i in range(_NUM_DECODES):
        kind = RequestKind.ROUTED if routed and i == 0 else RequestKind.NORMAL
        views.append(RequestView(f"probe-d{i}", kind, Phase.DECODE, first / 2, 1, _CONTEXT_TOKENS,
                                 10.0, tpot_slo_s, first_token_s=first, num_decode_steps=steps))
    return tuple(views)


def _budgets(controller: SlackController, latency: LatencyModel, tpot_slo_s: float
             ) -> list[tuple[str, BatchShape, SlackBudget]]:
    """The copy's budgets on an idle, a decode-only and a routed iteration,
    after 20 decode-only iterations of 1 s each that carry a routed call (any
    credit has accrued, under either reading of its accrual)."""
    probe = copy.deepcopy(controller)
    now = 1000 * tpot_slo_s
    big = 1 << 20

    def snap(i: int, batch: tuple[RequestView, ...]) -> StepSnapshot:
        return StepSnapshot("probe", i, now, batch, 0, False, tpot_slo_s, big, big)

    busy, routed = _decodes(tpot_slo_s, routed=False), _decodes(tpot_slo_s, routed=True)
    for i in range(20):
        s = snap(i, routed)
        plan = StepPlan("probe", i, probe.budget(s, latency), (), 0.0, 0.0, normal_priority=probe.normal_priority)
        probe.commit(s, plan)
        probe.observe(s, plan, StepOutcome("probe", i, 1.0))
    out = []
    for name, batch in (("idle", ()), ("decode-only", busy), ("routed", routed)):
        s = snap(100, batch)
        out.append((name, s.batch_shape, probe.budget(s, latency)))
    return out


def unreachable_grant(controller: SlackController, latency: LatencyModel, block_size: int,
                      tpot_slo_s: float) -> str | None:
    """``None`` when the smallest grant fits some budget ``controller`` gives
    (or when it never grants); otherwise why it never does, with the numbers."""
    if controller.never_grants:
        return None
    n = smallest_grant_tokens(controller, block_size)
    why = []
    for name, base, budget in _budgets(controller, latency, tpot_slo_s):
        if budget.budget_s <= 0:
            continue
        if math.isinf(budget.budget_s):
            return None
        base_s = latency.predict_s(base)
        t = latency.predict_s(base.with_prefills((PrefillChunk(n, 0),)))
        used = t - base_s if budget.bounds_stretch else t
        if used <= budget.budget_s:
            return None
        verb = "adds" if budget.bounds_stretch else "predicted"
        label = name if budget.reason is BudgetReason.IDLE else f"{name} {budget.reason.value}"
        why.append(f"{verb} {used * 1e3:.1f} ms > {label} budget {budget.budget_s * 1e3:.2f} ms")
    if not why:
        return None  # no positive budget seen: nothing to compare with
    size = f"n_min {controller.n_min}" if controller.n_min >= n else f"one block ({n} tokens)"
    return (f"{size} {'; '.join(why)}: no shadow chunk can ever be planned "
            f"(TPOT SLO {tpot_slo_s * 1e3:.2f} ms); lower n_min or raise beta")


__all__ = ["STEP_REASONS", "smallest_grant_tokens", "unreachable_grant"]
