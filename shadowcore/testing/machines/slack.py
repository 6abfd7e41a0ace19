"""The slack-controller machine: :class:`SlackControllerMachine` drives one
:class:`~shadowcore.hook.EngineHook` (the controller under test, a latency
model, a stub engine port and a stub job source) through snapshots and
outcomes (see the class docstring for the named checks)."""

from __future__ import annotations

import itertools
import math
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from shadowcore.hook import EngineHook
from shadowcore.job import SessionHistory, ShadowJob
from shadowcore.latency import LatencyModel, PrefillChunk
from shadowcore.slack import (
    CreditAccrual,
    EagerController,
    HarvestController,
    NoShadowController,
    PrefillInstanceController,
    SlackController,
    SloSlackController,
)
from shadowcore.testing import strategies as sst
from shadowcore.testing.contracts import decode_slack_reference_s, prefill_slack_reference_s
from shadowcore.testing.machines._base import EPS_S, Draw
from shadowcore.testing.machines._base import pick as _pick
from shadowcore.testing.stubs import ServedJob, StubEnginePort, StubJobSource
from shadowcore.types import JobKey, Phase, RequestKind, StepOutcome, StepPlan, StepSnapshot

__all__ = ["SLACK_CHECKS", "SlackControllerMachine"]

SLACK_CHECKS = frozenset({"gate", "budget", "idle", "credit", "grants", "order", "liveness"})
_KINDS = st.sampled_from(("idle", "idle", "routed", "routed", "decode", "decode", "any", "waiting", "blocked"))


def _routed_prefill(snapshot: StepSnapshot) -> bool:
    """A routed call prefills in this iteration (written out, not the controller's helper)."""
    return any(r.kind is RequestKind.ROUTED and r.phase is Phase.PREFILL for r in snapshot.batch)


def _grant_order(served: list[ServedJob], plan: StepPlan) -> list[ServedJob]:
    """The jobs as the hook grants them: the source's order, or under an
    ``imminent_first`` plan its imminent jobs first, each group in that order
    (written out here, independently of ``shadowcore.hook.grant_order``)."""
    if not plan.imminent_first:
        return served
    return [s for s in served if s.imminent] + [s for s in served if not s.imminent]


