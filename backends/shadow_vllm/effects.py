"""Effect-level agreement: one workload (a session file's sessions plus one
normal-traffic draw, one instance per model) through the simulator's engine
(:class:`~shadowcore.engine.instance.EngineInstance`) and through vLLM's real
scheduler in virtual time (:mod:`shadow_vllm.virtual`), with the same latency
model per model, under each arm of :data:`ARMS`; then the effects a user
reads off a run, side by side (:func:`effects`, :func:`compare`):

* **switch-call TTFT reduction**: ``1 - mean(switch TTFT) / mean(no-shadow's)``
  over the same switch calls (paired by session and call index);
* **switch hit rate**: prompt tokens of switch calls served from the prefix
  cache, over their prompt tokens;
* **same-model TTFT ratio**: ``mean(same-model TTFT) / mean(no-shadow's)``,
  what shadow work costs the calls it cannot help.

Tolerances (:data:`TOLERANCE`, issue 16 item 6): reduction within 10% of the
simulator's (relative), hit rate within 1 point, same-model ratio within 0.03.
For no-shadow itself the reduction and the ratio are 0 and 1 by definition in
both engines; its switch-call and same-model mean TTFTs are compared instead
(relative 10% and 0.03), and its hit rate like any arm's.

Arms: ``no-shadow``; ``request-level`` (the paper's prototype, Appendix D.1:
:class:`~shadow_gateway.request_level.RequestLevelShadower` on both engines:
in virtual time stock vLLM with priority scheduling, in the simulator
:class:`SimRequestLevelRun`, whose waiting queue puts routed and normal work
ahead of waiting shadows as vLLM's priority queue does); ``harvest-slo``; and
``benefit-host``, the policy ``docs/reproduction.md`` calls ours (host tier:
the simulator's host tier and vLLM's ``OffloadingConnector``, sized to the
same tokens and link speed).

Where the engines part, measured (``benchmarks/effect_agreement.py``):

* The shadow scheduler's default ``keep_tails_below_n_min: false`` finishes
  shadows whose missing tokens together are below ``n_min``; the simulator
  keeps them pending and grants them with the next job's tokens. The feeder
  here ends shadows itself, so :func:`run_virtual` keeps tails pending, and
  harvest-slo then matches the simulator call for call; with the default, the
  small case's switch hit rate is 3.3 points lower in vLLM (``docs/vllm.md``,
  "Tails below n_min").
* benefit-host's host tier: vLLM's ``OffloadingConnector`` stores every
  computed block as it goes and a step waits for a reused block's store (the
  virtual transfer worker times both); the simulator's host tier spills at
  eviction, at no cost on the critical path. The small case's same-model TTFT
  ratio is 0.026 higher in vLLM for that reason (with the connector left off,
  the two engines agree exactly).

Invariants: both engines see the same sessions (request ids, arrivals, tool
gaps, per-call models and token counts), the same normal requests, the same
latency model objects, KV pool, token budget and SLOs; nothing here reads wall
time.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from shadowcore.config import PluginRef, ShadowConfig
from shadowcore.engine.instance import EngineInstance, EngineLimits, EngineRequest
from shadowcore.engine.kinds import NORMAL
from shadowcore.engine.records import CallRecord
from shadowcore.engine.scenario import FakeRun, FakeScenario
from shadowcore.kv import KVClassManager
from shadowcore.latency import BatchShape, LatencyModel
from shadowcore.types import RequestKind

#: arm -> (policy: a registered name or a PluginRef with arguments, host tier on the engines)
ARMS: dict[str, tuple[str | PluginRef, bool]] = {
    "no-shadow": ("no-shadow", False),
    "request-level": ("no-shadow", False),  # routed side plans nothing; shadows are requests
    "harvest-slo": ("harvest-slo", False),
    "benefit-host": ("benefit-host", True),
}
#: effect -> (kind, bound): ``rel``: |virtual - sim| <= bound * |sim|; ``abs``: |virtual - sim| <= bound
TOLERANCE: dict[str, tuple[str, float]] = {
    "switch_ttft_reduction": ("rel", 0.10),
    "switch_hit_rate": ("abs", 0.01),
    "same_ttft_ratio": ("abs", 0.03),
    "switch_ttft_s": ("rel", 0.10),  # no-shadow's own reduction is 0: its TTFTs are compared
    "same_ttft_s": ("rel", 0.03),
}
#: Bytes per token of the virtual engine's stand-in KV (one layer, K and V x 2 heads x 32 x fp32).
VIRTUAL_KV_BYTES_PER_TOKEN = 2 * 2 * 32 * 4
SHADOW_PREFIX = "shadow-"  # request-level shadows' ids (RequestLevelShadower's submission ids)


def tpot_slo_s(scenario: FakeScenario, latency: LatencyModel) -> float:
    """The TPOT SLO both engines use: the scenario's, at least 5x a batch-1 decode (the paper's rule)."""
    return max(scenario.slo.tpot_s, 5 * latency.predict_s(BatchShape((), (scenario.input_tokens_median,))))


# -- the simulator's side ------------------------------------------------------------------
@attrs.define(eq=False)
class SimEffectRun(FakeRun):
    """The simulator's engine on a :class:`FakeScenario` with the given latency model per model."""

    latency_models: Mapping[str, LatencyModel] = attrs.field(kw_only=True, factory=dict)
    instance_cls: type = attrs.field(kw_only=True, default=EngineInstance)

    def build_instance(self, instance_id: str, model: str, kv_policy: Any) -> EngineInstance:
        sc = self.scenario
        latency = self.latency_models[model]
        kv = KVClassManager(sc.num_blocks, sc.block_size, kv_policy, sc.kv_bytes_per_token)
        return self.instance_cls(instance_id, model, kv, latency, tpot_slo_s(sc, latency), EngineLimits(sc.token_budget))


