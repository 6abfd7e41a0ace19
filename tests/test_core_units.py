"""Example-based unit tests of the core: numbers worked out by hand.

Eq. 1 and the prefill slack, the linear latency model, every branch of
Algorithm 1 through a real :class:`~shadowcore.hook.EngineHook`, the
routed-step credit, leave-one-session-out switch prediction and the
probability gate.
"""

from __future__ import annotations

import pytest

from shadowcore.errors import ConfigError
from shadowcore.hook import EngineHook
from shadowcore.job import SessionHistory, ShadowJob
from shadowcore.latency import BatchShape, LinearLatencyModel, PrefillChunk
from shadowcore.slack import (
    CreditAccount,
    CreditAccrual,
    EagerController,
    HarvestController,
    SloSlackController,
    decode_slack_s,
    min_batch_slack_s,
    prefill_slack_s,
    remaining_prefill_s,
)
from shadowcore.switch import EmpiricalSwitchPredictor, ProbabilityGate, TopK, rank_targets
from shadowcore.testing.machines import StubEnginePort, StubJobSource
from shadowcore.types import (
    BudgetReason,
    ChunkResult,
    JobKey,
    Phase,
    RequestKind,
    RequestView,
    ShadowGrant,
    SlackBudget,
    StepOutcome,
    StepPlan,
    StepSnapshot,
)

T = 0.04  # TPOT SLO of the instance: beta * T = 0.02 s with beta = 0.5
# 4 ms per iteration plus 60 us per prefill token; decodes and attention free.
LATENCY = LinearLatencyModel(
    overhead_s=0.004, prefill_s_per_token=6e-5, attention_s_per_token_pair=0.0,
    decode_s_per_seq=0.0, decode_s_per_context_token=0.0,
)


def decode(rid: str, *, now: float, since_first: float, steps: int = 0, kind=RequestKind.NORMAL,
           tpot: float = T) -> RequestView:
    return RequestView(rid, kind, Phase.DECODE, 0.0, 1, 100, 1.0, tpot,
                       first_token_s=now - since_first, num_decode_steps=steps)


def prefill(rid: str, *, arrival: float, scheduled: int, remaining: int, context: int = 0, ttft: float = 1.0,
            kind=RequestKind.NORMAL) -> RequestView:
    return RequestView(rid, kind, Phase.PREFILL, arrival, scheduled, context, ttft, T,
                       num_remaining_prefill_tokens=remaining)


def snap(batch=(), *, now: float = 1.0, waiting: int = 0, blocked: bool = False, free: int = 8192,
         room: int = 8192, iteration: int = 0) -> StepSnapshot:
    return StepSnapshot("i0", iteration, now, tuple(batch), waiting, blocked, T, free, room)


# -- Eq. 1, prefill slack, latency model ----------------------------------------------------------
def test_eq1_decode_slack_by_hand():
    # sigma = (1 - m) T (k + 1) - (t - f) = 0.9 * 0.025 * 4 - 0.05 = 0.04
    r = decode("d", now=10.05, since_first=0.05, steps=3, tpot=0.025)
    assert decode_slack_s(r, 10.05, 0.1) == pytest.approx(0.04)
    # behind its pace: negative slack
    late = decode("d", now=10.0, since_first=0.2, steps=3, tpot=0.025)
    assert decode_slack_s(late, 10.0, 0.1) == pytest.approx(0.09 - 0.2)


def test_prefill_slack_by_hand():
    # (1 - m) F - (t - a) - p = 0.9 * 1.0 - 0.5 - 0.1 = 0.3
    r = prefill("p", arrival=9.5, scheduled=512, remaining=0)
    assert prefill_slack_s(r, 10.0, 0.1, 0.1) == pytest.approx(0.3)


def test_remaining_prefill_time_runs_chunks_alone():
    lat = LinearLatencyModel(0.001, 1e-5, 0.0, 0.0, 0.0)
    r = prefill("p", arrival=0.0, scheduled=100, remaining=5000)
    # chunks of 2048, 2048, 904: 3 iterations of 1 ms + 5000 * 10 us
    assert remaining_prefill_s(r, lat, 2048) == pytest.approx(0.003 + 0.05)
    # the batch minimum takes the tighter of a decode and that prefill
    s = snap([r, decode("d", now=1.0, since_first=0.0)], now=1.0)
    expected = min(0.9 * 1.0 - 1.0 - 0.053, 0.9 * T)
    assert min_batch_slack_s(s, lat, 0.1, 2048) == pytest.approx(expected)
    assert min_batch_slack_s(snap(), lat, 0.1, 2048) == float("inf")


def test_linear_latency_model_by_hand():
    lat = LinearLatencyModel(0.001, 1e-5, 1e-9, 1e-4, 1e-8)
    shape = BatchShape((PrefillChunk(100, 50),), (1000, 2000))
    # 1 ms + 100 * 10 us + 1e-9 * 100 * (50 + 50) + 2 * 100 us + 1e-8 * 3000
    assert lat.predict_s(shape) == pytest.approx(0.001 + 0.001 + 1e-5 + 2e-4 + 3e-5)
    assert lat.predict_s(BatchShape()) == 0.0


