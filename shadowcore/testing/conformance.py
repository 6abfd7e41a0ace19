"""A conformance check any policy can be run through (like Gymnasium's
``check_env``): ``check_policy("my_pkg.policy:factory")`` returns a
:class:`ConformanceReport` or raises :class:`ConformanceError` listing every
violation it found.

It applies the rules of :mod:`shadowcore.testing.contracts` in three phases,
cheapest first, and stops after the first phase that found a violation:

1. **Strategy probes** (milliseconds): the policy's switch predictor is asked
   about four models, several sessions and tasks, before and after a scripted
   series of transitions; its targeting chooses from ranked lists of one to
   four candidates (ties and zero probabilities included).
2. **Controller probe** (milliseconds): one :class:`~shadowcore.hook.EngineHook`
   with the policy's slack controller, the fake engine's latency model, a
   stub port and four pending jobs, driven through a fixed script of
   snapshots that the in-memory engine rarely or never shows: a waiting queue
   beside room to spare, blocked admissions, idle and busy batches, batches
   with routed decodes and prefills, decodes with almost no slack left, and a
   full KV cache. The script runs three rounds, so stateful controllers (the
   credit) are seen after credit accrued; for a controller that reads
   imminence, two of the jobs (alternating by round) are imminent.
3. **Scenarios** (seconds): the policy on the in-memory engine, in the small
   scenario (``SMALL_SCENARIO``) and in a pressure scenario
   (``PRESSURE_SCENARIO``: a pool small enough for blocked admissions,
   waiting queues and a shadow class at its cap), with every plan, every
   iteration's KV pool, and every predictor and targeting answer checked.

Invariant: a policy that passes keeps, on every snapshot it was shown, every
rule of :mod:`shadowcore.testing.contracts` in strict mode. Not checked: that
the policy does any shadow work, and that it is deterministic end to end
(assert those yourself; :class:`ConformanceReport` has the counts).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from shadowcore.config import PluginRef, ShadowConfig
from shadowcore.hook import EngineHook
from shadowcore.job import SessionHistory, ShadowJob
from shadowcore.latency import LinearLatencyModel
from shadowcore.policy import PolicySpec, load_policy
from shadowcore.switch import SwitchPredictor, Target, Targeting, rank_targets
from shadowcore.testing.contracts import kv_problems, plan_problems, predictor_problems, targeting_problems
from shadowcore.testing.stubs import StubEnginePort, StubJobSource
from shadowcore.types import (
    ChunkResult,
    JobKey,
    Phase,
    RequestKind,
    RequestView,
    StepOutcome,
    StepPlan,
    StepSnapshot,
)

SMALL_SCENARIO: dict[str, Any] = {
    "duration_s": 40.0,
    "warmup_s": 0.0,
    "session_rate_per_s": 0.25,
    "calls_per_session": 6,
    "switch_probability": 0.4,
    "normal_rate_per_s": 2.0,
    "num_blocks": 2048,
}
#: A pool of 640 blocks (10,240 tokens) under long prompts and heavy normal
#: traffic: admissions block and requests wait in about 40% of the iterations.
PRESSURE_SCENARIO: dict[str, Any] = {
    "duration_s": 12.0,
    "warmup_s": 0.0,
    "session_rate_per_s": 0.5,
    "calls_per_session": 4,
    "switch_probability": 0.5,
    "input_tokens_median": 1200,
    "normal_rate_per_s": 3.0,
    "normal_prompt_median": 1500,
    "num_blocks": 640,
}
#: Models the strategy probes ask about.
PROBE_MODELS = ("m0", "m1", "m2", "m3")
MAX_VIOLATIONS = 50


class ConformanceError(AssertionError):
    """A policy broke at least one invariant; the message lists them all."""


def snapshot_kinds(snapshot: StepSnapshot) -> list[str]:
    """The coverage classes of a snapshot (see :attr:`ConformanceReport.coverage`)."""
    kinds = []
    if snapshot.num_waiting:
        kinds.append("waiting")
    if snapshot.admission_blocked:
        kinds.append("blocked")
    kinds.append("idle" if snapshot.is_idle else "busy")
    if snapshot.has_routed:
        kinds.append("routed")
    if snapshot.num_shadow_room_tokens < snapshot.num_free_token_budget:
        kinds.append("kv_pressure")
    return kinds


@attrs.define(eq=False)
class InvariantObserver:
    """Checks each plan and each iteration's KV pool (the instances' pools,
    when given) against :mod:`shadowcore.testing.contracts`; ``strict`` adds
    the ``bounded`` and ``slo`` plan rules (``check_policy`` sets it; the
    simulator's own tests leave it off because P/D prefill instances run
    iterations longer than a TPOT SLO by design)."""

    instances: Mapping[str, Any] = attrs.Factory(dict)
    violations: list[str] = attrs.Factory(list)
    num_plans: int = 0
    num_shadow_plans: int = 0
    strict: bool = False
    where: str = ""
    coverage: Counter[str] = attrs.Factory(Counter)

    def fail(self, what: str) -> None:
        if len(self.violations) < MAX_VIOLATIONS:
            self.violations.append(f"{self.where}{what}")

    def on_plan(self, snapshot: StepSnapshot, plan: StepPlan) -> None:
        self.num_plans += 1
        self.coverage.update(snapshot_kinds(snapshot))
        if plan.grants:
            self.num_shadow_plans += 1
            self.coverage["shadow_plan"] += 1
        inst = self.instances.get(snapshot.instance_id)
        block = getattr(inst, "block_size", None)
        for problem in plan_problems(snapshot, plan, block, self.strict):
            self.fail(f"{snapshot.instance_id} iteration {snapshot.iteration}: {problem}")

    def on_step_end(self, snapshot: StepSnapshot, plan: StepPlan, outcome: StepOutcome) -> None:
        inst = self.instances.get(snapshot.instance_id)
        if inst is None:
            return
        for problem in kv_problems(inst.kv):
            self.fail(f"{snapshot.instance_id} iteration {snapshot.iteration}: {problem}")


@attrs.frozen
class ConformanceReport:
    """What a passing check saw: plans made and with shadow work (scenarios
    and probe), the scenario's metrics, and ``coverage``: how many snapshots
    of each kind the policy was shown (``waiting``, ``blocked``, ``idle``,
    ``busy``, ``routed``, ``kv_pressure``: shadow room below the token
    budget; ``shadow_plan``: plans with grants)."""

    policy: str
    num_plans: int
    num_shadow_plans: int
    metrics: Mapping[str, float]
    coverage: Mapping[str, int] = attrs.Factory(dict)


# -- phase 1: the routing-side strategies --------------------------------------------
@attrs.define(eq=False)
class _CheckedPredictor(SwitchPredictor):
    """The policy's predictor, every answer checked as the manager gets it."""

    inner: SwitchPredictor
    fail: Callable[[str], None]

    def switch_probability(self, session_id: str, task: str, current_model: str) -> float:
        return self.inner.switch_probability(session_id, task, current_model)

    def next_model_distribution(self, session_id: str, task: str, current_model: str,
                                models: Sequence[str]) -> dict[str, float]:
        for problem in predictor_problems(self.inner, session_id, task, current_model, models):
            self.fail(problem)
        return self.inner.next_model_distribution(session_id, task, current_model, models)

    def observe_transition(self, session_id: str, task: str, from_model: str, to_model: str) -> None:
        self.inner.observe_transition(session_id, task, from_model, to_model)

    def __getattr__(self, name: str) -> Any:  # fit(), anything else a backend calls
        return getattr(self.inner, name)


