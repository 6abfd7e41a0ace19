"""Slack controllers: how long shadow work may take in one iteration
(Algorithm 1 of the paper, lines 1-9), and the per-request slack of Eq. 1.

A controller is a strategy users may replace (an ABC), one instance per engine
instance (it may keep state, such as the routed-step credit). The hook turns
its :class:`~shadowcore.types.SlackBudget` into tokens (lines 10-14).

Invariants:

* No budget while the waiting queue is non-empty or an admission was blocked
  (except Eager, which is the normal-priority path by definition).
* An idle instance gets ``beta * T``; a busy one never more than ``beta * T``.
* With routed-step protection (the paper's delta guarantee), the predicted
  time added to iterations that carry a routed call never exceeds ``delta``
  times the measured duration of the decode-only iterations *that carried a
  routed call* seen so far: the credit is debited by the predicted stretch
  when a plan is committed and credited only on decode-only iterations of the
  kind it pays for (:class:`CreditAccrual`). ``credit_accrual="all-decode"``
  is the other reading of Algorithm 1 (credit from every decode-only
  iteration), kept as a named option; it bounds the stretch by ``delta`` of
  the instance's whole decode-only time instead (``docs/architecture.md``).
  Under ``routed_decode_margin`` (off by default) this bound covers the
  iterations in which a routed call prefills; one whose routed calls all
  decode is bounded by its batch's Eq. 1 slack (routed decodes at that
  margin) and ``beta * T``, like an iteration without a routed call. Under
  ``imminent_margin`` (off by default) the same holds at that margin for an
  iteration whose highest-priority pending job is imminent.
"""

from __future__ import annotations

import enum
import math
from abc import ABC, abstractmethod

import attrs

from shadowcore._validators import fraction_closed_open, non_negative, non_negative_int, positive
from shadowcore.latency import BatchShape, LatencyModel, PrefillChunk
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


def decode_slack_s(r: RequestView, now_s: float, margin: float) -> float:
    """Eq. 1: ``sigma_r = (1-m) T_r (k_r + 1) - (t - f_r)``, the longest the
    next iteration may last for decode ``r`` to stay within its TPOT SLO."""
    assert r.first_token_s is not None
    return (1.0 - margin) * r.tpot_slo_s * (r.num_decode_steps + 1) - (now_s - r.first_token_s)


def prefill_slack_s(r: RequestView, now_s: float, margin: float, remaining_s: float) -> float:
    """``(1-m) F_r - (t - a_r) - p_r``: with ``remaining_s`` the predicted time
    of the chunks left *after* this iteration, this is the longest this
    iteration may last for ``r`` to meet its TTFT SLO."""
    return (1.0 - margin) * r.ttft_slo_s - (now_s - r.arrival_s) - remaining_s


def remaining_prefill_s(r: RequestView, latency: LatencyModel, chunk_tokens: int) -> float:
    """Predicted time of ``r``'s prefill chunks after this iteration, each run
    alone at the engine's chunk size (a lower bound the controller can trust)."""
    left = r.num_remaining_prefill_tokens
    context = r.num_context_tokens + r.num_scheduled_tokens
    total = 0.0
    while left > 0:
        n = min(chunk_tokens, left)
        total += latency.predict_s(BatchShape((PrefillChunk(n, context),)))
        context += n
        left -= n
    return total


def min_batch_slack_s(
    snapshot: StepSnapshot, latency: LatencyModel, margin: float, chunk_tokens: int
) -> float:
    """The smallest per-request slack in the batch (``inf`` for an empty one),
    the snapshot's decode aggregate included (its exact minimum)."""
    slack = math.inf
    for r in snapshot.batch:
        if r.phase is Phase.DECODE:
            s = decode_slack_s(r, snapshot.now_s, margin)
        else:
            rest = remaining_prefill_s(r, latency, chunk_tokens)
            s = prefill_slack_s(r, snapshot.now_s, margin, rest)
        slack = min(slack, s)
    if snapshot.aggregate is not None:
        slack = min(slack, snapshot.aggregate.min_slack_s(snapshot.now_s, margin))
    return slack


def routed_prefilling(snapshot: StepSnapshot) -> bool:
    """Whether a routed call of the batch is in its prefill (its TTFT is being made)."""
    return any(r.kind is RequestKind.ROUTED and r.phase is Phase.PREFILL for r in snapshot.batch)


def routed_decode_slack_s(snapshot: StepSnapshot, margin: float) -> float:
    """The smallest Eq. 1 slack of the batch's routed decodes at ``margin`` (``inf`` for none)."""
    return min((decode_slack_s(r, snapshot.now_s, margin) for r in snapshot.batch
                if r.kind is RequestKind.ROUTED and r.phase is Phase.DECODE), default=math.inf)