# -- Algorithm 1, each branch ---------------------------------------------------------------------
def make_hook(controller, *jobs: tuple[float, int], block_size: int = 16):
    """A hook with one job per ``(switch_probability, history tokens)``."""
    source = StubJobSource()
    for i, (p, tokens) in enumerate(jobs):
        h = SessionHistory(f"s{i}")
        h.append(tokens)
        source.add(ShadowJob(JobKey(f"s{i}", "B"), "i0", h, block_size, switch_probability=p, sequence=i))
    hook = EngineHook("i0", source, controller, LATENCY, StubEnginePort(block_size))
    return hook, source


def run(hook: EngineHook, snapshot: StepSnapshot, duration: float | None = None, computed: bool = True) -> StepPlan:
    plan = hook.begin_step(snapshot)
    results = [ChunkResult(g, g.num_tokens if computed else 0) for g in plan.grants]
    hook.end_step(StepOutcome("i0", snapshot.iteration, plan.predicted_s if duration is None else duration, results))
    return plan


def slo(n_min: int = 256) -> SloSlackController:
    return SloSlackController(beta=0.5, delta=0.025, n_min=n_min, margin=0.1, chunk_tokens=2048)


def test_line1_waiting_queue_gets_nothing():
    hook, _ = make_hook(slo(), (0.9, 4096))
    plan = run(hook, snap(waiting=1))
    assert plan.budget == SlackBudget(0.0, BudgetReason.WAITING)
    assert plan.grants == ()


def test_a_refresh_that_completes_a_job_leaves_no_job():
    """A pending job whose prefix the engine turns out to hold whole (a refresh) is no longer pending: the hook
    asks its source again after a refresh that moved a held prefix, so the step counts ``no_jobs``, not a
    job with nothing missing (which would count ``below_n_min``). A refresh that moves nothing leaves the
    job pending as it was: its grant starts where its held prefix ends."""
    hook, _ = make_hook(EagerController(), (0.9, 4096))
    hook.port.cached["s0"] = (0, 4096)
    assert run(hook, snap()).grants == ()
    assert hook.step_counts == {"no_jobs": 1}
    hook, _ = make_hook(EagerController(), (0.9, 4096))
    hook.port.cached["s0"] = (0, 1024)
    hook.port.evictions += 1  # a refresh that finds the same 1024 tokens each time
    assert [(g.start_token, g.num_tokens) for g in run(hook, snap()).grants] == [(1024, 3072)]
    assert hook.step_counts == {"granted": 1}


def test_a_refresh_that_completes_the_first_job_tells_the_controller_of_the_next():
    """A controller that reads imminence is told about the first job still pending after the refresh: when the
    refresh finds the first (imminent) job's prefix held whole, the source is asked again and the next job
    (not imminent) decides the budget, and the grant goes to it."""
    routed = decode("r", now=1.0, since_first=0.015, kind=RequestKind.ROUTED)
    hook = imminent_hook(imm(0.2), True, False)
    hook.port.cached["s0"] = (0, 4096)  # s0's whole prefix is held: it is pending no more
    plan = run(hook, snap([routed]))
    assert plan.budget.budget_s == pytest.approx(0.005)  # routed_decode_margin 0.5 (not imminent_margin 0.2)
    assert [g.job.session_id for g in plan.grants] == ["s1"]


def test_line1_blocked_admission_gets_nothing():
    hook, _ = make_hook(slo(), (0.9, 4096))
    plan = run(hook, snap(blocked=True))
    assert plan.budget == SlackBudget(0.0, BudgetReason.BLOCKED)
    assert plan.grants == ()


def test_line3_idle_instance_gets_beta_T():
    hook, _ = make_hook(slo(), (0.9, 4096))
    plan = run(hook, snap())
    assert plan.budget == SlackBudget(0.5 * T, BudgetReason.IDLE)
    # line 10: 0.004 + 6e-5 n <= 0.02  ->  n <= 266.7  ->  256 (whole blocks of 16)
    assert [(g.start_token, g.num_tokens) for g in plan.grants] == [(0, 256)]
    assert plan.predicted_s == pytest.approx(0.004 + 256 * 6e-5)


def test_line5_routed_call_spends_credit_earned_on_decode_only_iterations():
    hook, _ = make_hook(slo(), (0.9, 4096))
    routed = [decode("r", now=1.0, since_first=0.0, kind=RequestKind.ROUTED)]
    plan = run(hook, snap(routed))
    assert plan.budget == SlackBudget(0.0, BudgetReason.ROUTED_CREDIT, bounds_stretch=True)
    assert plan.grants == ()
    # that iteration was decode-only without shadow and carried a routed call: it earned delta * 4 ms.
    # A decode-only iteration of normal traffic alone earns nothing (the delta guarantee's denominator is
    # the routed iterations' own decode-only time); a routed one (no shadow room, so no shadow) of 1 s
    # earns delta * 1 s = 0.025 s
    run(hook, snap([decode("d", now=2.0, since_first=0.0)], now=2.0, room=0, iteration=1), duration=1.0)
    assert hook.slack.credit.balance_s == pytest.approx(0.025 * 0.004)
    both = [*routed, decode("d", now=2.5, since_first=0.0)]
    run(hook, snap(both, now=2.5, room=0, iteration=2), duration=1.0)
    earned = 0.025 * 0.004 + 0.025 * 1.0
    assert hook.slack.credit.balance_s == pytest.approx(earned)
    plan = run(hook, snap(routed, now=3.0, iteration=3))
    # budget min(credit, beta T) = 0.02 bounds the stretch: 6e-5 n <= 0.02 -> n <= 333 -> 320
    assert plan.budget == SlackBudget(0.02, BudgetReason.ROUTED_CREDIT, bounds_stretch=True)
    assert plan.num_shadow_tokens == 320
    assert plan.predicted_stretch_s == pytest.approx(320 * 6e-5)
    assert hook.slack.credit.balance_s == pytest.approx(earned - 320 * 6e-5)


