"""The steady-decode fast path's pieces give exactly what the slow path gives.

* ``predict_decodes_s(num_decodes, total, longest)`` of every latency model is
  bit-identical to ``predict_s`` of the decode-only batch (or ``None`` when the
  model cannot tell from aggregates), and raises the same coverage errors;
  ``predict_batch_s(prefills, num_decodes, total, longest)`` likewise for any batch.
* The cohort's decode deadlines give the sign of Eq. 1's minimum slack exactly.
* The engines skip steps of the core's own slack controllers only, by exact
  type (``shadowcore.engine._fastpath``): a subclass is always planned.
"""

from __future__ import annotations

import bisect
import contextlib

import attrs
import numpy as np
import pytest
from shadow_sim.models import MODELS
from shadow_sim.roofline import RooflineLatencyModel

from shadowcore.engine import _fastpath
from shadowcore.engine._deadlines import DecodeDeadlines
from shadowcore.latency import BatchShape, LinearLatencyModel, PrefillChunk
from shadowcore.slack import (
    EagerController,
    HarvestController,
    NoShadowController,
    PrefillInstanceController,
    SlackController,
    SloSlackController,
    decode_slack_s,
)
from shadowcore.types import Phase, RequestKind, RequestView


def _batches(max_context: int, seed: int = 0) -> list[tuple[int, ...]]:
    rng = np.random.default_rng(seed)
    out = [(1,), (0,), (max_context,), tuple([255] * 8), tuple([256] * 8), tuple([65536 // 4] * 4)]
    for n in (1, 2, 3, 7, 16, 64, 200, 256):
        for _ in range(6):
            out.append(tuple(int(x) for x in rng.integers(0, max_context // max(1, n // 8) + 1, size=n)))
    return out


def _check(model, batches) -> int:
    exact = 0
    for ctx in batches:
        fast = model.predict_decodes_s(len(ctx), sum(ctx), max(ctx))
        if fast is None:
            continue
        slow = model.predict_s(BatchShape((), ctx))
        assert fast == slow, (ctx[:4], len(ctx), fast, slow)
        exact += 1
    return exact


def _check_mixed(model, batches, seed: int = 1) -> int:
    """predict_batch_s on the aggregates of each batch with 0-3 prefill chunks == predict_s."""
    rng = np.random.default_rng(seed)
    exact = 0
    for i, ctx in enumerate(batches):
        pre = tuple(PrefillChunk(int(rng.integers(1, 1024)), int(rng.integers(0, 4096))) for _ in range(i % 4))
        if i % 5 == 0:
            ctx = ()
        fast = model.predict_batch_s(pre, len(ctx), sum(ctx), max(ctx) if ctx else 0)
        if fast is None:
            continue
        slow = model.predict_s(BatchShape(pre, ctx))
        assert fast == slow, (ctx[:4], len(ctx), pre, fast, slow)
        exact += 1
    return exact


def test_linear_model_aggregate_is_bit_identical() -> None:
    assert _check(LinearLatencyModel(), _batches(100_000)) > 50
    assert _check_mixed(LinearLatencyModel(), _batches(100_000)) > 50
    assert LinearLatencyModel().predict_decodes_s(0, 0, 0) is None


@pytest.mark.parametrize("name", ["Llama-3.1-8B", "Qwen2.5-7B", "Llama-3.1-70B"])
def test_roofline_aggregate_is_bit_identical(name: str) -> None:
    model = RooflineLatencyModel.for_model(name, "H100-80GB")
    assert _check(model, _batches(100_000)) > 50
    assert _check_mixed(model, _batches(100_000)) > 50


def test_roofline_windowed_model_declines() -> None:
    windowed = [m for m, cfg in MODELS.items() if cfg.sliding_window]
    assert windowed
    model = RooflineLatencyModel.for_model(windowed[0], "H200")
    assert model.predict_decodes_s(4, 4000, 1000) is None
    assert model.predict_batch_s((), 4, 4000, 1000) is None


def test_vidur_aggregate_is_bit_identical_and_raises_alike() -> None:
    pytest.importorskip("vidur")
    from shadow_sim.vidur_latency import VidurLatencyModel
    from shadow_sim.vidur_profiles import ProfileCoverageError

    model = VidurLatencyModel.for_model("Llama-3.1-8B", "H100-80GB", 1, progress=False)
    limit = model._rt["kv_limit"]
    batches = [b for b in _batches(limit) if max(b) <= limit]
    batches += [tuple([limit // 300] * 250), tuple([70_000] * 3)]  # geometric columns beyond 65,536
    assert _check(model, batches) > 50
    assert _check_mixed(model, [b for b in batches if max(b) + 5120 <= limit and len(b) <= 200]) > 30
    too_long = (limit + 1,)
    with pytest.raises(ProfileCoverageError):
        model.predict_s(BatchShape((), too_long))
    with pytest.raises(ProfileCoverageError):
        model.predict_decodes_s(1, limit + 1, limit + 1)
    with pytest.raises(ProfileCoverageError):
        model.predict_batch_s((PrefillChunk(16, 0),), 1, limit + 1, limit + 1)


def test_skippable_only_by_exact_type() -> None:
    """The engines skip steps of the core's own controllers only, by exact
    type: a subclass (which may override anything) is always planned."""
    for cls in (SloSlackController, HarvestController, EagerController, NoShadowController,
                PrefillInstanceController):
        assert _fastpath.skippable(cls()) is not None, cls
    assert _fastpath.skippable(NoShadowController()).never_grants
    assert not _fastpath.skippable(SloSlackController()).never_grants

    @attrs.define
    class Observing(SloSlackController):
        def observe(self, snapshot, plan, outcome) -> None:  # state the engine cannot account for
            super().observe(snapshot, plan, outcome)

    @attrs.define
    class Plain(NoShadowController):
        pass

    assert _fastpath.skippable(Observing()) is None and _fastpath.skippable(Plain()) is None
    assert not any(hasattr(SlackController, n) for n in ("skippable", "observe_skipped"))


@pytest.mark.parametrize("accrual", ["routed", "all-decode"])
def test_credit_of_skipped_steps_matches_observed_steps(accrual: str) -> None:
    a, b = SloSlackController(credit_accrual=accrual), SloSlackController(credit_accrual=accrual)
    for d in (0.0123, 0.0456, 1e-3, 0.1):
        skip = _fastpath.skippable(a).observe_skipped
        skip(a, d, True, True)
        skip(a, d, False, True)  # not decode-only: no credit
        skip(a, d, True, False)  # no routed call: credit only under "all-decode"
        b.credit.earn_s(d)
        if accrual == "all-decode":
            b.credit.earn_s(d)
    assert (a.credit.balance_s, a.credit.earned_s) == (b.credit.balance_s, b.credit.earned_s) != (0.0, 0.0)


@attrs.define(eq=False)
class _Member:
    """What DecodeDeadlines reads of a cohort member."""

    tpot_slo_s: float
    first_token_s: float
    num_generated: int
    lazy_base: int
    run_seq: int
    finish_s: float | None = None


def test_deadline_heap_gives_the_exact_minimum_slack() -> None:
    """min_slack_s == min(decode_slack_s(view)) over live members, bit for
    bit, also among members whose deadlines are within ulps of each other
    (two TPOT SLOs, finished members left in the heaps): not merely the
    member with the smallest heap key."""
    rng = np.random.default_rng(5)
    ties = 0
    for trial in range(300):
        margin = float(rng.choice([0.0, 0.1, 0.25]))
        d = DecodeDeadlines(margin)
        clock = int(rng.integers(0, 50_000))
        members = []
        for i in range(int(rng.integers(1, 60))):
            tpot = float(rng.choice([0.05, 0.1]))
            base = int(rng.integers(0, clock + 1))
            m = _Member(tpot, float(rng.uniform(0, 3000)), int(rng.integers(1, 300)), base, 2 * i)
            members.append(m)
            if i % 3 == 0:  # a twin: the same deadline in real numbers (k tokens later, c k earlier), rounded apart
                k = int(rng.integers(1, 200))
                c = (1.0 - margin) * tpot
                members.append(_Member(tpot, m.first_token_s - c * k, m.num_generated + k, base, 2 * i + 1))
        for m in members:
            d.add(m)
        for m in members[::7]:
            m.finish_s = 1.0
        live = [m for m in members if m.finish_s is None]
        now = float(rng.uniform(0, 6000))
        views = [RequestView("r", RequestKind.NORMAL, Phase.DECODE, 0.0, 1, 10, 1.0, m.tpot_slo_s, 0,
                             m.first_token_s, m.num_generated + clock - m.lazy_base - 1) for m in live]
        want = min((decode_slack_s(v, now, margin) for v in views), default=float("inf"))
        got = d.min_slack_s(now, clock)
        assert got == want, (trial, got, want)
        ties += sum(1 for v in views if abs(decode_slack_s(v, now, margin) - want) < 1e-9) > 1
    assert ties > 20, ties


def _run_one_by_one(model, nd: int, total: int, longest: int, num: int) -> list[float]:
    """decode_run_s's rule written out: each step's predict_decodes_s until one gives None or raises."""
    out = []
    for k in range(1, num + 1):
        try:
            d = model.predict_decodes_s(nd, total + k * nd, longest + k)
        except Exception:  # noqa: BLE001
            break
        if d is None:
            break
        out.append(d)
    return out


def test_vidur_decode_run_equals_its_steps_one_by_one() -> None:
    """VidurLatencyModel.predict_decode_run_s (one lookup per table cell) gives exactly the
    steps' predict_decodes_s, across dense and geometric columns, up to the context limit,
    and nothing for batches no step can time; decode_run_s dispatches to it."""
    pytest.importorskip("vidur")
    from shadow_sim.vidur_latency import VidurLatencyModel

    from shadowcore.latency import decode_run_s

    model = VidurLatencyModel.for_model("Llama-3.1-8B", "H100-80GB", 1, progress=False)
    limit, bmax = model._rt["kv_limit"], model._rt["bmax"]
    rng = np.random.default_rng(3)
    cases = [(1, 0, 0, 600), (3, 65_000, 30_000, 400), (7, 255, 100, 300), (250, 60_000, 400, 256),
             (2, 2 * limit - 40, limit - 20, 100), (1, limit, limit, 5), (bmax + 1, 10, 10, 5), (0, 0, 0, 5)]
    for _ in range(60):
        nd = int(rng.integers(1, bmax + 1))
        longest = int(rng.integers(0, limit))
        total = int(rng.integers(longest, longest * nd + 1))
        cases.append((nd, total, longest, int(rng.integers(0, 300))))
    cells = 0
    for nd, total, longest, num in cases:
        want = _run_one_by_one(model, nd, total, longest, num)
        got = model.predict_decode_run_s(nd, total, longest, num)
        assert got == want, (nd, total, longest, num)
        assert decode_run_s(model, nd, total, longest, num) == want
        cells += len(set(want))
    assert cells > 100  # the runs cross many cells, not one value each
    assert model.predict_decode_run_s(2, 2 * limit - 40, limit - 20, 100) == want_short(model, limit)


def want_short(model, limit: int) -> list[float]:
    """A run that reaches the context limit stops there: 20 steps of 100."""
    out = _run_one_by_one(model, 2, 2 * limit - 40, limit - 20, 100)
    assert len(out) == 20
    return out


def test_decode_run_without_a_run_method_steps_one_by_one() -> None:
    from shadowcore.latency import decode_run_s

    model = LinearLatencyModel()
    assert decode_run_s(model, 5, 1000, 300, 40) == _run_one_by_one(model, 5, 1000, 300, 40)
    assert len(decode_run_s(model, 5, 1000, 300, 40)) == 40
    assert decode_run_s(model, 0, 0, 0, 10) == []


def test_vidur_decode_span_gives_each_step_its_value() -> None:
    """VidurLatencyModel.predict_decode_span_s: its value is this step's predict_decodes_s and
    every step of its span gives exactly that value without raising, across dense and
    geometric columns and up to the context limit; the spans are the table's cells, so one
    step past a span the cell (or the limit) has changed; it raises where the step does."""
    pytest.importorskip("vidur")
    from shadow_sim.vidur_latency import _DENSE_S, VidurLatencyModel
    from shadow_sim.vidur_profiles import ProfileCoverageError

    model = VidurLatencyModel.for_model("Llama-3.1-8B", "H100-80GB", 1, progress=False)
    limit, bmax, geo = model._rt["kv_limit"], model._rt["bmax"], model._rt["geo"]

    def cell(total: int) -> int:
        return (total + 255) >> 8 if total <= _DENSE_S else 257 + bisect.bisect_left(geo, total)

    rng = np.random.default_rng(5)
    cases = [(1, 0, 0), (3, 65_000, 30_000), (7, 255, 100), (250, 60_000, 400), (2, 2 * limit - 40, limit - 20),
             (1, limit, limit), (4, _DENSE_S, 20_000), (5, _DENSE_S + 1, 20_000)]
    for _ in range(80):
        nd = int(rng.integers(1, bmax + 1))
        longest = int(rng.integers(0, limit))
        cases.append((nd, int(rng.integers(longest, longest * nd + 1)), longest))
    steps = 0
    for nd, total, longest in cases:
        d, m = model.predict_decode_span_s(nd, total, longest)
        assert m >= 1 and d == model.predict_decodes_s(nd, total, longest), (nd, total, longest)
        for k in range(m):
            assert model.predict_decodes_s(nd, total + k * nd, longest + k) == d, (nd, total, longest, k)
        assert longest + m > limit or cell(total + m * nd) != cell(total), (nd, total, longest, m)  # the whole cell
        with contextlib.suppress(ProfileCoverageError):
            model.predict_decodes_s(nd, total + m * nd, longest + m)  # the next cell memoised too
        # asked again, from the memo: the same span, and from its last step a span of one
        assert model.predict_decode_span_s(nd, total, longest) == (d, m), (nd, total, longest)
        assert model.predict_decode_span_s(nd, total + (m - 1) * nd, longest + m - 1) == (d, 1), (nd, total, longest)
        steps += m

    assert steps > 20 * len(cases)  # spans of many steps, not one each
    assert model.predict_decode_span_s(2, 2 * limit - 40, limit - 20) == (want_short(model, limit)[0], 21)
    for bad in ((bmax + 1, 10, 10), (1, limit + 1, limit + 1)):
        with pytest.raises(ProfileCoverageError):
            model.predict_decodes_s(*bad)
        with pytest.raises(ProfileCoverageError):
            model.predict_decode_span_s(*bad)
    assert model.predict_decode_span_s(0, 0, 0) == (None, 1)
