"""The steady-decode fast path's pieces give exactly what the slow path gives.

* ``predict_decodes_s(num_decodes, total, longest)`` of every latency model is
  bit-identical to ``predict_s`` of the decode-only batch (or ``None`` when the
  model cannot tell from aggregates), and raises the same coverage errors.
* The engines skip steps of the core's own slack controllers only, by exact
  type (``shadowcore.engine._fastpath``): a subclass is always planned.
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest
from shadow_sim.models import MODELS
from shadow_sim.roofline import RooflineLatencyModel

from shadowcore.engine import _fastpath
from shadowcore.latency import BatchShape, LinearLatencyModel
from shadowcore.slack import (
    EagerController,
    HarvestController,
    NoShadowController,
    PrefillInstanceController,
    SlackController,
    SloSlackController,
)


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


def test_linear_model_aggregate_is_bit_identical() -> None:
    assert _check(LinearLatencyModel(), _batches(100_000)) > 50
    assert LinearLatencyModel().predict_decodes_s(0, 0, 0) is None


@pytest.mark.parametrize("name", ["Llama-3.1-8B", "Qwen2.5-7B", "Llama-3.1-70B"])
def test_roofline_aggregate_is_bit_identical(name: str) -> None:
    model = RooflineLatencyModel.for_model(name, "H100-80GB")
    assert _check(model, _batches(100_000)) > 50


def test_roofline_windowed_model_declines() -> None:
    windowed = [m for m, cfg in MODELS.items() if cfg.sliding_window]
    assert windowed
    model = RooflineLatencyModel.for_model(windowed[0], "H200")
    assert model.predict_decodes_s(4, 4000, 1000) is None


def test_vidur_aggregate_is_bit_identical_and_raises_alike() -> None:
    pytest.importorskip("vidur")
    from shadow_sim.vidur_latency import VidurLatencyModel
    from shadow_sim.vidur_profiles import ProfileCoverageError

    model = VidurLatencyModel.for_model("Llama-3.1-8B", "H100-80GB", 1, progress=False)
    limit = model._rt["kv_limit"]
    batches = [b for b in _batches(limit) if max(b) <= limit]
    batches += [tuple([limit // 300] * 250), tuple([70_000] * 3)]  # geometric columns beyond 65,536
    assert _check(model, batches) > 50
    too_long = (limit + 1,)
    with pytest.raises(ProfileCoverageError):
        model.predict_s(BatchShape((), too_long))
    with pytest.raises(ProfileCoverageError):
        model.predict_decodes_s(1, limit + 1, limit + 1)


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