def test_line7_slo_slack_and_line12_n_min():
    # sigma = 0.9 * 0.04 * 1 - 0.02 = 0.016 < beta T: 0.004 + 6e-5 n <= 0.016 -> n = 192
    batch = [decode("d", now=1.0, since_first=0.02)]
    hook, _ = make_hook(slo(n_min=256), (0.9, 4096))
    plan = run(hook, snap(batch))
    assert plan.budget.reason is BudgetReason.SLO_SLACK and not plan.budget.bounds_stretch
    assert plan.budget.budget_s == pytest.approx(0.016)
    assert plan.grants == ()  # 192 < n_min = 256
    hook, _ = make_hook(slo(n_min=0), (0.9, 4096))
    assert run(hook, snap(batch)).num_shadow_tokens == 192


def test_line11_shadow_kv_room_caps_tokens():
    hook, _ = make_hook(slo(n_min=64), (0.9, 4096))
    plan = run(hook, snap(room=100))
    assert plan.num_shadow_tokens == 96  # whole blocks of 16 within 100
    hook, _ = make_hook(slo(n_min=64), (0.9, 4096))
    assert run(hook, snap(free=40)).grants == ()  # 32 tokens < n_min


def test_line15_jobs_by_switch_probability():
    hook, _ = make_hook(slo(), (0.2, 4096), (0.9, 64), (0.5, 100))
    plan = run(hook, snap())
    # 256 tokens: all 64 of the 0.9 job, then the 0.5 job's 96 (its whole blocks), then 96 of the 0.2 job
    assert [(g.job.session_id, g.num_tokens, g.switch_probability) for g in plan.grants] == [
        ("s1", 64, 0.9), ("s2", 96, 0.5), ("s0", 96, 0.2),
    ]
    # the next plan continues where each job's held prefix ends
    plan = run(hook, snap(iteration=1))
    assert [(g.job.session_id, g.start_token) for g in plan.grants] == [("s0", 96)]


def test_partial_result_keeps_grants_on_block_boundaries():
    hook, _ = make_hook(EagerController(), (0.5, 64))
    plan = hook.begin_step(snap(free=32))
    assert [(g.start_token, g.num_tokens) for g in plan.grants] == [(0, 32)]
    # the engine computed 21 of 32 tokens: one whole block of 16 is held, the 5-token tail is not
    hook.end_step(StepOutcome("i0", 0, 0.01, [ChunkResult(plan.grants[0], 21)]))
    plan = run(hook, snap(free=32, iteration=1))
    assert [(g.start_token, g.num_tokens) for g in plan.grants] == [(16, 32)]


# -- routed-step credit -----------------------------------------------------------------------------
def _plan(budget: SlackBudget, grants=(), base=0.004, predicted=0.004) -> StepPlan:
    return StepPlan("i0", 0, budget, grants, base, predicted)


GRANT = ShadowGrant(JobKey("s", "B"), 0, 0, 16, 0.5)


@pytest.mark.parametrize("accrual", [CreditAccrual.ROUTED, CreditAccrual.ALL_DECODE])
def test_credit_accrues_on_decode_only_iterations_only(accrual):
    c = CreditAccount(0.1, accrual)
    routed = decode("r", now=1.0, since_first=0.0, kind=RequestKind.ROUTED)
    decode_only = snap([decode("d", now=1.0, since_first=0.0), routed])
    mixed = snap([routed, prefill("p", arrival=0.9, scheduled=64, remaining=0)])
    none = _plan(SlackBudget(0.0, BudgetReason.SLO_SLACK))
    c.earn(decode_only, none, StepOutcome("i0", 0, 0.05))
    assert (c.balance_s, c.earned_s) == (pytest.approx(0.005), pytest.approx(0.005))
    c.earn(mixed, none, StepOutcome("i0", 0, 0.05))  # a prefill in the batch
    c.earn(snap(), none, StepOutcome("i0", 0, 0.05))  # idle
    c.earn(decode_only, _plan(SlackBudget(1.0, BudgetReason.SLO_SLACK), [GRANT]), StepOutcome("i0", 0, 0.05))
    c.earn(decode_only, none, StepOutcome("i0", 0, 0.05, [ChunkResult(GRANT, 16)]))  # shadow computed
    assert c.balance_s == pytest.approx(0.005)
    c.earn(snap([decode("d", now=1.0, since_first=0.0)]), none, StepOutcome("i0", 0, 0.05))  # normal traffic only
    assert c.balance_s == pytest.approx(0.005 if accrual is CreditAccrual.ROUTED else 0.01)