class PriorityInstance(EngineInstance):
    """vLLM's priority waiting queue for request-level shadows (ids starting
    with :data:`SHADOW_PREFIX`, the lowest priority): a routed or normal
    request enqueued goes ahead of every waiting shadow, in arrival order
    among its own kind. Everything else is the simulator's engine."""

    def enqueue(self, req: EngineRequest) -> None:
        super().enqueue(req)
        if req.request_id.startswith(SHADOW_PREFIX):
            return
        waiting = self.waiting
        first = next((i for i, r in enumerate(waiting) if r.request_id.startswith(SHADOW_PREFIX)), None)
        if first is not None:
            waiting.pop()
            waiting.insert(first, req)


@attrs.frozen
class _Prefix:
    """A session's history as it was when a call completed: the block hashes a
    request-level shadow of it computes (its token ids, in vLLM)."""

    hashes: tuple
    token_ids: None = None

    def block_hashes(self, block_size: int, num_blocks: int | None = None) -> tuple:
        return self.hashes if num_blocks is None else self.hashes[:num_blocks]


@attrs.define(eq=False)
class SimRequestLevelRun(SimEffectRun):
    """The request-level baseline in the simulator: after each routed call
    completes, its context goes to the other models' instances through the
    gateway's own :class:`~shadow_gateway.request_level.RequestLevelShadower`
    (one in flight per instance, sent when that instance's waiting queue is
    empty, newest per session, dropped when the session's call arrives
    there), as a lowest-priority request with one output token."""

    instance_cls: type = attrs.field(kw_only=True, default=PriorityInstance)
    shadower: Any = attrs.field(init=False, default=None)
    _prefixes: dict[tuple[str, int], _Prefix] = attrs.field(init=False, factory=dict)

    def _shadower(self) -> Any:
        if self.shadower is None:
            from shadow_gateway.request_level import RequestLevelShadower

            self.shadower = RequestLevelShadower(self._submit, self.cluster.num_waiting)
        return self.shadower

    def start_call(self, request_id: str, placement: Any, history: Any, num_output_tokens: int,
                   on_tokens: Callable, on_finish: Callable) -> None:
        from shadow_gateway.request_level import Destination

        shadower = self._shadower()
        shadower.on_call_arrival(history.session_id, placement.instance_id)
        model = self.cluster.by_id[placement.instance_id].model
        others = [Destination(i.instance_id, i.model) for i in self.cluster.by_id.values() if i.model != model]

        def tokens(n: int, ids: Any, f: Callable = on_tokens) -> None:
            f(n, ids)
            shadower.pump()  # as the virtual feeder, after every router-side event

        def finished(outcome: Any, f: Callable = on_finish) -> None:
            n = history.num_tokens  # prompt + output, before the next call's input
            bs = self.scenario.block_size
            self._prefixes[(history.session_id, n)] = _Prefix(tuple(history.block_hashes(bs, n // bs)))
            f(outcome)
            shadower.on_call_complete(history.session_id, range(n), (), others)
            shadower.pump()

        super().start_call(request_id, placement, history, num_output_tokens, tokens, finished)

    def _submit(self, shadow: Any) -> None:
        inst = self.cluster.by_id[shadow.destination.instance_id]
        n = len(shadow.prompt_token_ids)
        req = EngineRequest(shadow.submission_id, RequestKind.NORMAL, self._prefixes[(shadow.session_id, n)], n, 1,
                            self.loop.now_s, math.inf, inst.tpot_slo_s, on_finish=self._shadow_done)
        # an event of its own: a submission comes from inside an iteration's end (a token, a finish)
        self.loop.at(self.loop.now_s, NORMAL, lambda t: self._enqueue(inst, req))

    def _shadow_done(self, req: EngineRequest, now_s: float) -> None:
        self.shadower.on_shadow_finished(req.request_id, not req.rejected)
        self.shadower.pump()


def _ref(policy: str | PluginRef) -> PluginRef:
    return policy if isinstance(policy, PluginRef) else PluginRef(policy)


def run_sim(arm: str, scenario: FakeScenario, sessions: Sequence[Any], latency: Mapping[str, LatencyModel],
            arms: Mapping[str, tuple[str | PluginRef, bool]] = ARMS) -> list[CallRecord]:
    """The arm's routed calls in the simulator (``arms``: where the arm's policy is looked up)."""
    return list(sim_run(arm, scenario, sessions, latency, arms).calls)


def sim_run(arm: str, scenario: FakeScenario, sessions: Sequence[Any], latency: Mapping[str, LatencyModel],
            arms: Mapping[str, tuple[str | PluginRef, bool]] = ARMS) -> SimEffectRun:
    """The arm's finished simulator run (its ``calls`` and ``normal`` requests)."""
    policy, _ = arms[arm]
    cls = SimRequestLevelRun if arm == "request-level" else SimEffectRun
    run = cls(scenario, ShadowConfig(_ref(policy)), sessions=tuple(sessions), latency_models=latency)
    run.run()
    return run


# -- vLLM virtual time ---------------------------------------------------------------------
class RequestLevelFeeder:
    """The request-level baseline on a :class:`~shadow_vllm.virtual.VirtualScenarioRun`
    (its ``shadow_feeder``, called after every router-side event): completed
    calls go to the other models' instances through a ``RequestLevelShadower``."""

    def __init__(self) -> None:
        self.shadower: Any = None
        self._num_calls_seen = 0
        self._num_requests_seen: dict[str, int] = {}  # per instance: requests already looked at (in added order)

    def __call__(self, run: Any) -> None:
        from shadow_gateway.request_level import Destination, RequestLevelShadower

        from shadow_vllm.backend import virtual_submitter

        engines = run.cluster.by_id
        if self.shadower is None:
            self.shadower = RequestLevelShadower(virtual_submitter(engines, lambda: self.shadower),
                                                 lambda i: len(engines[i].scheduler.waiting))
        for instance, engine in engines.items():  # calls seen on an instance drop that session's pending shadow
            seen = self._num_requests_seen.get(instance, 0)
            for rid in itertools.islice(engine.requests, seen, None):  # only those added since the last call
                if "#" in rid and not rid.startswith("shadow-"):
                    self.shadower.on_call_arrival(rid.split("#")[0], instance)
            self._num_requests_seen[instance] = len(engine.requests)
        for call in run.calls[self._num_calls_seen:]:
            handle = run.cluster.by_model[call.model][0].requests[f"{call.session_id}#{call.call_index}"]
            others = [Destination(engine.name, model) for model, engines_of in run.cluster.by_model.items()
                      if model != call.model for engine in engines_of]
            self.shadower.on_call_complete(call.session_id, handle.prompt_token_ids, handle.output_token_ids, others)
        self._num_calls_seen = len(run.calls)
        self.shadower.pump()


def host_tier_config(scenario: FakeScenario) -> dict[str, Any]:
    """``VirtualEngineConfig`` fields of a host tier as large, in tokens, and as fast, in tokens per
    second, as the simulator's (the policies' default host capacity and PCIe link at the scenario's
    KV bytes per token), on the virtual engine's stand-in KV."""
    from shadow_policies.building import HOST_CAPACITY_BYTES, PCIE_BYTES_PER_S

    tokens = HOST_CAPACITY_BYTES / scenario.kv_bytes_per_token
    bs = scenario.block_size
    return {"kv_offloading_bytes": int(tokens // bs * bs * VIRTUAL_KV_BYTES_PER_TOKEN),
            "kv_transfer_bytes_per_s": PCIE_BYTES_PER_S / scenario.kv_bytes_per_token * VIRTUAL_KV_BYTES_PER_TOKEN}


def run_virtual(arm: str, scenario: FakeScenario, sessions: Sequence[Any], latency: Mapping[str, LatencyModel],
                latency_spec: Callable[[str], dict[str, Any]], keep_tails_below_n_min: bool = True,
                arms: Mapping[str, tuple[str | PluginRef, bool]] = ARMS) -> list[CallRecord]:
    """The arm's routed calls on vLLM's scheduler in virtual time. ``latency_spec(model)``: the
    ``{"name", "args"}`` plugin reference the shadow scheduler rebuilds ``latency[model]`` from.
    ``keep_tails_below_n_min``: the shadow scheduler's option (``docs/vllm.md``, "Tails below
    n_min"); true by default here, as the feeder (``TaggedShadowFeeder``) ends shadows itself.
    ``arms``: where the arm's policy is looked up."""
    return list(virtual_run(arm, scenario, sessions, latency, latency_spec, keep_tails_below_n_min, arms).calls)


def virtual_run(arm: str, scenario: FakeScenario, sessions: Sequence[Any], latency: Mapping[str, LatencyModel],
                latency_spec: Callable[[str], dict[str, Any]], keep_tails_below_n_min: bool = True,
                arms: Mapping[str, tuple[str | PluginRef, bool]] = ARMS) -> Any:
    """:func:`run_virtual`'s finished :class:`~shadow_vllm.virtual.VirtualScenarioRun` (its ``calls``
    and ``normal`` requests)."""
    from shadow_vllm import virtual
    from shadow_vllm.scheduler import ShadowScheduler

    policy, host = arms[arm]
    shadow = ShadowConfig(_ref(policy))
    engine_level = arm not in ("no-shadow", "request-level")
    configs = {}
    for m in scenario.models:
        extra = {}
        if engine_level:  # the engine rebuilds the same policy, SLOs and latency model
            extra = {"shadowprefill": {
                "shadow": json.loads(shadow.to_json()),
                "slo": {"ttft_s": scenario.slo.ttft_s, "tpot_s": tpot_slo_s(scenario, latency[m])},
                "latency": latency_spec(m),
                "keep_tails_below_n_min": keep_tails_below_n_min,
            }}
        configs[m] = virtual.VirtualEngineConfig(
            block_size=scenario.block_size, num_blocks=scenario.num_blocks + 1,  # + vLLM's null block
            max_num_batched_tokens=scenario.token_budget, max_num_seqs=256,
            scheduling_policy="priority" if arm == "request-level" else "fcfs", additional_config=extra,
            **(host_tier_config(scenario) if host else {}))
    feeder = virtual.TaggedShadowFeeder() if engine_level else RequestLevelFeeder() if arm == "request-level" else None
    vrun = virtual.VirtualScenarioRun(scenario, shadow, latency, configs, sessions=tuple(sessions),
                                      scheduler_cls=ShadowScheduler if engine_level else None, shadow_feeder=feeder)
    return vrun.run()


# -- the workload ------------------------------------------------------------------------
def write_session_file(path: Any, num_sessions: int, span_s: float, *, calls: int = 6, switch_probability: float = 0.4,
                       first_input: tuple[int, int] = (800, 2500), new_input: tuple[int, int] = (100, 1200),
                       output: tuple[int, int] = (40, 200), gap_s: tuple[float, float] = (0.5, 2.0),
                       seed: int = 0) -> None:
    """A call CSV (``shadow_traces.agent_loaders.load_call_csv``) of ``num_sessions`` sessions
    arriving evenly over ``span_s`` from 1 s, each of ``calls`` calls on two recorded models
    (``small``, ``large``) that switch with ``switch_probability`` per call, token counts and
    tool gaps uniform in the given ranges (seeded)."""
    import random
    from pathlib import Path

    rng = random.Random(seed)
    rows = ["session_id,call_index,model,arrival_s,gap_s,input_tokens,output_tokens,compact_to_tokens"]
    for k in range(num_sessions):
        model = rng.choice(["small", "large"])
        for i in range(calls):
            if i and rng.random() < switch_probability:
                model = "large" if model == "small" else "small"
            arrival = f"{1.0 + span_s * k / num_sessions:.3f}" if i == 0 else ""
            gap = "" if i == 0 else f"{rng.uniform(*gap_s):.3f}"
            tokens = rng.randint(*(first_input if i == 0 else new_input))
            rows.append(f"s{k},{i},{model},{arrival},{gap},{tokens},{rng.randint(*output)},")
    Path(path).write_text("\n".join(rows) + "\n")


# -- effects -------------------------------------------------------------------------------
def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def effects(calls: Sequence[CallRecord], base: Sequence[CallRecord]) -> dict[str, float]:
    """The effects of one arm's ``calls`` against no-shadow's ``base`` in the same engine (the
    calls both finished, paired by session and call index)."""
    by_key = {(c.session_id, c.call_index): c for c in base}
    pairs = [(c, by_key[(c.session_id, c.call_index)]) for c in calls if (c.session_id, c.call_index) in by_key]
    switch = [(c, b) for c, b in pairs if c.is_switch]
    same = [(c, b) for c, b in pairs if not c.is_switch]
    sw_ttft, sw_base = _mean([c.ttft_s for c, _ in switch]), _mean([b.ttft_s for _, b in switch])
    same_ttft, same_base = _mean([c.ttft_s for c, _ in same]), _mean([b.ttft_s for _, b in same])
    prompt = sum(c.num_prompt_tokens for c, _ in switch)
    return {
        "switch_calls": float(len(switch)), "same_calls": float(len(same)),
        "switch_ttft_s": sw_ttft, "same_ttft_s": same_ttft,
        "switch_ttft_reduction": 1.0 - sw_ttft / sw_base,
        "switch_hit_rate": sum(c.num_cached_tokens for c, _ in switch) / prompt if prompt else math.nan,
        "same_ttft_ratio": same_ttft / same_base,
    }


def compared_effects(arm: str) -> tuple[str, ...]:
    """What the tolerances apply to for ``arm`` (no-shadow: its own TTFTs, not the 0 and 1 of its effects)."""
    if arm == "no-shadow":
        return ("switch_ttft_s", "switch_hit_rate", "same_ttft_s")
    return ("switch_ttft_reduction", "switch_hit_rate", "same_ttft_ratio")


def within(effect: str, sim: float, vllm: float) -> bool:
    kind, bound = TOLERANCE[effect]
    gap = abs(vllm - sim)
    return gap <= (bound * abs(sim) if kind == "rel" else bound)


@attrs.frozen
class ArmAgreement:
    arm: str
    sim: Mapping[str, float]
    vllm: Mapping[str, float]

    @property
    def misses(self) -> tuple[str, ...]:
        """The compared effects outside their tolerance (NaN misses: nothing to compare)."""
        return tuple(e for e in compared_effects(self.arm) if not within(e, self.sim[e], self.vllm[e]))


def compare(sim: Mapping[str, Sequence[CallRecord]], vllm: Mapping[str, Sequence[CallRecord]]
            ) -> list[ArmAgreement]:
    """Each arm's effects in both engines (each against its own engine's no-shadow)."""
    return [ArmAgreement(arm, effects(sim[arm], sim["no-shadow"]), effects(vllm[arm], vllm["no-shadow"]))
            for arm in sim]


def table(rows: Sequence[ArmAgreement]) -> str:
    """The comparison as text: per arm and effect, the simulator, vLLM, the gap and the verdict."""
    lines = [f"{'arm':14s} {'effect':22s} {'simulator':>10s} {'vLLM':>10s} {'gap':>9s}  tolerance  verdict"]
    for row in rows:
        for e in compared_effects(row.arm):
            kind, bound = TOLERANCE[e]
            s, v = row.sim[e], row.vllm[e]
            gap = (v - s) / abs(s) if kind == "rel" and s else v - s
            tol = f"{bound:.0%} rel" if kind == "rel" else f"{bound:g} abs"
            lines.append(f"{row.arm:14s} {e:22s} {s:10.4f} {v:10.4f} {gap:+9.4f}  {tol:9s}  "
                         f"{'ok' if within(e, s, v) else 'MISS'}")
        lines.append(f"{'':14s} {'(calls switch/same)':22s} {row.sim['switch_calls']:4.0f}/{row.sim['same_calls']:<5.0f}"
                     f" {row.vllm['switch_calls']:4.0f}/{row.vllm['same_calls']:<5.0f}")
    return "\n".join(lines)


__all__ = ["ARMS", "TOLERANCE", "ArmAgreement", "PriorityInstance", "RequestLevelFeeder", "SimEffectRun",
           "SimRequestLevelRun", "compare", "compared_effects", "effects", "host_tier_config", "run_sim",
           "run_virtual", "sim_run", "table", "tpot_slo_s", "virtual_run", "within", "write_session_file"]