@attrs.frozen
class _CheckedTargeting(Targeting):
    inner: Targeting
    fail: Callable[[str], None]

    def choose(self, ranked: Sequence[Target]) -> list[Target]:
        chosen = self.inner.choose(ranked)
        for problem in targeting_problems(ranked, chosen):
            self.fail(problem)
        return chosen


#: (session, task, models of its calls): the probe's scripted transitions.
_PROBE_SESSIONS = (
    ("q0", "", ("m0", "m1", "m1", "m2", "m0", "m3")),
    ("q1", "code", ("m3", "m3", "m3", "m0")),
    ("q2", "code", ("m2", "m0", "m2", "m0", "m2")),
)
_PROBE_DISTRIBUTIONS = (
    {"m1": 1.0},
    {"m1": 0.5, "m2": 0.5},
    {"m1": 0.7, "m2": 0.2, "m3": 0.1},
    {"m1": 0.0, "m2": 0.6, "m3": 0.4},
    {"m0": 0.1, "m1": 0.2, "m2": 0.3, "m3": 0.4},
    {"m1": 0.25, "m2": 0.25, "m3": 0.25, "m4": 0.25},
)


def _probe_strategies(spec: PolicySpec, seed: int, fail: Callable[[str], None]) -> None:
    predictor = spec.predictor.build(np.random.default_rng([seed, 3]))
    models = PROBE_MODELS

    def ask_all() -> None:
        for session, task, _ in _PROBE_SESSIONS:
            for current in models:
                for problem in predictor_problems(predictor, session, task, current, models):
                    fail(problem)
            for problem in predictor_problems(predictor, session, task, models[0], models[:2]):
                fail(problem)

    ask_all()
    for session, task, calls in _PROBE_SESSIONS:
        for a, b in itertools.pairwise(calls):
            predictor.observe_transition(session, task, a, b)
    ask_all()
    for p in (0.0, 0.3, 1.0):
        for dist in _PROBE_DISTRIBUTIONS:
            ranked = rank_targets(p, dist)
            for problem in targeting_problems(ranked, spec.targeting.choose(list(ranked))):
                fail(problem)