def test_credit_accrual_reading_is_named_and_checked():
    assert SloSlackController().credit.accrual is CreditAccrual.ROUTED  # the paper's delta guarantee by default
    assert SloSlackController(credit_accrual="all-decode").credit.accrual is CreditAccrual.ALL_DECODE
    assert HarvestController().credit.accrual is CreditAccrual.ALL_DECODE  # it pays for every busy iteration
    with pytest.raises(ValueError, match="credit_accrual must be one of 'routed', 'all-decode', 'routed-prefill', not 'routd'"):
        SloSlackController(credit_accrual="routd")


def test_credit_is_spent_by_predicted_stretch_of_credit_budgets():
    c = CreditAccount(0.1, balance_s=0.005)
    c.spend(_plan(SlackBudget(0.005, BudgetReason.ROUTED_CREDIT, bounds_stretch=True), [GRANT], 0.004, 0.006))
    assert (c.balance_s, c.spent_s) == (pytest.approx(0.003), pytest.approx(0.002))
    c.spend(_plan(SlackBudget(0.005, BudgetReason.SLO_SLACK), [GRANT], 0.004, 0.006))  # not a credit budget
    c.spend(_plan(SlackBudget(0.005, BudgetReason.ROUTED_CREDIT, bounds_stretch=True)))  # no grants
    assert c.balance_s == pytest.approx(0.003)


def test_harvest_uses_credit_on_every_busy_iteration():
    h = HarvestController(beta=0.5, delta=0.1, n_min=0)
    busy = snap([decode("d", now=1.0, since_first=0.0)])
    assert h.budget(busy, LATENCY) == SlackBudget(0.0, BudgetReason.CREDIT, bounds_stretch=True)
    h.observe(busy, _plan(SlackBudget(0.0, BudgetReason.CREDIT, True)), StepOutcome("i0", 0, 0.1))
    b = h.budget(busy, LATENCY)
    assert (b.budget_s, b.reason, b.bounds_stretch) == (pytest.approx(0.01), BudgetReason.CREDIT, True)
    assert h.budget(snap(), LATENCY) == SlackBudget(0.5 * T, BudgetReason.IDLE)


# -- switch prediction ----------------------------------------------------------------------------
PAST = [("s1", "t", ["A", "B", "A", "B"]), ("s2", "t", ["A", "A", "A"])]


def test_empirical_predictor_leaves_the_predicted_session_out():
    p = EmpiricalSwitchPredictor(pseudo_count=1.0).fit(PAST)
    only_s2 = EmpiricalSwitchPredictor(pseudo_count=1.0).fit(PAST[1:])
    only_s1 = EmpiricalSwitchPredictor(pseudo_count=1.0).fit(PAST[:1])
    # s1 sees only s2's transitions out of A (A->A twice): (0 + 1) / (2 + 1 + 0 + 1)
    assert p.switch_probability("s1", "t", "A") == pytest.approx(1 / 4)
    assert p.switch_probability("s1", "t", "A") == only_s2.switch_probability("s1", "t", "A")
    assert p.next_model_distribution("s1", "t", "A", "ABC") == only_s2.next_model_distribution("s1", "t", "A", "ABC")
    # s2 sees only s1's (A->B twice): (2 + 1) / (0 + 1 + 2 + 1)
    assert p.switch_probability("s2", "t", "A") == pytest.approx(3 / 4)
    assert p.switch_probability("s2", "t", "A") == only_s1.switch_probability("s2", "t", "A")
    # a session outside the fitted set sees everything: (2 + 1) / (2 + 1 + 2 + 1)
    assert p.switch_probability("new", "t", "A") == pytest.approx(1 / 2)
    assert p.next_model_distribution("new", "t", "A", "ABC") == pytest.approx({"B": 3 / 4, "C": 1 / 4})
    # live transitions are learned online, also for a fitted session (its fitted ones stay out)
    p.observe_transition("s1", "t", "A", "B")
    assert p.switch_probability("s1", "t", "A") == pytest.approx((1 + 1) / (2 + 1 + 1 + 1))


def test_empirical_predictor_without_prior_or_data():
    p = EmpiricalSwitchPredictor(pseudo_count=0.0)
    assert p.switch_probability("s", "t", "A") == 0.5
    assert p.next_model_distribution("s", "t", "A", "ABC") == {"B": 0.5, "C": 0.5}


def test_probability_gate_keeps_targets_at_or_above_threshold():
    ranked = rank_targets(0.5, {"B": 0.5, "C": 0.3, "D": 0.2})
    assert [(t.model, t.switch_probability) for t in ranked] == [
        ("B", pytest.approx(0.25)), ("C", pytest.approx(0.15)), ("D", pytest.approx(0.1)),
    ]
    assert [t.model for t in ProbabilityGate(0.25).choose(ranked)] == ["B"]  # inclusive
    assert ProbabilityGate(0.26).choose(ranked) == []
    assert ProbabilityGate(0.0).choose(ranked) == ranked
    assert [t.model for t in TopK(2).choose(ranked)] == ["B", "C"]


