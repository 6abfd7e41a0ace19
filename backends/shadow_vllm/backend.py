"""vLLM in virtual time as a backend (:class:`shadowcore.backend.Backend`).

:class:`VirtualBackend` runs the fake backend's workload (a
:class:`~shadowcore.engine.scenario.FakeScenario` or its fields) through
vLLM's real scheduler and KV cache manager, one :class:`~shadow_vllm.scheduler.ShadowScheduler`
per instance, in virtual time (:mod:`shadow_vllm.virtual`): the router side
places calls, a :class:`~shadow_vllm.virtual.TaggedShadowFeeder` sends its jobs
as tagged shadow requests, and each engine's hook plans its shadow chunks.
Instances of a model share the fake backend's linear latency model (scaled by
``latency_scale``), so the two backends run the same workload on the same
timeline model. It is what ``shadowcore.testing.check_backend`` holds to the
backend contract on vLLM. :func:`virtual_submitter` plugs virtual engines into
the router side's request-level shadower (stock vLLM, Appendix D.1).

Invariants: the observers given to :meth:`VirtualBackend.run` are registered
with the router side and with every engine's hook before anything runs; no
wall clock and no RNG outside the seeded configuration.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from shadow_vllm import virtual
from shadowcore.config import ShadowConfig
from shadowcore.engine.records import ScenarioResult
from shadowcore.engine.scenario import FakeScenario
from shadowcore.latency import BatchShape, LinearLatencyModel

if TYPE_CHECKING:  # the router side's types, for annotations only (no import of the gateway package)
    from shadow_gateway.request_level import RequestLevelShadower, ShadowSubmission


def _latency(scale: float) -> LinearLatencyModel:
    base = LinearLatencyModel()
    return LinearLatencyModel(base.overhead_s * scale, base.prefill_s_per_token * scale,
                              base.attention_s_per_token_pair * scale, base.decode_s_per_seq * scale,
                              base.decode_s_per_context_token * scale)


class VirtualBackend:
    """The fake backend's workload on vLLM's scheduler in virtual time."""

    name = "vllm-virtual"

    def build(self, workload: Mapping[str, Any] | FakeScenario, shadow: ShadowConfig,
              observers: Sequence[Any] = ()) -> virtual.VirtualScenarioRun:
        """The run, built and not started, with ``observers`` registered."""
        from shadow_vllm.scheduler import ShadowScheduler

        sc = workload if isinstance(workload, FakeScenario) else FakeScenario.from_dict(workload)
        latency, configs = {}, {}
        for model, scale in zip(sc.models, sc.latency_scale, strict=True):
            latency[model] = model_latency = _latency(scale)
            tpot = max(sc.slo.tpot_s, 5 * model_latency.predict_s(BatchShape((), (sc.input_tokens_median,))))
            args = {f: getattr(model_latency, f) for f in ("overhead_s", "prefill_s_per_token",
                                                            "attention_s_per_token_pair", "decode_s_per_seq",
                                                            "decode_s_per_context_token")}
            extra = {"shadowprefill": {"shadow": json.loads(shadow.to_json()),
                                       "slo": {"ttft_s": sc.slo.ttft_s, "tpot_s": tpot},
                                       "latency": {"name": "linear", "args": args}}}
            configs[model] = virtual.VirtualEngineConfig(
                block_size=sc.block_size, num_blocks=sc.num_blocks + 1,  # + vLLM's null block
                max_num_batched_tokens=sc.token_budget, additional_config=extra)
        run = virtual.VirtualScenarioRun(sc, shadow, latency, configs, scheduler_cls=ShadowScheduler,
                                         shadow_feeder=virtual.TaggedShadowFeeder(), observers=tuple(observers))
        for engine in run.cluster.by_id.values():
            for observer in observers:
                engine.scheduler.shadow_hook.observers.add(observer)
        return run

    def run(self, workload: Mapping[str, Any] | FakeScenario, shadow: ShadowConfig,
            observers: Sequence[Any] = ()) -> ScenarioResult:
        run = self.build(workload, shadow, observers).run()
        calls = tuple(run.calls)
        ttft = [c.ttft_s for c in calls]
        engines = run.cluster.by_id.values()
        metrics = {
            "calls": float(len(calls)),
            "mean_ttft_s": sum(ttft) / len(ttft) if ttft else math.nan,
            "shadow_tokens": float(sum(e.scheduler.shadow_stats.num_shadow_tokens for e in engines)),
            "normal_requests": float(len(run.normal)),
            "normal_hit_rate": run.normal_hit_rate,
        }
        return ScenarioResult(run.runtime.policy.name, calls, metrics)


def virtual_submitter(engines: Mapping[str, Any], shadower_ref: Callable[[], RequestLevelShadower]) -> Callable:
    """A request-level ``submit`` (:class:`~shadow_gateway.request_level.RequestLevelShadower`)
    for :class:`~shadow_vllm.virtual.VirtualEngine` instances (by instance id): adds the
    shadow at the lowest priority and reports its end to the shadower ``shadower_ref()`` returns."""

    def submit(shadow: ShadowSubmission) -> None:
        engine = engines[shadow.destination.instance_id]
        engine.add_request(
            shadow.submission_id, shadow.prompt_token_ids, shadow.max_tokens, priority=shadow.priority,
            extra_args=shadow.extra_args,
            on_finish=lambda r: shadower_ref().on_shadow_finished(r.request_id, r.finish_reason != "abort"),
        )

    return submit


__all__ = ["VirtualBackend", "virtual_submitter"]