class SlackController(ABC):
    """Strategy: the shadow budget of one iteration on one instance.

    Subclasses implement :meth:`budget`; stateful ones also override
    :meth:`commit` (called with the plan the hook made from the budget) and
    :meth:`observe` (called with the engine's outcome).

    A controller whose :attr:`reads_imminence` is true is called as
    ``budget(snapshot, latency, imminent=...)``: ``imminent`` says whether the
    highest-priority job the hook would grant to (the first of its pending
    jobs, after the hook's refresh) is :attr:`~shadowcore.job.ShadowJob.imminent`
    (its session's routed call has finished, the next has not arrived); false
    when no job is pending. Others are called without it. Either way an
    implementer must guarantee the core's rules: no budget while a request
    waits or an admission is blocked, and a budget that keeps the iteration
    within the TPOT SLO.

    A controller whose :attr:`imminent_first` is true changes the hook's
    grant order: pending jobs that are imminent come before the others,
    each group in the job source's order (non-increasing switch
    probability, older job first); ``imminent`` above is then true when any
    pending job is imminent. Such a controller must also ``reads_imminence``
    (the job sources track imminence only then), and must not change
    ``imminent_first`` inside a step: the hook orders the jobs before it
    calls :meth:`budget` and records the option in the plan after it.
    """

    #: Shadow chunks smaller than this are deferred (each chunk re-reads the
    #: whole cached context, so tiny ones waste bandwidth).
    n_min: int = 0
    #: True for Eager: shadow chunks run as normal-priority work.
    normal_priority: bool = False
    #: True for a controller whose budget is always zero by design (No Shadow): no
    #: shadow work is expected of its policy, so a run without any is no silent
    #: no-op. A statement about the policy, not a speed-up (engines decide what
    #: to skip themselves, by exact type: ``shadowcore.engine._fastpath``).
    never_grants: bool = False
    #: True for a controller whose :meth:`budget` takes ``imminent=`` (see above); the job
    #: sources then track it (``ShadowManager.track_imminence``).
    reads_imminence: bool = False
    #: True for a controller under which the hook grants imminent jobs first (see above).
    imminent_first: bool = False

    @abstractmethod
    def budget(self, snapshot: StepSnapshot, latency: LatencyModel) -> SlackBudget:
        """Algorithm 1, lines 1-9."""

    def commit(self, snapshot: StepSnapshot, plan: StepPlan) -> None:
        """The hook committed ``plan`` (made from this controller's budget)."""

    def observe(self, snapshot: StepSnapshot, plan: StepPlan, outcome: StepOutcome) -> None:
        """The engine ran the iteration ``snapshot`` + ``plan``."""


def _gate(snapshot: StepSnapshot) -> SlackBudget | None:
    """Algorithm 1 line 1: nothing while anything waits or is blocked."""
    if snapshot.num_waiting > 0:
        return SlackBudget.zero(BudgetReason.WAITING)
    if snapshot.admission_blocked:
        return SlackBudget.zero(BudgetReason.BLOCKED)
    return None


class CreditAccrual(enum.Enum):
    """Which decode-only iterations earn routed-step credit: the two readings
    of §3.2's "a small credit that accrues at delta times the duration of
    memory-bound, decode-only iterations"."""

    #: Only decode-only iterations that carry a routed call, the iterations
    #: the credit pays for: the time added to routed iterations is then at
    #: most ``delta`` of their own decode-only time over the run ("the
    #: long-run slowdown of routed calls is therefore at most delta"). The default.
    ROUTED = "routed"
    #: Every decode-only iteration (this project's reading before issue 16):
    #: routed iterations may be stretched by up to ``delta`` of the instance's
    #: whole decode-only time, more than ``delta`` of their own. Harvest, whose
    #: credit pays for every busy iteration, accrues so by definition.
    ALL_DECODE = "all-decode"
    #: Only iterations in which a routed call prefills (not a reading of the
    #: paper; for ``routed_decode_margin``, where the credit pays only for such
    #: iterations): the time added to them is then at most ``delta`` of their
    #: own time, the part of routed calls' TTFT that shadow work can stretch.
    ROUTED_PREFILL = "routed-prefill"


def _accrual(value: CreditAccrual | str) -> CreditAccrual:
    try:
        return CreditAccrual(value)
    except ValueError:
        names = ", ".join(repr(a.value) for a in CreditAccrual)
        raise ValueError(f"credit_accrual must be one of {names}, not {value!r}") from None


