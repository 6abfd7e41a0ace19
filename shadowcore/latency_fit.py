"""A latency model that fits the engine it runs on: an engine hook observer
that refits the hook's latency model from the engine's measured iterations.

:class:`OnlineLatencyFit` keeps the last ``window`` planned iterations (batch
shape with the shadow tokens the engine computed, measured duration), and
every ``every`` iterations, once it has ``min_steps``, fits a new model:
a :class:`~shadowcore.latency.LinearLatencyModel` by non-negative least
squares when the current one is linear (:func:`~shadowcore.calibration.fit_linear`),
otherwise a :class:`~shadowcore.calibration.LatencyProfile` over the model it
started with (:func:`~shadowcore.calibration.fit_profile`).

Invariants (bounded and logged):

* memory is bounded by ``window`` steps; a refit costs a fixed number of
  least-squares solves on at most ``window`` rows;
* a fitted model replaces the hook's only when its median absolute relative
  error on the window is lower than the current model's (a refit never makes
  the predictions of what was measured worse); every refit, taken or not, is
  one log line with both errors and the new coefficients, and counted;
* the hook reads its latency model at each ``begin_step``, and this observer
  replaces it only in ``on_step_end``, so a plan and its predictions use one
  model;
* the smallest grant's reachability (:func:`~shadowcore.diagnostics.unreachable_grant`)
  is rechecked after each taken refit and logged when it changes.

Opt-in: a run with it plans from measured timing, so its plans are no longer
a function of the snapshots alone (the reason the fixed linear model is the
vLLM default).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from shadowcore._validators import positive_int
from shadowcore.calibration import MeasuredStep, fit_linear, fit_profile, prediction_errors
from shadowcore.diagnostics import unreachable_grant
from shadowcore.latency import LatencyModel, LinearLatencyModel, PrefillChunk
from shadowcore.types import StepOutcome, StepPlan, StepSnapshot

logger = logging.getLogger(__name__)


def _at_least_five(_inst: Any, attribute: attrs.Attribute, value: int) -> None:
    positive_int(_inst, attribute, value)
    if value < 5:
        from shadowcore.errors import ConfigError

        raise ConfigError(attribute.name, value, "must be >= 5 (a linear model has 5 coefficients)")


@attrs.define(eq=False)
class OnlineLatencyFit:
    """Observer of one hook (``hook.observers.add(fit)``); see the module docstring.

    ``tpot_slo_s`` (when given) is the instance's TPOT SLO, for the
    reachability recheck; ``log`` receives every line (default: this module's
    logger at INFO, warnings for reachability changes)."""

    hook: Any  # the EngineHook whose ``latency`` it refits
    min_steps: int = attrs.field(default=32, validator=_at_least_five)
    every: int = attrs.field(default=32, validator=positive_int)
    window: int = attrs.field(default=512, validator=_at_least_five)
    tpot_slo_s: float | None = None
    log: Callable[[int, str], None] = attrs.field(default=lambda level, msg: logger.log(level, "%s", msg))
    steps: deque[MeasuredStep] = attrs.field(init=False)
    base: LatencyModel = attrs.field(init=False)
    num_refits: int = attrs.field(init=False, default=0)
    num_kept: int = attrs.field(init=False, default=0)
    last_error: float | None = attrs.field(init=False, default=None)
    _since: int = attrs.field(init=False, default=0)
    _reachable: bool | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        self.steps = deque(maxlen=self.window)
        self.base = self.hook.latency

    def on_plan(self, snapshot: StepSnapshot, plan: StepPlan) -> None:
        pass

    def on_step_end(self, snapshot: StepSnapshot, plan: StepPlan, outcome: StepOutcome) -> None:
        chunks = tuple(PrefillChunk(r.num_computed_tokens, r.grant.start_token)
                       for r in outcome.results if r.num_computed_tokens)
        batch = snapshot.batch_shape.with_prefills(chunks)
        if batch.is_empty or outcome.duration_s <= 0:
            return
        self.steps.append(MeasuredStep(batch, outcome.duration_s))
        self._since += 1
        if len(self.steps) >= self.min_steps and self._since >= self.every:
            self._since = 0
            self.refit()

    def refit(self) -> bool:
        """Fit on the window now; True when the fitted model replaced the hook's."""
        steps = list(self.steps)
        current = self.hook.latency
        if isinstance(self.base, LinearLatencyModel):
            fitted: LatencyModel = fit_linear(steps)
        else:
            fitted = fit_profile(self.base, steps, source=f"online fit to {len(steps)} steps").apply(self.base)
        old = float(np.median(np.abs(prediction_errors(current, steps))))
        new = float(np.median(np.abs(prediction_errors(fitted, steps))))
        taken = new < old
        what = f"{self.hook.instance_id}: latency refit on {len(steps)} measured steps: median |error| " \
               f"{old:.1%} -> {new:.1%} ({'taken' if taken else 'kept the current model'}): {fitted!r}"
        self.log(logging.INFO, what)
        if not taken:
            self.num_kept += 1
            return False
        self.hook.latency = fitted
        self.num_refits += 1
        self.last_error = new
        self._recheck()
        return True

    def _recheck(self) -> None:
        if self.tpot_slo_s is None:
            return
        why = unreachable_grant(self.hook.slack, self.hook.latency, self.hook.port.block_size, self.tpot_slo_s)
        reachable = why is None
        if reachable != self._reachable:
            self._reachable = reachable
            self.log(logging.WARNING, f"{self.hook.instance_id}: after the latency refit "
                     + ("the smallest grant fits a budget: shadow work can be planned" if reachable else why))


__all__ = ["OnlineLatencyFit"]