def test_windowed_prefill_prices_a_long_queue_as_window_sized_prompts() -> None:
    """The placement estimate (simulator and vLLM virtual time alike) never asks the
    latency model for a prompt longer than the window: a table-based model refuses one."""
    from shadowcore.latency import chunked_prefill_s, windowed_prefill_s

    class Table:
        def predict_s(self, batch) -> float:  # batch: a BatchShape
            for c in batch.prefills:
                assert c.num_context_tokens + c.num_new_tokens <= 4096, "beyond the table"
            return 1e-4 * sum(c.num_new_tokens for c in batch.prefills)

    lat = Table()
    assert windowed_prefill_s(lat, 3000, 512, 4096) == chunked_prefill_s(lat, 3000, 512)
    assert windowed_prefill_s(lat, 3 * 4096 + 100, 512, 4096) == 3 * chunked_prefill_s(lat, 4096, 512) \
        + chunked_prefill_s(lat, 100, 512)
    import pytest

    with pytest.raises(AssertionError, match="beyond the table"):
        windowed_prefill_s(lat, 3 * 4096, 512, 0)  # no window: one impossible prompt


# -- routed_decode_margin (idle-first-host's rule, issue 16 item 7) --------------------------------
def rdm(margin: float | None, delta: float = 0.0, accrual: str = "routed") -> SloSlackController:
    return SloSlackController(beta=0.5, delta=delta, n_min=0, margin=0.1, chunk_tokens=2048,
                              credit_accrual=accrual, routed_decode_margin=margin)


def test_routed_decode_margin_budget():
    """Routed calls all decoding: the Eq. 1 slack with the routed decodes at their own margin; a routed
    prefill in the batch (or the option off): the routed-step credit (here 0)."""
    routed = decode("r", now=1.0, since_first=0.01, kind=RequestKind.ROUTED)
    # routed slack at margin 0.5: 0.5 * 0.04 - 0.01 = 0.01 (at 0.1 it would be 0.026, capped at 0.02)
    hook, _ = make_hook(rdm(0.5), (0.9, 4096))
    plan = run(hook, snap([routed]))
    assert plan.budget.reason is BudgetReason.SLO_SLACK and not plan.budget.bounds_stretch
    assert plan.budget.budget_s == pytest.approx(0.01)
    assert plan.num_shadow_tokens == 96  # 0.004 + 6e-5 n <= 0.01 -> n <= 100 -> 96 (whole blocks)
    # a normal decode with less slack still bounds it: 0.9 * 0.04 - 0.03 = 0.006
    tight = decode("d", now=1.0, since_first=0.03)
    assert run(make_hook(rdm(0.5), (0.9, 4096))[0], snap([routed, tight])).budget.budget_s == pytest.approx(0.006)
    # a routed margin below the controller's own: the controller's (0.9 * 0.04 - 0.02 = 0.016, not 0.02)
    loose = decode("r", now=1.0, since_first=0.02, kind=RequestKind.ROUTED)
    assert run(make_hook(rdm(0.0), (0.9, 4096))[0], snap([loose])).budget.budget_s == pytest.approx(0.016)
    # a routed call prefilling next to it: the credit pays (none earned), nothing planned
    routed_prefill = prefill("p", arrival=0.9, scheduled=512, remaining=0, kind=RequestKind.ROUTED)
    for controller, batch in ((rdm(0.5), [routed, routed_prefill]), (rdm(None), [routed])):
        plan = run(make_hook(controller, (0.9, 4096))[0], snap(batch))
        assert plan.budget == SlackBudget(0.0, BudgetReason.ROUTED_CREDIT, bounds_stretch=True)
        assert plan.grants == ()


# -- imminent_margin (idle-first-host's imminent-job rule, issue 16 item 7) --------------------------
def imm(imminent_margin: float, routed_margin: float | None = 0.5) -> SloSlackController:
    return SloSlackController(beta=0.5, delta=0.0, n_min=0, margin=0.1, chunk_tokens=2048,
                              routed_decode_margin=routed_margin, imminent_margin=imminent_margin)


def imminent_hook(controller, *imminent: bool):
    """``make_hook`` with one 4096-token job per flag, in falling switch probability, imminent as given."""
    hook, source = make_hook(controller, *((0.9 - 0.1 * i, 4096) for i in range(len(imminent))))
    for i, flag in enumerate(imminent):
        source.job(JobKey(f"s{i}", "B")).imminent = flag
    return hook