@attrs.define(on_setattr=attrs.setters.NO_OP)  # delta validated at construction; the balance mutates per step
class CreditAccount:
    """Routed-step protection: credit accrues at ``delta`` times the duration
    of decode-only iterations without shadow work (under ``accrual=ROUTED``
    only those carrying a routed call) and is debited by the predicted stretch
    of the iterations it pays for.

    Invariant: ``spent_s <= earned_s = delta * (measured duration of the
    iterations :meth:`accrues` admitted)``, up to one iteration's budget
    (the balance never goes below zero by more than rounding: a budget is at
    most the balance)."""

    delta: float = attrs.field(validator=non_negative)
    accrual: CreditAccrual = attrs.field(default=CreditAccrual.ROUTED, converter=_accrual)
    balance_s: float = 0.0
    earned_s: float = 0.0
    spent_s: float = 0.0

    def accrues(self, decode_only: bool, routed: bool, routed_prefill: bool = False) -> bool:
        """Whether an iteration without shadow work earns credit (``routed_prefill``:
        a routed call of it prefills; only ``ROUTED_PREFILL`` reads it)."""
        if self.accrual is CreditAccrual.ROUTED_PREFILL:
            return routed_prefill
        return decode_only and (routed or self.accrual is CreditAccrual.ALL_DECODE)

    def earn(self, snapshot: StepSnapshot, plan: StepPlan, outcome: StepOutcome) -> None:
        if (outcome.num_shadow_tokens == 0 and not plan.grants
                and self.accrues(snapshot.batch_shape.is_decode_only, snapshot.has_routed,
                                 self.accrual is CreditAccrual.ROUTED_PREFILL and routed_prefilling(snapshot))):
            self.earn_s(outcome.duration_s)

    def earn_s(self, duration_s: float) -> None:
        """Credit one iteration :meth:`accrues` admitted, of ``duration_s``."""
        gain = self.delta * duration_s
        self.balance_s += gain
        self.earned_s += gain

    def spend(self, plan: StepPlan) -> None:
        if plan.budget.bounds_stretch and plan.grants:
            cost = max(0.0, plan.predicted_stretch_s)
            self.balance_s -= cost
            self.spent_s += cost


@attrs.define
class SloSlackController(SlackController):
    """Harvest-SLO: Algorithm 1 exactly (defaults are the paper's).

    ``credit_accrual`` says which decode-only iterations earn the routed-step
    credit (:class:`CreditAccrual`): ``"routed"`` (default, the paper's delta
    guarantee) or ``"all-decode"`` (the other reading).

    ``routed_decode_margin`` (default ``None``: Algorithm 1 exactly): an
    iteration whose routed calls are all decoding is paid like one without a
    routed call (line 7: the batch's smallest Eq. 1 slack, capped at
    ``beta * T``) instead of from the routed-step credit, with the routed
    decodes' slack taken at this margin (at least ``margin``): a routed call
    keeps its mean TPOT within ``(1 - routed_decode_margin) * T``. Only an
    iteration in which a routed call prefills (the part of a call its TTFT
    is made of) is left to the credit; shadow work next to routed decodes
    costs them TPOT, never TTFT.

    ``imminent_margin`` (default ``None``: off): the same rule, with the
    routed decodes' slack taken at this margin (at least ``margin``) in an
    iteration whose highest-priority pending job is imminent (``budget``'s
    ``imminent``: its session is in its tool gap, so its switch call may
    come any moment); in other iterations ``routed_decode_margin`` applies
    as above (``None``: the credit). Iterations in which a routed call
    prefills are still paid only from the credit; a routed decode keeps its
    mean TPOT within ``(1 - imminent_margin) * T``.

    ``imminent_first`` (default ``False``): the hook grants imminent jobs
    before the others (:class:`SlackController`), so ``imminent`` is true
    whenever some pending job is imminent, and that job's shadow is the one
    an ``imminent_margin`` budget is spent on. Budgets are unchanged."""

    beta: float = attrs.field(default=0.5, validator=positive)
    delta: float = attrs.field(default=0.025, validator=non_negative)
    n_min: int = attrs.field(default=256, validator=non_negative_int)
    margin: float = attrs.field(default=0.1, validator=fraction_closed_open)
    chunk_tokens: int = attrs.field(default=2048, validator=positive)
    credit_accrual: CreditAccrual = attrs.field(default=CreditAccrual.ROUTED, converter=_accrual)
    routed_decode_margin: float | None = attrs.field(
        default=None, validator=attrs.validators.optional(fraction_closed_open))
    imminent_margin: float | None = attrs.field(
        default=None, validator=attrs.validators.optional(fraction_closed_open))
    imminent_first: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    credit: CreditAccount = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.credit = CreditAccount(self.delta, self.credit_accrual)

    @property
    def reads_imminence(self) -> bool:  # type: ignore[override]
        return self.imminent_margin is not None or self.imminent_first

    def budget(self, snapshot: StepSnapshot, latency: LatencyModel, imminent: bool = False) -> SlackBudget:
        gated = _gate(snapshot)
        if gated is not None:
            return gated
        cap = self.beta * snapshot.tpot_slo_s
        if snapshot.is_idle:
            return SlackBudget(cap, BudgetReason.IDLE)
        slack = math.inf
        if snapshot.has_routed:
            routed_margin = self.imminent_margin if imminent and self.imminent_margin is not None \
                else self.routed_decode_margin
            if routed_margin is None or routed_prefilling(snapshot):
                return SlackBudget(
                    max(0.0, min(self.credit.balance_s, cap)), BudgetReason.ROUTED_CREDIT, bounds_stretch=True
                )
            slack = routed_decode_slack_s(snapshot, max(self.margin, routed_margin))
        slack = min(slack, min_batch_slack_s(snapshot, latency, self.margin, self.chunk_tokens))
        return SlackBudget(max(0.0, min(cap, slack)), BudgetReason.SLO_SLACK)

    def commit(self, snapshot: StepSnapshot, plan: StepPlan) -> None:
        self.credit.spend(plan)

    def observe(self, snapshot: StepSnapshot, plan: StepPlan, outcome: StepOutcome) -> None:
        self.credit.earn(snapshot, plan, outcome)