# -- phase 2: the controller, through a hook -----------------------------------------
_T_S = 0.025  # the probe's TPOT SLO (the fake engine's default)
_TOKEN_BUDGET = 2048
_ROOM = 8192


def _decode(rid: str, kind: RequestKind, now: float, steps: int, slack_s: float) -> RequestView:
    """A decode with ``slack_s`` left of its Eq. 1 slack (margin 0)."""
    first = now - (steps + 1) * _T_S + slack_s
    return RequestView(rid, kind, Phase.DECODE, max(0.0, first - 0.2), 1, 1500 + steps, 1.0, _T_S,
                       first_token_s=max(0.0, first), num_decode_steps=steps)


def _prefill(rid: str, kind: RequestKind, now: float, chunk: int, remaining: int) -> RequestView:
    return RequestView(rid, kind, Phase.PREFILL, max(0.0, now - 0.05), chunk, 0, 1.0, _T_S,
                       num_remaining_prefill_tokens=remaining)


def _probe_script(now: float) -> list[tuple[tuple[RequestView, ...], int, bool, int]]:
    """One round of (batch, num_waiting, admission_blocked, shadow room)."""
    n, r = RequestKind.NORMAL, RequestKind.ROUTED
    decodes = tuple(_decode(f"d{i}", n, now, 40, 0.5 * _T_S * 40) for i in range(4))
    routed = decodes[:3] + (_decode("r0", r, now, 10, 0.5 * _T_S * 10),)
    tight = tuple(_decode(f"t{i}", n, now, 30, 0.002) for i in range(3))
    return [
        ((), 0, False, _ROOM), ((), 0, False, _ROOM),
        ((), 2, False, _ROOM), (decodes, 1, False, _ROOM),
        (decodes, 0, True, _ROOM), ((), 0, True, _ROOM), ((), 3, True, _ROOM),
        *[(decodes, 0, False, _ROOM)] * 12,  # decode-only: a credit accrues
        (routed, 0, False, _ROOM), (routed, 0, False, _ROOM),
        ((_prefill("rp", r, now, 512, 1024),) + decodes[:2], 0, False, _ROOM),
        ((_prefill("np", n, now, 1024, 0),) + decodes[:2], 0, False, _ROOM),
        (tight, 0, False, _ROOM), (tight + routed[3:], 0, False, _ROOM),
        ((), 0, False, 16), ((), 0, False, 0), (decodes, 0, False, 16), (routed, 2, False, 0),
        ((), 0, False, _ROOM),
    ]


