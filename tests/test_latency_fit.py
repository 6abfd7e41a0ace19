"""OnlineLatencyFit: a refit replaces the hook's model only when it predicts
the measured steps better, memory stays within the window, and a policy that
could not plan becomes able to once the model fits the engine."""

from __future__ import annotations

import logging

import pytest

from shadowcore.errors import ConfigError
from shadowcore.hook import EngineHook
from shadowcore.latency import LinearLatencyModel
from shadowcore.latency_fit import OnlineLatencyFit
from shadowcore.slack import SloSlackController
from shadowcore.testing.stubs import StubEnginePort, StubJobSource
from shadowcore.types import Phase, RequestKind, RequestView, StepOutcome, StepSnapshot

FAST = LinearLatencyModel(0.001, 8e-6, 1e-9, 2e-5, 1e-8)  # an engine 3x faster than the default model


def _drive(hook: EngineHook, engine: LinearLatencyModel, n: int) -> None:
    """``n`` iterations of varied prefill + decode batches, timed by ``engine``."""
    for i in range(n):
        batch = (RequestView(f"p{i}", RequestKind.NORMAL, Phase.PREFILL, 0.0, 64 * (1 + i % 9), 128 * (i % 5),
                             1.0, 0.025, num_remaining_prefill_tokens=0),) + tuple(
            RequestView(f"d{i}.{k}", RequestKind.NORMAL, Phase.DECODE, 0.0, 1, 500 + 300 * k, 1.0, 0.025,
                        first_token_s=0.0) for k in range(i % 4))
        snap = StepSnapshot("i0", i, 0.0, batch, 1, False, 0.025, 0, 0)  # waiting: no shadow budget
        hook.begin_step(snap)
        hook.end_step(StepOutcome("i0", i, engine.predict_s(snap.batch_shape)))


def _hook(model: LinearLatencyModel, beta: float = 0.25) -> EngineHook:
    return EngineHook("i0", StubJobSource(), SloSlackController(beta=beta), model, StubEnginePort(16))


def test_a_refit_fits_a_faster_engine_and_makes_its_policy_reachable() -> None:
    hook = _hook(LinearLatencyModel())
    lines: list[tuple[int, str]] = []
    fit = OnlineLatencyFit(hook, min_steps=16, every=16, window=40, tpot_slo_s=0.025,
                           log=lambda level, msg: lines.append((level, msg)))
    hook.observers.add(fit)
    _drive(hook, FAST, 64)
    assert fit.num_refits >= 1 and len(fit.steps) == 40  # bounded by the window
    assert attrs_tuple(hook.latency) == pytest.approx(attrs_tuple(FAST), rel=1e-6, abs=1e-12)
    assert fit.last_error is not None and fit.last_error < 1e-6
    assert any(level == logging.WARNING and "shadow work can be planned" in msg for level, msg in lines)
    assert sum("latency refit on" in msg for _, msg in lines) == fit.num_refits + fit.num_kept


def attrs_tuple(m: LinearLatencyModel) -> tuple[float, ...]:
    return (m.overhead_s, m.prefill_s_per_token, m.attention_s_per_token_pair, m.decode_s_per_seq,
            m.decode_s_per_context_token)


def test_a_model_that_already_fits_is_kept() -> None:
    hook = _hook(FAST)
    fit = OnlineLatencyFit(hook, min_steps=16, every=16, log=lambda level, msg: None)
    hook.observers.add(fit)
    _drive(hook, FAST, 48)
    assert fit.num_refits == 0 and fit.num_kept == 3 and hook.latency is FAST


def test_settings_are_validated() -> None:
    with pytest.raises(ConfigError, match="min_steps"):
        OnlineLatencyFit(_hook(FAST), min_steps=3)
    with pytest.raises(ConfigError, match="every"):
        OnlineLatencyFit(_hook(FAST), every=0)