@attrs.define
class HarvestController(SlackController):
    """Harvest: the fixed credit (``delta=0.1``) on every busy iteration, no
    per-request slack; idle instances still get ``beta * T``."""

    beta: float = attrs.field(default=0.5, validator=positive)
    delta: float = attrs.field(default=0.1, validator=non_negative)
    n_min: int = attrs.field(default=256, validator=non_negative_int)
    credit: CreditAccount = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:  # the credit pays for every busy iteration: every decode-only one earns
        self.credit = CreditAccount(self.delta, CreditAccrual.ALL_DECODE)

    def budget(self, snapshot: StepSnapshot, latency: LatencyModel) -> SlackBudget:
        gated = _gate(snapshot)
        if gated is not None:
            return gated
        cap = self.beta * snapshot.tpot_slo_s
        if snapshot.is_idle:
            return SlackBudget(cap, BudgetReason.IDLE)
        return SlackBudget(max(0.0, min(self.credit.balance_s, cap)), BudgetReason.CREDIT, bounds_stretch=True)

    def commit(self, snapshot: StepSnapshot, plan: StepPlan) -> None:
        self.credit.spend(plan)

    def observe(self, snapshot: StepSnapshot, plan: StepPlan, outcome: StepOutcome) -> None:
        self.credit.earn(snapshot, plan, outcome)


@attrs.define
class EagerController(SlackController):
    """Eager: shadow work as normal-priority requests (no slack control, no
    waiting-queue gate); bounded only by the token budget and KV room."""

    n_min: int = attrs.field(default=0, validator=non_negative_int)
    normal_priority: bool = attrs.field(default=True, init=False)

    def budget(self, snapshot: StepSnapshot, latency: LatencyModel) -> SlackBudget:
        return SlackBudget(math.inf, BudgetReason.EAGER)


@attrs.define
class NoShadowController(SlackController):
    """No shadow work at all (the No Shadow and Host Tier baselines)."""

    never_grants = True

    def budget(self, snapshot: StepSnapshot, latency: LatencyModel) -> SlackBudget:
        return SlackBudget.zero(BudgetReason.DISABLED)


@attrs.define
class PrefillInstanceController(SlackController):
    """P/D prefill instances (§3.5): shadow iterations of at most
    ``max_iteration_s`` when the queue is empty and every prefill in flight
    keeps its TTFT slack."""

    max_iteration_s: float = attrs.field(default=0.1, validator=positive)
    margin: float = attrs.field(default=0.1, validator=fraction_closed_open)
    n_min: int = attrs.field(default=256, validator=non_negative_int)
    chunk_tokens: int = attrs.field(default=2048, validator=positive)

    def budget(self, snapshot: StepSnapshot, latency: LatencyModel) -> SlackBudget:
        gated = _gate(snapshot)
        if gated is not None:
            return gated
        slack = min_batch_slack_s(snapshot, latency, self.margin, self.chunk_tokens)
        return SlackBudget(max(0.0, min(self.max_iteration_s, slack)), BudgetReason.PREFILL_SLACK)