def _probe_controller(spec: PolicySpec, seed: int, checker: InvariantObserver) -> None:
    block = 16
    port, jobs = StubEnginePort(block), StubJobSource()
    for i, p in enumerate((0.8, 0.5, 0.5, 0.1)):
        history = SessionHistory(f"probe{i}")
        history.append(3000)
        jobs.add(ShadowJob(JobKey(history.session_id, "probe-target"), "probe", history, block,
                           switch_probability=p, sequence=i, epoch=history.epoch))
    controller = spec.slack.build(np.random.default_rng([seed, 4]))
    hook = EngineHook("probe", jobs, controller, LinearLatencyModel(), port)
    checker.instances = {"probe": port}  # block size only: the port has no KV pool
    now, iteration = 1.0, 0
    for round_ in range(3):
        for i, job in enumerate(jobs.all()):
            job.history.append(2000)
            # a controller that reads imminence sees jobs in their tool gap, a lower-probability one among them
            # (so an imminent_first order differs from the source's), as ShadowManager marks them for it
            job.imminent = controller.reads_imminence and (i + round_) % 2 == 1
        for batch, waiting, blocked, room in _probe_script(now):
            iteration += 1
            free = _TOKEN_BUDGET - sum(v.num_scheduled_tokens for v in batch)
            snapshot = StepSnapshot("probe", iteration, now, batch, waiting, blocked, _T_S, free, room)
            plan = hook.begin_step(snapshot)
            checker.on_plan(snapshot, plan)
            hook.end_step(StepOutcome("probe", iteration, plan.predicted_s,
                                      tuple(ChunkResult(g, g.num_tokens) for g in plan.grants)))
            for g in plan.grants:
                job = jobs.job(g.job)
                if job is not None:
                    port.computed(job.history, g.epoch, g.start_token, g.num_tokens)
            now += max(plan.predicted_s, 0.001)


# -- the check -------------------------------------------------------------------------
def _run_scenario(ref: PluginRef, scenario: Mapping[str, Any], seed: int, checker: InvariantObserver) -> Any:
    from shadowcore.engine.scenario import FakeRun, FakeScenario

    run = FakeRun(FakeScenario.from_dict(dict(scenario)), ShadowConfig(ref, seed=seed))
    checker.instances = run.cluster.by_id
    manager = run.runtime.manager
    manager.predictor = _CheckedPredictor(manager.predictor, checker.fail)
    manager.targeting = _CheckedTargeting(manager.targeting, checker.fail)
    run.runtime.observers.add(checker)
    result = run.run()
    if run.runtime.observers.errors:
        checker.fail(f"observer error: {run.runtime.observers.errors[0][1]!r}")
    return result


def check_policy(
    policy: str | PluginRef, scenario: Mapping[str, Any] | None = None, seed: int = 0,
    pressure: Mapping[str, Any] | None = PRESSURE_SCENARIO,
) -> ConformanceReport:
    """Check ``policy`` (a reference or a :class:`PluginRef`) in the three
    phases of this module; raise :class:`ConformanceError` on any violation.

    ``scenario`` replaces ``SMALL_SCENARIO`` (fields left out take the
    :class:`~shadowcore.engine.scenario.FakeScenario` defaults); ``pressure``
    replaces ``PRESSURE_SCENARIO`` (``None``: no pressure run).
    """
    ref = policy if isinstance(policy, PluginRef) else PluginRef(policy)
    spec = load_policy(ref, field="policy")
    checker = InvariantObserver(strict=True)

    def phase(where: str, body: Callable[[], Any]) -> Any:
        checker.where = f"{where}: "
        out = body()
        if checker.violations:
            more = "" if len(checker.violations) < MAX_VIOLATIONS else f"\n  (first {MAX_VIOLATIONS} shown)"
            raise ConformanceError(
                f"policy {ref.name!r} broke invariants:\n  " + "\n  ".join(checker.violations) + more
            )
        return out

    phase("strategy probe", lambda: _probe_strategies(spec, seed, checker.fail))
    phase("controller probe", lambda: _probe_controller(spec, seed, checker))
    result = phase("small scenario", lambda: _run_scenario(ref, scenario or SMALL_SCENARIO, seed, checker))
    if pressure is not None:
        phase("pressure scenario", lambda: _run_scenario(ref, pressure, seed, checker))
    return ConformanceReport(result.policy, checker.num_plans, checker.num_shadow_plans, result.metrics,
                             dict(checker.coverage))


__all__ = [
    "PRESSURE_SCENARIO",
    "PROBE_MODELS",
    "SMALL_SCENARIO",
    "ConformanceError",
    "ConformanceReport",
    "InvariantObserver",
    "check_policy",
    "snapshot_kinds",
]
