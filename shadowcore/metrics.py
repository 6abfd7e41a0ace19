"""[5] Metrics: observers with optional ``on_*`` hooks.

An observer implements any subset of the hooks below. :class:`ObserverSet`
calls them in registration order and guards each call: an observer that raises
is reported once (``warnings``), its error kept in ``errors``, and it is
detached; the engine never sees the exception. Observers must not mutate what
they are given (everything they get is frozen).

Hooks (all optional):

* ``on_plan(snapshot, plan)`` after a hook planned an iteration;
* ``on_step_end(snapshot, plan, outcome)`` after the engine reported it;
* ``on_batch(report)`` after the engine scheduled a planned iteration: a
  :class:`~shadowcore.backend.BatchReport` of what it runs (the backend
  contract, :mod:`shadowcore.backend`);
* ``on_call_placed(placement)`` when the router side placed a routed call;
* ``on_call_finished(record)`` when a backend finished a routed or normal call.
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

import attrs

from shadowcore.types import StepOutcome, StepPlan, StepSnapshot

HOOK_NAMES = ("on_plan", "on_step_end", "on_batch", "on_call_placed", "on_call_finished")


@attrs.define(eq=False)
class ObserverSet:
    observers: list[Any] = attrs.Factory(list)
    errors: list[tuple[Any, BaseException]] = attrs.Factory(list)

    def add(self, observer: Any) -> None:
        if not any(callable(getattr(observer, h, None)) for h in HOOK_NAMES):
            raise TypeError(f"{observer!r} implements none of {', '.join(HOOK_NAMES)}")
        self.observers.append(observer)

    def emit(self, hook: str, *args: Any) -> None:
        for observer in list(self.observers):
            fn = getattr(observer, hook, None)
            if fn is None:
                continue
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - an observer must not break the engine
                self.errors.append((observer, exc))
                self.observers.remove(observer)
                warnings.warn(
                    f"observer {observer!r} raised in {hook} and was detached: {exc!r}",
                    RuntimeWarning,
                    stacklevel=2,
                )


@attrs.define(eq=False)
class ShadowRecorder:
    """Counts what the hooks planned and what engines computed."""

    num_steps: int = 0
    num_steps_with_shadow: int = 0
    num_planned_tokens: int = 0
    num_computed_tokens: int = 0
    busy_s: float = 0.0
    budget_reasons: Counter = attrs.Factory(Counter)
    per_instance_tokens: Counter = attrs.Factory(Counter)

    def on_plan(self, snapshot: StepSnapshot, plan: StepPlan) -> None:
        self.budget_reasons[plan.budget.reason.value] += 1
        self.num_planned_tokens += plan.num_shadow_tokens

    def on_step_end(self, snapshot: StepSnapshot, plan: StepPlan, outcome: StepOutcome) -> None:
        self.num_steps += 1
        self.busy_s += outcome.duration_s
        if outcome.num_shadow_tokens:
            self.num_steps_with_shadow += 1
            self.num_computed_tokens += outcome.num_shadow_tokens
            self.per_instance_tokens[outcome.instance_id] += outcome.num_shadow_tokens
