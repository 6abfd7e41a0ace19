"""A small agentic scenario on the fake engine: Markov-routed sessions over N
models plus Poisson normal traffic, run under any registered policy.

The workload is drawn from the scenario's own seed before the run, so every
policy sees identical sessions and normal requests; the policy's randomness
comes from the :class:`ShadowConfig` seed through the composition root.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import numpy as np

from shadowcore._validators import non_negative, non_negative_int, positive, positive_int, probability
from shadowcore.config import ShadowConfig, SloConfig, build_attrs
from shadowcore.errors import ConfigError
from shadowcore.events import EventLoop
from shadowcore.hook import EngineHook
from shadowcore.job import SessionHistory
from shadowcore.kv import KVClassManager, KVClassPolicy
from shadowcore.latency import BatchShape, LinearLatencyModel, chunked_prefill_s
from shadowcore.pipeline import ShadowRuntime, build_runtime
from shadowcore.policy import PolicySpec, load_policy
from shadowcore.engine.instance import EngineInstance, EngineLimits, EngineRequest, append_output_to_history
from shadowcore.types import CallArrival, RequestKind

# Event kinds: at equal times an iteration end frees its slots before new work
# arrives; wake-ups of idle instances come last.
STEP_END, CALL, NORMAL, WAKE = 0, 1, 2, 3


def _tuple(v: Iterable) -> tuple:
    return tuple(v)


@attrs.frozen
class FakeScenario:
    """Everything that defines a fake-engine run except the policy."""

    models: tuple[str, ...] = attrs.field(default=("small", "large"), converter=_tuple)
    latency_scale: tuple[float, ...] = attrs.field(default=(1.0, 3.0), converter=_tuple)
    instances_per_model: int = attrs.field(default=2, validator=positive_int)
    duration_s: float = attrs.field(default=240.0, validator=positive)
    warmup_s: float = attrs.field(default=30.0, validator=non_negative)
    session_rate_per_s: float = attrs.field(default=0.1, validator=positive)
    calls_per_session: int = attrs.field(default=8, validator=positive_int)
    switch_probability: float = attrs.field(default=0.3, validator=probability)
    input_tokens_median: int = attrs.field(default=1500, validator=positive_int)
    output_tokens_median: int = attrs.field(default=120, validator=positive_int)
    tool_gap_s: float = attrs.field(default=2.0, validator=non_negative)
    normal_rate_per_s: float = attrs.field(default=1.5, validator=non_negative)
    normal_prompt_median: int = attrs.field(default=800, validator=positive_int)
    normal_output_median: int = attrs.field(default=150, validator=positive_int)
    slo: SloConfig = attrs.Factory(SloConfig)
    num_blocks: int = attrs.field(default=8192, validator=positive_int)
    block_size: int = attrs.field(default=16, validator=positive_int)
    token_budget: int = attrs.field(default=2048, validator=positive_int)
    kv_bytes_per_token: float = attrs.field(default=131072.0, validator=positive)
    seed: int = attrs.field(default=0, validator=non_negative_int)

    def __attrs_post_init__(self) -> None:
        if len(self.latency_scale) != len(self.models):
            raise ConfigError("latency_scale", self.latency_scale, f"needs one entry per model ({len(self.models)})")
        if len(set(self.models)) != len(self.models) or len(self.models) < 2:
            raise ConfigError("models", self.models, "needs at least two distinct model names")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], field: str = "scenario") -> FakeScenario:
        data = dict(data)
        if "slo" in data:
            data["slo"] = build_attrs(SloConfig, f"{field}.slo", data["slo"])
        return build_attrs(cls, field, data)


@attrs.frozen
class CallRecord:
    session_id: str
    call_index: int
    model: str
    is_switch: bool
    arrival_s: float
    ttft_s: float
    latency_s: float
    num_prompt_tokens: int
    num_cached_tokens: int


@attrs.frozen
class ScenarioResult:
    policy: str
    calls: tuple[CallRecord, ...]
    metrics: Mapping[str, float]
    notices: tuple[str, ...] = ()  # warnings about the policy on these engines (ShadowRuntime.notices)
    warmup_s: float = 0.0  # calls arriving earlier are not in the metrics


@attrs.define(eq=False)
class EngineCluster:
    """The instances of a run; the ``ClusterPort`` the router side reads.

    The placement estimate treats an instance's queued prefill work as requests
    of at most ``window_tokens`` each (0: no window), every one from an empty
    context; while the queued work fits one window this is the plain estimate,
    beyond it the plain estimate would price one impossible prompt longer than
    the model's window (which a table-based latency model refuses).
    """

    loop: EventLoop
    by_model: dict[str, list[EngineInstance]]
    by_id: dict[str, EngineInstance]
    window_tokens: int = 0

    def instances(self, model: str) -> list[str]:
        return [i.instance_id for i in self.by_model[model]]

    def block_size(self, instance_id: str) -> int:
        return self.by_id[instance_id].block_size

    def cached_prefix_tokens(self, instance_id: str, history: SessionHistory) -> int:
        return self.by_id[instance_id].cached_prefix_tokens(history)

    def estimated_prefill_completion_s(self, instance_id: str, num_uncached_tokens: int) -> float:
        inst = self.by_id[instance_id]
        work = inst.queued_prefill_tokens + num_uncached_tokens
        budget = inst.limits.token_budget
        if self.window_tokens <= 0 or work <= self.window_tokens:
            return self.loop.now_s + chunked_prefill_s(inst.latency, work, budget)  # context ignored: an estimate
        full, rest = divmod(work, self.window_tokens)
        t = full * chunked_prefill_s(inst.latency, self.window_tokens, budget)
        if rest:
            t += chunked_prefill_s(inst.latency, rest, budget)
        return self.loop.now_s + t

    def kick(self, inst: EngineInstance) -> None:
        """Start an iteration on an idle instance now (no-op when busy)."""
        if inst.busy:
            return
        end = inst.start_step(self.loop.now_s)
        if end is not None:
            self.loop.at(end, STEP_END, lambda t, i=inst: self._on_step_end(i))

    def kick_all(self) -> None:
        for inst in self.by_id.values():
            if not inst.busy:
                self.loop.at(self.loop.now_s, WAKE, lambda t, i=inst: self.kick(i))

    def _on_step_end(self, inst: EngineInstance) -> None:
        """End ``inst``'s iteration and start its next; while that one ends
        before any other queued event, run its end inline (what the loop
        would pop next anyway: ``EventLoop.advance_to``); runs of steady
        iterations with nothing to do at their ends go through
        ``EngineInstance.run_steady`` in one call."""
        loop = self.loop
        ticks = True  # False right after run_steady stopped at an end that is not a plain tick
        while True:
            if ticks and loop.inline_horizon_s() > loop.now_s and inst.can_run_steady():
                last, num, end = inst.run_steady(loop.now_s, loop.inline_horizon_s())
                if num:
                    loop.advance_inline(last, num - 1)  # the first end is this event
                    if not loop.advance_to(end):
                        loop.at(end, STEP_END, lambda t, i=inst: self._on_step_end(i))
                        return
                    ticks = False
                    continue
            ticks = True
            inst.end_step(loop.now_s)
            if inst.busy:
                return
            end = inst.start_step(loop.now_s)
            if end is None:
                return
            if not loop.advance_to(end):
                loop.at(end, STEP_END, lambda t, i=inst: self._on_step_end(i))
                return


def _lognormal(rng: np.random.Generator, median: float, sigma: float = 0.6) -> int:
    return max(1, int(round(median * float(np.exp(sigma * rng.standard_normal())))))


@attrs.frozen
class SessionPlan:
    """One agent session as the runner plays it: per call its model, the tokens
    appended at arrival (new input and tool result), its output tokens, and
    optionally a compaction before it and the gap after it (else the
    scenario's ``tool_gap_s``)."""

    session_id: str
    arrival_s: float
    models: tuple[str, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    compact_to: tuple[int | None, ...] = ()
    gaps_s: tuple[float, ...] = ()


def draw_sessions(sc: FakeScenario) -> list[SessionPlan]:
    rng = np.random.default_rng([sc.seed, 1])
    out, t = [], 0.0
    while True:
        t += float(rng.exponential(1.0 / sc.session_rate_per_s))
        if t >= sc.duration_s:
            return out
        models = [sc.models[int(rng.integers(len(sc.models)))]]
        for _ in range(sc.calls_per_session - 1):
            if rng.random() < sc.switch_probability:
                others = [m for m in sc.models if m != models[-1]]
                models.append(others[int(rng.integers(len(others)))])
            else:
                models.append(models[-1])
        inputs = tuple(_lognormal(rng, sc.input_tokens_median) for _ in models)
        outputs = tuple(_lognormal(rng, sc.output_tokens_median) for _ in models)
        out.append(SessionPlan(f"s{len(out)}", t, tuple(models), inputs, outputs))


def draw_normal(sc: FakeScenario, instance_index: int) -> list[tuple[float, int, int]]:
    if sc.normal_rate_per_s == 0:
        return []
    rng = np.random.default_rng([sc.seed, 2, instance_index])
    out, t = [], 0.0
    while True:
        t += float(rng.exponential(1.0 / sc.normal_rate_per_s))
        if t >= sc.duration_s:
            return out
        out.append((t, _lognormal(rng, sc.normal_prompt_median), _lognormal(rng, sc.normal_output_median)))


@attrs.define(eq=False)
class ScenarioRun:
    """One scenario under one policy: the workload, the router side and the
    metrics, over engine instances that a subclass builds
    (:meth:`build_instance`). The scenario must provide the fields of
    :class:`FakeScenario` that describe sessions, normal traffic and SLOs."""

    scenario: Any
    shadow: ShadowConfig
    observers: tuple = ()
    sessions: tuple[SessionPlan, ...] | None = None  # scripted sessions instead of drawn ones
    loop: EventLoop = attrs.field(init=False, factory=EventLoop)
    policy: PolicySpec = attrs.field(init=False)
    cluster: EngineCluster = attrs.field(init=False)
    runtime: ShadowRuntime = attrs.field(init=False)
    calls: list[CallRecord] = attrs.field(init=False, factory=list)
    normal: list[tuple[float, bool]] = attrs.field(init=False, factory=list)  # (arrival, met SLO)
    _dedicated: set[str] = attrs.field(init=False, factory=set)
    rejected: list[str] = attrs.field(init=False, factory=list)  # request ids longer than a whole KV pool
    _num_normal: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        sc = self.scenario
        self.policy = load_policy(self.shadow.policy, field="shadow.policy")
        extra = 1 if self.policy.dedicated_instances else 0
        self.cluster = self.build_cluster(extra)
        by_model = self.cluster.by_model
        dedicated = {m: insts[-1].instance_id for m, insts in by_model.items()} if extra else {}
        self.runtime = build_runtime(self.shadow, self.cluster, sc.models, dedicated)
        for obs in self.observers:
            self.runtime.observers.add(obs)
        for inst in self.cluster.by_id.values():  # fixed order: attach draws from the runtime's generator
            inst.hook = self.attach_hook(inst)
            if inst.hook is not None:
                self.runtime.check_reach(inst.hook, inst.tpot_slo_s)
        self._dedicated.update(dedicated.values())

    def build_instance(self, instance_id: str, model: str, kv_policy: KVClassPolicy) -> EngineInstance:
        raise NotImplementedError

    def session_plans(self) -> list[SessionPlan]:
        """The sessions of this run (default: Markov sessions from the scenario's fields)."""
        return draw_sessions(self.scenario)

    def build_cluster(self, extra: int) -> EngineCluster:
        """The run's instances. ``by_model`` lists, per model, the instances the
        router side may place calls on (with ``extra``, the last one of each
        model is the dedicated shadow instance); ``by_id`` holds every instance."""
        sc = self.scenario
        by_model = {
            m: [self.build_instance(f"{m}/{k}", m, self.policy.kv) for k in range(sc.instances_per_model + extra)]
            for m in sc.models
        }
        by_id = {i.instance_id: i for insts in by_model.values() for i in insts}
        return EngineCluster(self.loop, by_model, by_id)

    def attach_hook(self, inst: EngineInstance) -> EngineHook | None:
        """The engine hook of ``inst`` (None: the instance runs no shadow work)."""
        return self.runtime.attach(inst.instance_id, inst, inst.latency)

    def normal_arrivals(self) -> list[tuple[EngineInstance, list[tuple[float, int, int]]]]:
        """Per instance that serves normal traffic: its (arrival, prompt, output) requests."""
        serving = [i for i in self.cluster.by_id.values() if i.instance_id not in self._dedicated]
        return [(inst, draw_normal(self.scenario, k)) for k, inst in enumerate(serving)]


    # -- workload -------------------------------------------------------------------
    def run(self) -> ScenarioResult:
        for s in self.sessions if self.sessions is not None else self.session_plans():
            self.loop.at(s.arrival_s, CALL, lambda t, s=s: self._call(s, 0))
        for inst, arrivals in self.normal_arrivals():
            for arrival, prompt, output in arrivals:
                self.loop.at(arrival, NORMAL, lambda t, i=inst, p=prompt, o=output: self._normal(i, t, p, o))
        self.loop.run()
        return ScenarioResult(self.runtime.policy.name, tuple(self.calls), self.summary(), tuple(self.runtime.notices),
                              self.scenario.warmup_s)

    def _enqueue(self, inst: EngineInstance, req: EngineRequest) -> None:
        inst.enqueue(req)
        self.cluster.kick(inst)

    def _normal(self, inst: EngineInstance, now_s: float, prompt: int, output: int) -> None:
        self._num_normal += 1
        rid = f"n{self._num_normal}:{inst.instance_id}"
        history = SessionHistory(rid)
        history.append(prompt)
        req = EngineRequest(rid, RequestKind.NORMAL, history, prompt, output, now_s, inst.tpot_slo_s * 40,
                          inst.tpot_slo_s, on_token=append_output_to_history, on_finish=self._normal_done)
        isolated = chunked_prefill_s(inst.latency, prompt, inst.limits.token_budget)
        req.ttft_slo_s = max(self.scenario.slo.ttft_s, 5 * isolated)
        self._enqueue(inst, req)

    def _normal_done(self, req: EngineRequest, now_s: float) -> None:
        if req.rejected:  # counted, and a miss: nothing is dropped silently
            self.rejected.append(req.request_id)
            self.normal.append((req.arrival_s, False))
            return
        ttft = req.first_token_s - req.arrival_s
        tpot = (now_s - req.first_token_s) / max(1, req.num_output_tokens - 1)
        self.normal.append((req.arrival_s, ttft <= req.ttft_slo_s and tpot <= req.tpot_slo_s))

    def _call(self, s: SessionPlan, index: int) -> None:
        now = self.loop.now_s
        manager = self.runtime.manager
        compact = s.compact_to[index] if s.compact_to else None
        placement = manager.on_call_arrival(
            CallArrival(s.session_id, s.models[index], s.inputs[index], now, compact_to_tokens=compact)
        )
        inst = self.cluster.by_id[placement.instance_id]
        history = manager.history(s.session_id)
        req = EngineRequest(
            f"{s.session_id}#{index}", RequestKind.ROUTED, history, history.num_tokens, s.outputs[index], now,
            self.scenario.slo.ttft_s, inst.tpot_slo_s, num_oracle_tokens=placement.num_oracle_prefix_tokens,
            on_token=lambda r, t, sid=s.session_id: manager.on_output_tokens(sid, 1),
            on_finish=lambda r, t, s=s, i=index, p=placement: self._call_done(s, i, p, r),
        )
        self._enqueue(inst, req)
        self.cluster.kick_all()

    def _call_done(self, s: SessionPlan, index: int, placement, req: EngineRequest) -> None:
        if req.rejected:  # the agent cannot go on: the session ends here
            self.rejected.append(req.request_id)
            self.runtime.manager.on_session_end(s.session_id)
            return
        self.calls.append(CallRecord(
            s.session_id, index, placement.model, placement.is_switch, req.arrival_s,
            req.first_token_s - req.arrival_s, req.finish_s - req.arrival_s, req.num_prompt_tokens,
            req.num_cached_tokens,
        ))
        if index + 1 < len(s.models):
            gap = s.gaps_s[index] if s.gaps_s else self.scenario.tool_gap_s
            self.loop.at(self.loop.now_s + gap, CALL, lambda t: self._call(s, index + 1))
        else:
            self.runtime.manager.on_session_end(s.session_id)
        self.cluster.kick_all()

    # -- metrics --------------------------------------------------------------------
    def summary(self) -> dict[str, float]:
        sc = self.scenario
        measured = [c for c in self.calls if c.arrival_s >= sc.warmup_s]
        switch = [c for c in measured if c.is_switch]
        normal = [met for arrival, met in self.normal if arrival >= sc.warmup_s]
        insts = list(self.cluster.by_id.values())
        shadow_tokens = sum(i.num_shadow_tokens for i in insts)
        used = sum(i.kv.num_shadow_blocks_used * i.kv.block_size for i in insts)
        return {
            "calls": float(len(measured)),
            "switch_calls": float(len(switch)),
            "call_latency_s": _mean(c.latency_s for c in measured),
            "switch_latency_s": _mean(c.latency_s for c in switch),
            "switch_ttft_s": _mean(c.ttft_s for c in switch),
            "hit_rate": _ratio(measured),
            "switch_hit_rate": _ratio(switch),
            "normal_slo_attainment": _mean(1.0 if m else 0.0 for m in normal),
            "shadow_tokens": float(shadow_tokens),
            "shadow_tokens_used": float(used),
            "rejected_requests": float(len(self.rejected)),
            **{f"steps_{why}": float(n) for why, n in self.runtime.step_counts().items()},
        }


@attrs.define(eq=False)
class FakeRun(ScenarioRun):
    """A :class:`FakeScenario` on instances with linear latency models."""

    def build_instance(self, instance_id: str, model: str, kv_policy: KVClassPolicy) -> EngineInstance:
        sc = self.scenario
        scale = sc.latency_scale[sc.models.index(model)]
        base = LinearLatencyModel()
        latency = LinearLatencyModel(
            base.overhead_s * scale, base.prefill_s_per_token * scale, base.attention_s_per_token_pair * scale,
            base.decode_s_per_seq * scale, base.decode_s_per_context_token * scale,
        )
        kv = KVClassManager(sc.num_blocks, sc.block_size, kv_policy, sc.kv_bytes_per_token)
        tpot = max(sc.slo.tpot_s, 5 * latency.predict_s(BatchShape((), (sc.input_tokens_median,))))
        return EngineInstance(instance_id, model, kv, latency, tpot, EngineLimits(sc.token_budget))


def _mean(values: Iterable[float]) -> float:
    v = list(values)
    return float(np.mean(v)) if v else float("nan")


def _ratio(calls: list[CallRecord]) -> float:
    total = sum(c.num_prompt_tokens for c in calls)
    return sum(c.num_cached_tokens for c in calls) / total if total else float("nan")


class FakeBackend:
    """The ``fake`` backend: runs a :class:`FakeScenario` in memory."""

    name = "fake"

    def run(self, scenario: Mapping[str, Any] | FakeScenario, shadow: ShadowConfig, observers: tuple = ()) -> ScenarioResult:
        sc = scenario if isinstance(scenario, FakeScenario) else FakeScenario.from_dict(scenario)
        return FakeRun(sc, shadow, observers).run()