def test_imminent_margin_budget():
    """The first pending job imminent: routed decodes' Eq. 1 slack at imminent_margin; otherwise at
    routed_decode_margin (or, without it, the credit); a routed prefill, a waiting request: as ever."""
    routed = decode("r", now=1.0, since_first=0.015, kind=RequestKind.ROUTED)
    # imminent, margin 0.2: 0.8 * 0.04 - 0.015 = 0.017 (below beta * T = 0.02)
    plan = run(imminent_hook(imm(0.2), True), snap([routed]))
    assert plan.budget.reason is BudgetReason.SLO_SLACK and not plan.budget.bounds_stretch
    assert plan.budget.budget_s == pytest.approx(0.017)
    assert plan.num_shadow_tokens == 208  # 0.004 + 6e-5 n <= 0.017 -> n <= 216 -> 208 (whole blocks)
    # not imminent: routed_decode_margin 0.5: 0.5 * 0.04 - 0.015 = 0.005
    assert run(imminent_hook(imm(0.2), False), snap([routed])).budget.budget_s == pytest.approx(0.005)
    # only the first pending job counts (the grant starts with it): the second imminent is not enough
    assert run(imminent_hook(imm(0.2), False, True), snap([routed])).budget.budget_s == pytest.approx(0.005)
    assert run(imminent_hook(imm(0.2), True, False), snap([routed])).budget.budget_s == pytest.approx(0.017)
    # without routed_decode_margin: the credit (none) unless imminent
    off = run(imminent_hook(imm(0.2, None), False), snap([routed]))
    assert off.budget == SlackBudget(0.0, BudgetReason.ROUTED_CREDIT, bounds_stretch=True) and off.grants == ()
    assert run(imminent_hook(imm(0.2, None), True), snap([routed])).budget.budget_s == pytest.approx(0.017)
    # a margin below the controller's own: the controller's (0.9 * 0.04 - 0.02 = 0.016, not 0.02)
    loose = decode("r", now=1.0, since_first=0.02, kind=RequestKind.ROUTED)
    assert run(imminent_hook(imm(0.0), True), snap([loose])).budget.budget_s == pytest.approx(0.016)
    # a normal decode with less slack still bounds it: 0.9 * 0.04 - 0.03 = 0.006
    tight = decode("d", now=1.0, since_first=0.03)
    assert run(imminent_hook(imm(0.2), True), snap([routed, tight])).budget.budget_s == pytest.approx(0.006)
    # a routed call prefilling: the credit pays (none earned); a waiting request or a blocked admission: nothing
    routed_prefill = prefill("p", arrival=0.9, scheduled=512, remaining=0, kind=RequestKind.ROUTED)
    plan = run(imminent_hook(imm(0.2), True), snap([routed, routed_prefill]))
    assert plan.budget == SlackBudget(0.0, BudgetReason.ROUTED_CREDIT, bounds_stretch=True) and plan.grants == ()
    assert run(imminent_hook(imm(0.2), True), snap([routed], waiting=1)).budget.reason is BudgetReason.WAITING
    assert run(imminent_hook(imm(0.2), True), snap([routed], blocked=True)).budget.reason is BudgetReason.BLOCKED


def test_imminence_reaches_only_controllers_that_read_it():
    """A controller without reads_imminence is called with (snapshot, latency) only, as before."""
    class TwoArgs(SloSlackController):
        def budget(self, snapshot, latency):  # a user's controller written before the option
            return super().budget(snapshot, latency)

    assert not slo().reads_imminence and imm(0.2).reads_imminence
    routed = decode("r", now=1.0, since_first=0.015, kind=RequestKind.ROUTED)
    plan = run(imminent_hook(TwoArgs(beta=0.5, delta=0.0, n_min=0, routed_decode_margin=0.5), True), snap([routed]))
    assert plan.budget.budget_s == pytest.approx(0.005)


# -- imminent_first (idle-first-host's grant order, issue 16 item 7) ---------------------------------
def first(imminent_margin: float | None = None, on: bool = True) -> SloSlackController:
    return SloSlackController(beta=0.5, delta=0.0, n_min=0, margin=0.1, chunk_tokens=2048,
                              routed_decode_margin=0.5, imminent_margin=imminent_margin, imminent_first=on)


def flagged_hook(controller, *jobs: tuple[float, int, bool]):
    """``make_hook`` with one job per ``(switch_probability, history tokens, imminent)``."""
    hook, source = make_hook(controller, *((p, n) for p, n, _ in jobs))
    for i, (_, _, flag) in enumerate(jobs):
        source.job(JobKey(f"s{i}", "B")).imminent = flag
    return hook


def test_imminent_first_grant_order():
    """imminent_first: imminent jobs are granted before the others, each group by falling switch
    probability; off: the source's order whatever the flags. Idle: budget beta * T = 0.02 s, so
    0.004 + 6e-5 n <= 0.02 fits n = 256 tokens: four 64-token jobs whole, or the first of long ones."""
    four = ((0.9, 64, False), (0.8, 64, True), (0.7, 64, False), (0.6, 64, True))
    order = [(g.job.session_id, g.num_tokens, g.imminent) for g in run(flagged_hook(first(), *four), snap()).grants]
    assert order == [("s1", 64, True), ("s3", 64, True), ("s0", 64, False), ("s2", 64, False)]
    off = [g.job.session_id for g in run(flagged_hook(first(on=False), *four), snap()).grants]
    assert off == ["s0", "s1", "s2", "s3"]
    # the budget goes to the imminent job although a more probable one is pending
    long = ((0.9, 4096, False), (0.8, 4096, True))
    assert [(g.job.session_id, g.num_tokens) for g in run(flagged_hook(first(), *long), snap()).grants] == [("s1", 256)]
    assert [g.job.session_id for g in run(flagged_hook(first(on=False), *long), snap()).grants] == ["s0"]