class SlackControllerMachine(RuleBasedStateMachine):
    """Drives one :class:`~shadowcore.hook.EngineHook` (controller, latency
    model, stub port, stub job source) through snapshots and outcomes, with
    jobs opened, grown, re-prioritised, compacted, evicted and closed in
    between (and, for a controller that ``reads_imminence``, marked imminent
    and back). Per iteration it checks (predictions recomputed with the latency
    model from the snapshot and the grants, never taken from the plan):

    ``"gate"``: no shadow tokens while ``num_waiting > 0`` or
    ``admission_blocked`` (unless the controller is ``normal_priority``, Eager).

    ``"budget"``: the plan reports the predictions truthfully; with shadow
    tokens the predicted iteration fits the budget -- the whole iteration for
    slack/idle budgets, the added time (stretch) for credit budgets
    (``bounds_stretch``); and for the shipped controllers the budget itself is
    at most the paper's bound (``beta*T``; ``min(beta*T, min_r sigma_r)`` by an
    independent Eq. 1 for SLO slack; 0 when gated). See
    :meth:`budget_upper_bound_s`.

    ``"idle"``: a shadow-only iteration on an idle instance is predicted to
    last at most ``beta*T`` (:meth:`idle_cap_s`).

    ``"credit"`` (the paper's delta guarantee): the cumulative predicted
    stretch of the iterations the credit pays for (Harvest-SLO: those carrying
    a routed call; Harvest: every busy one; :meth:`credit_charged`) is at most
    ``delta`` times the cumulative measured duration of the decode-only
    iterations *among them* (decode-only batch, no shadow token computed), +
    ``EPS_S``: routed iterations are stretched by at most ``delta`` of their
    own decode-only time, whatever the normal traffic's iterations do. A
    controller declaring the other reading (``credit_accrual="all-decode"``)
    is held to the weaker bound over every decode-only iteration
    (:meth:`credit_accrues`).

    ``"grants"``: grants are whole blocks (start and length), to distinct jobs,
    start where the job's held prefix ends, in the job's epoch and with its
    probability and imminence, never exceed a job's missing tokens, the token budget or the
    shadow KV room; a non-empty plan has at least ``n_min`` tokens; a zero
    budget gives no grants.

    ``"order"``: grants come in non-increasing switch probability (under an
    ``imminent_first`` plan: imminent grants first, then the others), and follow
    the job source's order greedily (each job before the last is fully served;
    under ``imminent_first`` the source's imminent jobs, then the rest).

    ``"liveness"``: the plan is maximal (Algorithm 1, line 10): one more block
    (filled in the grant order) would not fit the budget, or the limits are reached; an empty plan under a
    positive budget means even ``max(n_min, 1 block)`` tokens would not fit.

    Subclass hooks: :meth:`make_controller`, :meth:`make_latency_model`,
    :meth:`make_port`, :meth:`make_job_source`, :meth:`snapshot_kinds`; the job
    actions (``open_job``, ``grow_job``, ``reprioritise_job``, ``compact_job``,
    ``evict_job``, ``close_job``, ``imminence_job``); and the expectations :meth:`idle_cap_s`,
    :meth:`budget_upper_bound_s`, :meth:`credit_charged`, :meth:`credit_accrues`, :meth:`credit_delta`.
    """

    checks: ClassVar[frozenset[str]] = SLACK_CHECKS
    instance_id: ClassVar[str] = "i0"

    def __init__(self) -> None:
        super().__init__()
        self.hook: EngineHook | None = None

    # -- factories -----------------------------------------------------------------
    def make_controller(self, draw: Draw) -> SlackController:
        """The controller under test (default: any shipped one, random parameters)."""
        return draw(sst.slack_controllers(n_min=st.sampled_from([0, self.block_size, 64, 256])))

    def make_latency_model(self, draw: Draw) -> LatencyModel:
        return draw(sst.latency_models())

    def make_port(self, draw: Draw) -> Any:
        return StubEnginePort(self.block_size)

    def make_job_source(self, draw: Draw) -> Any:
        return StubJobSource()

    def snapshot_kinds(self) -> st.SearchStrategy[str]:
        """Which kind of snapshot each step shows."""
        return _KINDS

    # -- expectations for the shipped controllers -----------------------------------
    def idle_cap_s(self, snapshot: StepSnapshot) -> float | None:
        """The longest an idle shadow-only iteration may be predicted to last."""
        c = self.controller
        if isinstance(c, (SloSlackController, HarvestController)):
            return c.beta * snapshot.tpot_slo_s
        if isinstance(c, PrefillInstanceController):
            return c.max_iteration_s
        if isinstance(c, NoShadowController):
            return 0.0
        return None

    def budget_upper_bound_s(self, snapshot: StepSnapshot) -> float | None:
        """An independent upper bound of the controller's budget (None: unknown)."""
        c = self.controller
        gated = snapshot.num_waiting > 0 or snapshot.admission_blocked
        if isinstance(c, NoShadowController):
            return 0.0
        if isinstance(c, EagerController):
            return math.inf
        if gated:
            return 0.0
        if isinstance(c, HarvestController):
            return c.beta * snapshot.tpot_slo_s
        if isinstance(c, SloSlackController):
            cap = c.beta * snapshot.tpot_slo_s
            if snapshot.is_idle or snapshot.has_routed:
                return cap
            return max(0.0, min(cap, self._min_slack(snapshot, c.margin, c.chunk_tokens)))
        if isinstance(c, PrefillInstanceController):
            return max(0.0, min(c.max_iteration_s, self._min_slack(snapshot, c.margin, c.chunk_tokens)))
        return None

    def credit_charged(self, snapshot: StepSnapshot) -> bool | None:
        """Whether the credit pays for shadow tokens in this iteration (None: no credit).
        Harvest-SLO: an iteration carrying a routed call, except, with a routed
        margin for it (``routed_decode_margin``, or ``imminent_margin`` while the
        first job in the grant order is imminent) or with ``imminent_stretch``
        while that job is imminent, one whose routed calls all decode (paid
        from their slack)."""
        c = self.controller
        if isinstance(c, SloSlackController):
            if not snapshot.has_routed:
                return False
            imminent = self._first_job_imminent()
            routed_margin = c.imminent_margin if imminent and c.imminent_margin is not None else c.routed_decode_margin
            stretch = imminent and c.imminent_stretch is not None  # paid from the decodes' slack at margin 0
            return _routed_prefill(snapshot) or (routed_margin is None and not stretch)
        if isinstance(c, HarvestController):
            return not snapshot.is_idle
        return None

    def credit_accrues(self, snapshot: StepSnapshot) -> bool:
        """Whether this iteration's time (of one without shadow work) counts in
        the credit bound: a decode-only one the credit pays for, or under
        Harvest-SLO's declared reading (``credit_accrual``) a decode-only one
        carrying a routed call (``"routed"``), every decode-only one
        (``"all-decode"``), one in which a routed call prefills
        (``"routed-prefill"``)."""
        c = self.controller
        decode_only = snapshot.batch_shape.is_decode_only
        if isinstance(c, SloSlackController):
            if c.credit_accrual is CreditAccrual.ROUTED_PREFILL:
                return _routed_prefill(snapshot)
            return decode_only and (snapshot.has_routed or c.credit_accrual is CreditAccrual.ALL_DECODE)
        return decode_only and bool(self.credit_charged(snapshot))

    def _first_job_imminent(self) -> bool:
        """Whether the hook told the controller ``imminent``: the first job it
        would grant to (the grant order of what the source served) is imminent."""
        served = getattr(self.jobs, "served", None)
        if not served:
            return False
        return any(s.imminent for s in served) if self.controller.imminent_first else served[0].imminent

    def credit_delta(self) -> float:
        return float(self.controller.delta)

    def _min_slack(self, snapshot: StepSnapshot, margin: float, chunk: int) -> float:
        out = math.inf
        for r in snapshot.batch:
            if r.phase is Phase.DECODE:
                out = min(out, decode_slack_reference_s(r, snapshot.now_s, margin))
            else:
                out = min(out, prefill_slack_reference_s(r, snapshot.now_s, margin, self.latency, chunk))
        return out

    # -- setup ---------------------------------------------------------------------
    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        self.block_size = data.draw(st.sampled_from([1, 4, 16]), label="block_size")
        self.tpot_s = data.draw(st.floats(0.02, 0.1), label="tpot_slo_s")
        self.latency = self.make_latency_model(data.draw)
        self.controller = self.make_controller(data.draw)
        self.port = self.make_port(data.draw)
        self.jobs = self.make_job_source(data.draw)
        self.hook = EngineHook(self.instance_id, self.jobs, self.controller, self.latency, self.port)
        self.now = 0.0
        self.iteration = 0
        self.next_session = 0
        self.charged_stretch_s = 0.0
        self.decode_only_s = 0.0
        for _ in range(data.draw(st.integers(0, 3), label="initial jobs")):
            self.open_job(data)

    def _live(self) -> list[ShadowJob]:
        return sorted(self.jobs.all(), key=lambda j: j.sequence)

    # -- job rules -----------------------------------------------------------------
    # One rule picks one of the actions below, so that most machine steps are
    # engine iterations (hypothesis picks rules roughly uniformly).
    @rule(data=st.data())
    def change_jobs(self, data: st.DataObject) -> None:
        live = self._live()
        actions = ["open", "open"] + (["grow", "grow", "reprioritise", "compact", "evict", "close"] if live else [])
        if live and self.controller.reads_imminence:  # the job sources track imminence for such a controller only
            actions += ["imminence", "imminence"]
        action = _pick(data, actions)
        if action == "open":
            self.open_job(data)
            return
        job = _pick(data, live)
        getattr(self, action + "_job")(job, data)

    def open_job(self, data: st.DataObject) -> None:
        sid = f"s{self.next_session}"
        history = SessionHistory(sid)
        history.append(data.draw(st.integers(0, 8192)))
        job = ShadowJob(
            JobKey(sid, "B"), self.instance_id, history, self.block_size,
            switch_probability=data.draw(sst.probabilities()), sequence=self.next_session, epoch=history.epoch,
        )
        self.next_session += 1
        if self.controller.reads_imminence:
            self.imminence_job(job, data)
        if data.draw(st.integers(0, 3)) == 0:  # the instance already holds part of the history
            self.port.cached[sid] = (history.epoch, data.draw(st.integers(0, history.num_tokens)))
        self.jobs.add(job)

    def grow_job(self, job: ShadowJob, data: st.DataObject) -> None:
        """Streamed output or a new call's input extends the history."""
        job.history.append(data.draw(st.integers(0, 2048)))

    def reprioritise_job(self, job: ShadowJob, data: st.DataObject) -> None:
        job.switch_probability = data.draw(sst.probabilities())

    def compact_job(self, job: ShadowJob, data: st.DataObject) -> None:
        job.history.compact(data.draw(st.integers(0, 1024)))

    def evict_job(self, job: ShadowJob, data: st.DataObject) -> None:
        self.port.evict(job.key.session_id, data.draw(st.integers(0, job.history.num_tokens)))

    def close_job(self, job: ShadowJob, data: st.DataObject) -> None:
        self.jobs.remove(job.key)

    def imminence_job(self, job: ShadowJob, data: st.DataObject) -> None:
        """The session's routed call finished (its tool gap starts: imminent) or
        its next call arrived (no longer imminent), as ``ShadowManager`` marks
        jobs for a controller that ``reads_imminence``."""
        job.imminent = data.draw(st.booleans(), label="imminent")

    # -- the iteration ---------------------------------------------------------------
    @rule(data=st.data())
    def steps(self, data: st.DataObject) -> None:
        """One to three engine iterations."""
        for _ in range(data.draw(st.integers(1, 3), label="iterations")):
            self.step(data)

    def step(self, data: st.DataObject) -> None:
        kind = data.draw(self.snapshot_kinds(), label="kind")
        self.now += data.draw(st.floats(0.0, 0.2))
        self.iteration += 1
        opts: dict[str, Any] = {"waiting": False, "blocked": False}
        if kind == "idle":
            opts["idle"] = True
        elif kind == "routed":
            opts["has_routed"] = True
        elif kind == "decode":
            opts.update(decode_only=True, has_routed=data.draw(st.booleans()))
        elif kind == "waiting":
            opts.update(waiting=True, blocked=None)
        elif kind == "blocked":
            opts.update(blocked=True, waiting=None)
        else:
            opts.update(waiting=None, blocked=None)
        snapshot = sst.draw_snapshot(
            data.draw, instance_id=self.instance_id, iteration=self.iteration, now_s=self.now,
            tpot_slo_s=self.tpot_s, max_batch=4, max_free_token_budget=4096, **opts,
        )
        if hasattr(self.jobs, "served"):
            self.jobs.served = None
        plan = self.hook.begin_step(snapshot)
        base_s, predicted_s = self._check_plan(snapshot, plan)
        outcome = sst.draw_step_outcome(data.draw, plan, block_size=self.block_size)
        self.hook.end_step(outcome)
        for r in outcome.results:
            job = self.jobs.job(r.grant.job)
            if job is not None:
                self.port.computed(job.history, r.grant.epoch, r.grant.start_token, r.num_computed_tokens)
        self._check_credit(snapshot, plan, outcome, predicted_s - base_s)
        live = self._live()
        if live and data.draw(st.booleans(), label="stream"):  # a routed call streams output meanwhile
            self.grow_job(_pick(data, live), data)

    # -- checks ----------------------------------------------------------------------
    def _predict(self, snapshot: StepSnapshot, chunks: tuple[PrefillChunk, ...]) -> tuple[float, float]:
        base = snapshot.batch_shape
        return self.latency.predict_s(base), self.latency.predict_s(base.with_prefills(chunks))

    def _check_plan(self, snapshot: StepSnapshot, plan: StepPlan) -> tuple[float, float]:
        grants = plan.grants
        total = plan.num_shadow_tokens
        chunks = tuple(PrefillChunk(g.num_tokens, g.start_token) for g in grants)
        base_s, predicted_s = self._predict(snapshot, chunks)
        gated = snapshot.num_waiting > 0 or snapshot.admission_blocked
        if "gate" in self.checks and gated and not self.controller.normal_priority:
            assert total == 0, (
                f"{total} shadow tokens planned with {snapshot.num_waiting} waiting, "
                f"admission_blocked={snapshot.admission_blocked} ({plan.budget})"
            )
        if "budget" in self.checks:
            assert math.isclose(plan.predicted_base_s, base_s, rel_tol=1e-9, abs_tol=EPS_S), (plan, base_s)
            assert math.isclose(plan.predicted_s, predicted_s, rel_tol=1e-9, abs_tol=EPS_S), (plan, predicted_s)
            if grants:
                used = predicted_s - base_s if plan.budget.bounds_stretch else predicted_s
                assert used <= plan.budget.budget_s + EPS_S, (
                    f"{'stretch' if plan.budget.bounds_stretch else 'iteration'} {used}s with {total} shadow tokens "
                    f"exceeds the budget {plan.budget}"
                )
            bound = self.budget_upper_bound_s(snapshot)
            if bound is not None:
                assert plan.budget.budget_s <= bound + EPS_S, f"budget {plan.budget} above the bound {bound}s"
        if "idle" in self.checks and snapshot.is_idle and grants:
            cap = self.idle_cap_s(snapshot)
            if cap is not None:
                assert predicted_s <= cap + EPS_S, (
                    f"idle shadow-only iteration predicted {predicted_s}s > cap {cap}s ({total} tokens)"
                )
        served = getattr(self.jobs, "served", None)
        if "grants" in self.checks:
            bs = self.block_size
            if plan.budget.budget_s <= 0:
                assert not grants, f"grants under a zero budget: {plan}"
            for g in grants:
                assert g.num_tokens % bs == 0 and g.start_token % bs == 0, f"grant {g} is not whole blocks of {bs}"
            assert len({g.job for g in grants}) == len(grants), "two grants for one job"
            if grants:
                assert total >= self.controller.n_min, f"{total} shadow tokens < n_min {self.controller.n_min}"
            assert total <= min(snapshot.num_free_token_budget, snapshot.num_shadow_room_tokens), (
                total, snapshot.num_free_token_budget, snapshot.num_shadow_room_tokens,
            )
            if served is not None:
                by_key = {s.key: s for s in served}
                for g in grants:
                    s = by_key.get(g.job)
                    assert s is not None, f"grant {g} for a job that was not pending"
                    assert (g.epoch, g.start_token) == (s.epoch, s.next_token), (g, s)
                    assert g.num_tokens <= s.num_missing_tokens, (g, s)
                    assert g.switch_probability == s.switch_probability, (g, s)
                    assert g.imminent == s.imminent, (g, s)
        if "order" in self.checks:
            first = plan.imminent_first  # then imminent grants come first, each group as the source ordered it
            ps = [(first and g.imminent, g.switch_probability) for g in grants]
            assert all(a >= b for a, b in itertools.pairwise(ps)), f"grants not in non-increasing switch probability: {ps}"
            if served is not None:
                sp = [s.switch_probability for s in served]
                assert all(a >= b for a, b in itertools.pairwise(sp)), f"job source order not non-increasing: {sp}"
                order = _grant_order(served, plan)
                assert [g.job for g in grants] == [s.key for s in order[: len(grants)]], (
                    "grants do not follow the job order", grants, order,
                )
                for g, s in zip(grants[:-1], order):
                    assert g.num_tokens == s.num_missing_tokens, f"job {s.key} not fully served before the next"
        if "liveness" in self.checks and plan.budget.budget_s > 0:
            self._check_maximal(snapshot, plan, served, base_s)
        return base_s, predicted_s

    def _check_maximal(self, snapshot: StepSnapshot, plan: StepPlan, served: list[ServedJob] | None,
                       base_s: float) -> None:
        bs = self.block_size
        if not hasattr(self.jobs, "served"):
            return  # a job source that does not record what it served
        assert served is not None, f"positive budget {plan.budget} but the hook did not ask for jobs"
        missing = sum(s.num_missing_tokens for s in served)
        upper = min(snapshot.num_free_token_budget, snapshot.num_shadow_room_tokens, missing) // bs * bs

        def fits_clearly(n: int) -> bool:
            left, chunks = n, []
            for s in _grant_order(served, plan):  # filled greedily in the order the hook grants
                take = min(left, s.num_missing_tokens)
                if take > 0:
                    chunks.append(PrefillChunk(take, s.next_token))
                    left -= take
            t = self.latency.predict_s(snapshot.batch_shape.with_prefills(tuple(chunks)))
            used = t - base_s if plan.budget.bounds_stretch else t
            return used <= plan.budget.budget_s - EPS_S

        total = plan.num_shadow_tokens
        if total > 0:
            assert total == upper or not fits_clearly(total + bs), (
                f"plan of {total} tokens is not maximal: {total + bs} fit the budget {plan.budget} (limit {upper})"
            )
        else:
            first = max(bs, -(-self.controller.n_min // bs) * bs)
            assert first > upper or not fits_clearly(first), (
                f"empty plan although {first} tokens fit the budget {plan.budget} (limit {upper})"
            )

    def _check_credit(self, snapshot: StepSnapshot, plan: StepPlan, outcome: StepOutcome, stretch_s: float) -> None:
        if "credit" not in self.checks:
            return
        charged = self.credit_charged(snapshot)
        if charged is None:
            return
        if charged and plan.grants:
            self.charged_stretch_s += stretch_s
        if outcome.num_shadow_tokens == 0 and self.credit_accrues(snapshot):
            self.decode_only_s += outcome.duration_s
        bound = self.credit_delta() * self.decode_only_s
        assert self.charged_stretch_s <= bound + EPS_S, (
            f"cumulative charged stretch {self.charged_stretch_s}s > delta * decode-only time of the iterations "
            f"the credit pays for = {bound}s"
        )


