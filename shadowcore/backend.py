"""The backend contract: what a backend of shadowprefill must do and report.

A *backend* runs a workload (sessions and normal traffic; each backend says
which values it accepts) under one shadow policy and returns a
:class:`RunResult`. Inside, every engine instance drives one
:class:`~shadowcore.hook.EngineHook` through its plan/commit protocol
(``begin_step`` / ``end_step``) and answers the hook's
:class:`~shadowcore.hook.EnginePort`. The observers a caller passes see what
happened, and :func:`shadowcore.testing.check_backend` holds a backend to
this contract from nothing else.

What a backend must guarantee (each is one check of ``check_backend``):

* **Plans honoured**: shadow tokens run only for the plan's grants, never
  more than a grant's ``num_tokens``, and each grant is reported back in the
  step's :class:`~shadowcore.types.StepOutcome` (``ChunkResult``: computed
  tokens, 0 when the chunk was dropped), within the same iteration.
* **Shadow last**: in every planned iteration the shadow chunks come after
  all normal and routed work of the batch.
* **KV classes**: the instance's shadow-class blocks never exceed the shadow
  cap (:meth:`~shadowcore.kv.KVClassPolicy.cap_blocks`).
* **First tokens**: every routed call the run served has a record with its
  time to first token (finite, not negative, at most its latency).
* **Determinism**: the same workload and configuration (seed included) give
  the same result and the same plans, run after run.

What a backend must report to the observers it is given (besides the hook's
own ``on_plan`` and ``on_step_end``, which reach them when they are in the
hook's :class:`~shadowcore.metrics.ObserverSet`): after scheduling each
planned iteration, and before its ``end_step``, one ``on_batch`` with a
:class:`BatchReport` of what the iteration runs, in batch order. Reporting is
only owed while an observer listens, so a backend may skip building it
otherwise.

Invariant of this module: it only declares (Protocols and frozen values); it
imports nothing beyond the core's types.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from shadowcore._validators import non_negative_int
from shadowcore.config import ShadowConfig
from shadowcore.types import JobKey

#: ``BatchEntry.kind`` values.
BATCH_KINDS = ("routed", "normal", "shadow")


@attrs.frozen
class BatchEntry:
    """One request of an iteration's batch: ``num_tokens`` scheduled for it.

    ``request_id`` is the backend's; ``job`` is the shadow job a ``"shadow"``
    entry computes for (None for the other kinds)."""

    request_id: str
    kind: str = attrs.field(validator=attrs.validators.in_(BATCH_KINDS))
    num_tokens: int = attrs.field(validator=non_negative_int)
    job: JobKey | None = None


@attrs.frozen
class BatchReport:
    """What one planned iteration of one instance runs (``on_batch``).

    ``entries`` in the order the batch runs them; ``num_shadow_blocks``: the
    instance's shadow-class KV blocks once the iteration is scheduled (shadow
    chunks allocated), ``shadow_cap_blocks`` the most it may hold."""

    instance_id: str
    iteration: int
    entries: tuple[BatchEntry, ...]
    num_shadow_blocks: int = attrs.field(validator=non_negative_int)
    shadow_cap_blocks: int = attrs.field(validator=non_negative_int)


class CallResult(Protocol):
    """One routed call as a backend reports it."""

    session_id: str
    call_index: int
    model: str
    arrival_s: float
    ttft_s: float  # time to first token
    latency_s: float  # arrival to last token


class RunResult(Protocol):
    """What :meth:`Backend.run` returns (``shadowcore.engine.scenario.ScenarioResult``
    is one): the policy's name, one record per routed call, and the run's metrics."""

    policy: str
    calls: Sequence[CallResult]
    metrics: Mapping[str, float]


@runtime_checkable
class Backend(Protocol):
    """Port: a backend (``shadowprefill.backends`` entry point).

    ``run`` executes ``workload`` under ``shadow`` (the policy, its arguments
    and the seed) and registers every one of ``observers`` where all of the
    run's hooks report to it; it keeps the guarantees of this module's
    docstring. Bad input is one :class:`~shadowcore.errors.ConfigError`
    naming the field."""

    name: str

    def run(self, workload: Any, shadow: ShadowConfig, observers: Sequence[Any] = ()) -> RunResult:
        ...


__all__ = ["BATCH_KINDS", "Backend", "BatchEntry", "BatchReport", "CallResult", "RunResult"]