def test_imminent_first_tells_the_budget_of_any_imminent_job():
    """With imminent_first the imminent rule applies when any pending job is imminent (it is first in
    the grant order): routed slack at imminent_margin 0.2, 0.8 * 0.04 - 0.015 = 0.017, granted to that
    job; the option alone reads imminence but leaves budgets as they were (routed_decode_margin 0.5:
    0.5 * 0.04 - 0.015 = 0.005)."""
    routed = decode("r", now=1.0, since_first=0.015, kind=RequestKind.ROUTED)
    two = ((0.9, 4096, False), (0.8, 4096, True))
    plan = run(flagged_hook(first(0.2), *two), snap([routed]))
    assert plan.budget.budget_s == pytest.approx(0.017) and plan.imminent_first
    assert [(g.job.session_id, g.num_tokens) for g in plan.grants] == [("s1", 208)]
    assert run(flagged_hook(first(0.2, on=False), *two), snap([routed])).budget.budget_s == pytest.approx(0.005)
    alone = first(None)
    assert alone.reads_imminence and not first(None, on=False).reads_imminence
    plan = run(flagged_hook(alone, *two), snap([routed]))
    assert plan.budget.budget_s == pytest.approx(0.005) and plan.grants[0].job.session_id == "s1"
    with pytest.raises(TypeError, match="imminent_first"):
        SloSlackController(imminent_first=1)


# -- imminent_stretch (idle-first-host's bounded request-level-like spend, issue 16 item 7) ---------
def stretch(x: float, imminent_margin: float | None = 0.2, routed_margin: float | None = 0.5,
            beta: float = 0.5) -> SloSlackController:
    return SloSlackController(beta=beta, delta=0.0, n_min=0, margin=0.1, chunk_tokens=2048,
                              routed_decode_margin=routed_margin, imminent_margin=imminent_margin,
                              imminent_stretch=x)


def test_imminent_stretch_budget_by_hand():
    """A routed decode behind the margin's pace, not its SLO's (49 steps: 0.9 * 0.04 * 50 - 1.9 < 0,
    0.04 * 50 - 1.9 = 0.1 at margin 0), the first job imminent: the iteration may last
    min((1 + x) * base, 0.9 * T = 0.036, decodes' slack at margin 0) (base 0.004 s alone): x = 1 gives
    0.008 s, 0.004 + 6e-5 n <= 0.008 -> n = 64; x = 0.5 gives 0.006 s -> n = 32. Decodes' slack at
    margin 0, a normal prefill's TTFT slack, (1 - m) * T, beta * T, the gate, a routed prefill and a
    job that is not imminent bound it."""
    behind = decode("r", now=1.0, since_first=1.9, steps=49, kind=RequestKind.ROUTED)
    plan = run(imminent_hook(stretch(1.0), True), snap([behind]))
    assert plan.budget.reason is BudgetReason.SLO_SLACK and not plan.budget.bounds_stretch
    assert plan.budget.budget_s == pytest.approx(0.008)
    assert plan.num_shadow_tokens == 64
    assert run(imminent_hook(stretch(0.5), True), snap([behind])).num_shadow_tokens == 32
    # off, or not imminent: nothing (the routed decode has no slack)
    assert run(imminent_hook(imm(0.2), True), snap([behind])).grants == ()
    assert run(imminent_hook(stretch(1.0), False), snap([behind])).grants == ()
    # decodes' slack at margin 0 bounds it: the routed decode 0.04 - 0.035 = 0.005 (behind the 0.9 pace:
    # 0.036 - 0.035 = 0.001 < base) -> 0.005: 0.004 + 6e-5 n <= 0.005 -> n = 16; a normal decode the same
    near = decode("r", now=1.0, since_first=0.035, kind=RequestKind.ROUTED)
    plan = run(imminent_hook(stretch(1.0), True), snap([near]))
    assert plan.budget.budget_s == pytest.approx(0.005) and plan.num_shadow_tokens == 16
    near_normal = decode("d", now=1.0, since_first=0.035)
    assert run(imminent_hook(stretch(1.0), True), snap([behind, near_normal])).num_shadow_tokens == 16
    # a decode behind its SLO's own pace stops it (0.04 - 0.05 < 0)
    assert run(imminent_hook(stretch(1.0), True), snap([decode("r", now=1.0, since_first=2.05, steps=49,
                                                                kind=RequestKind.ROUTED)])).grants == ()
    # a normal prefill's TTFT slack does: 50 tokens make the base 0.007 s, 2 * 0.007 = 0.014, its slack
    # 0.9 * 0.2 - (1.0 - 0.83) - 0 = 0.01 -> 0.007 + 6e-5 n <= 0.01 -> n = 48
    tight = prefill("p", arrival=0.83, scheduled=50, remaining=0, ttft=0.2)
    plan = run(imminent_hook(stretch(1.0), True), snap([behind, tight]))
    assert plan.budget.budget_s == pytest.approx(0.01) and plan.num_shadow_tokens == 48
    # beta * T caps it: a loose normal prefill of 150 tokens makes the base 0.013 s, 2 * 0.013 > 0.02 ->
    # 0.02, 0.013 + 6e-5 n <= 0.02 -> n = 112
    chunk = prefill("p", arrival=0.9, scheduled=150, remaining=0)
    plan = run(imminent_hook(stretch(1.0), True), snap([behind, chunk]))
    assert plan.budget.budget_s == pytest.approx(0.02) and plan.num_shadow_tokens == 112
    # (1 - m) * T caps it (beta 1: beta * T = 0.04): 300 tokens, base 0.022, 2 * 0.022 > 0.036 ->
    # 0.022 + 6e-5 n <= 0.036 -> n = 224
    big = prefill("p", arrival=0.9, scheduled=300, remaining=0)
    plan = run(imminent_hook(stretch(1.0, beta=1.0), True), snap([behind, big]))
    assert plan.budget.budget_s == pytest.approx(0.036) and plan.num_shadow_tokens == 224
    # a larger Eq. 1 slack wins: routed slack at imminent_margin 0.2, 0.8 * 0.04 - 0.015 = 0.017 > 0.008
    ahead = decode("r", now=1.0, since_first=0.015, kind=RequestKind.ROUTED)
    assert run(imminent_hook(stretch(1.0), True), snap([ahead])).budget.budget_s == pytest.approx(0.017)
    # alone (no margins): enabled for imminent jobs only, the routed slack otherwise left to the credit
    alone = stretch(1.0, None, None)
    assert alone.reads_imminence
    assert run(imminent_hook(alone, True), snap([behind])).num_shadow_tokens == 64
    off = run(imminent_hook(alone, False), snap([behind]))
    assert off.budget == SlackBudget(0.0, BudgetReason.ROUTED_CREDIT, bounds_stretch=True)
    # a routed prefill: the credit (none); waiting / blocked: the gate
    routed_prefill = prefill("q", arrival=0.9, scheduled=512, remaining=0, kind=RequestKind.ROUTED)
    plan = run(imminent_hook(stretch(1.0), True), snap([behind, routed_prefill]))
    assert plan.budget == SlackBudget(0.0, BudgetReason.ROUTED_CREDIT, bounds_stretch=True) and plan.grants == ()
    assert run(imminent_hook(stretch(1.0), True), snap([behind], waiting=1)).budget.reason is BudgetReason.WAITING
    assert run(imminent_hook(stretch(1.0), True), snap([behind], blocked=True)).budget.reason is BudgetReason.BLOCKED


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.5, "0.5", True, float("nan")])
def test_imminent_stretch_rejects_bad_values(bad):
    from shadow_policies.idle import idle_first_host

    with pytest.raises(ConfigError, match="imminent_stretch"):
        idle_first_host(imminent_stretch=bad)


def test_order_rule_of_the_contract_reads_imminent_first():
    """plan_problems' ``order``: (imminent, switch probability) non-increasing in a plan made
    imminent_first, switch probability alone otherwise; the hook's own plans pass."""
    from shadowcore.testing.contracts import plan_problems

    four = ((0.9, 64, False), (0.8, 64, True), (0.7, 64, False), (0.6, 64, True))
    for on in (True, False):
        plan = run(flagged_hook(first(on=on), *four), snap())
        assert plan_problems(snap(), plan, block_size=16) == []

    def made(on: bool, *grants: tuple[float, bool]) -> StepPlan:
        gs = [ShadowGrant(JobKey(f"s{i}", "B"), 0, 0, 16, p, flag) for i, (p, flag) in enumerate(grants)]
        return StepPlan("i0", 0, SlackBudget(0.02, BudgetReason.IDLE), gs, 0.004, 0.006, imminent_first=on)

    def order_problems(plan: StepPlan) -> list[str]:
        return [p for p in plan_problems(snap(), plan, block_size=16) if p.startswith("order")]

    assert order_problems(made(True, (0.8, True), (0.9, False))) == []
    assert order_problems(made(False, (0.9, False), (0.8, True))) == []
    assert order_problems(made(True, (0.9, False), (0.8, True)))  # a non-imminent grant before an imminent one
    assert order_problems(made(True, (0.6, True), (0.8, True)))  # within the imminent group
    assert order_problems(made(False, (0.8, True), (0.9, False)))  # imminence first without the option


def test_routed_prefill_credit_accrual():
    """credit_accrual="routed-prefill": only iterations in which a routed call prefills earn (delta of
    their duration); the credit then pays for the next one."""
    routed_prefill = prefill("p", arrival=0.9, scheduled=512, remaining=512, kind=RequestKind.ROUTED)
    routed = decode("r", now=1.0, since_first=0.01, kind=RequestKind.ROUTED)
    hook, _ = make_hook(rdm(0.5, delta=0.1, accrual="routed-prefill"))  # no job: nothing planned
    run(hook, snap([routed]), duration=1.0)  # routed decodes only: not this credit's kind
    run(hook, snap([decode("d", now=1.0, since_first=0.0)]), duration=1.0)
    assert hook.slack.credit.earned_s == 0.0
    run(hook, snap([routed_prefill, routed]), duration=0.5)
    assert hook.slack.credit.earned_s == pytest.approx(0.05)
    assert not hook.slack.credit.accrues(True, True)  # a skipped step (all decoding) never earns
    fresh, _ = make_hook(rdm(0.5, delta=0.1, accrual="routed-prefill"), (0.9, 4096))
    fresh.slack.credit.balance_s = 0.01
    plan = run(fresh, snap([routed_prefill]))
    assert plan.budget == SlackBudget(0.01, BudgetReason.ROUTED_CREDIT, bounds_stretch=True)
    assert plan.predicted_stretch_s <= 0.01 + 1e-12 and plan.num_shadow_tokens > 0
