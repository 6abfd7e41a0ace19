"""The ``fake`` backend: a small agentic scenario on in-memory engine
instances with linear latency models, Markov-routed sessions over N models
plus Poisson normal traffic, run under any registered policy.

The workload is drawn from the scenario's own seed before the run
(:mod:`shadowcore.engine.workload`), so every policy sees identical sessions
and normal requests; the policy's randomness comes from the
:class:`ShadowConfig` seed through the composition root.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from shadowcore._validators import positive, positive_int
from shadowcore.config import ShadowConfig
from shadowcore.engine.instance import EngineInstance, EngineLimits
from shadowcore.engine.records import ScenarioResult
from shadowcore.engine.run import ScenarioRun
from shadowcore.engine.workload import ScenarioSpec
from shadowcore.errors import ConfigError
from shadowcore.kv import KVClassManager, KVClassPolicy
from shadowcore.latency import BatchShape, LinearLatencyModel


def _tuple(v: Iterable) -> tuple:
    return tuple(v)


@attrs.frozen
class FakeScenario(ScenarioSpec):
    """Everything that defines a fake-engine run except the policy: the
    shared :class:`ScenarioSpec` fields (with their defaults), a latency
    scale per model, and the KV pool of every instance."""

    latency_scale: tuple[float, ...] = attrs.field(default=(1.0, 3.0), converter=_tuple)
    num_blocks: int = attrs.field(default=8192, validator=positive_int)
    kv_bytes_per_token: float = attrs.field(default=131072.0, validator=positive)

    def __attrs_post_init__(self) -> None:
        if len(self.latency_scale) != len(self.models):
            raise ConfigError("latency_scale", self.latency_scale, f"needs one entry per model ({len(self.models)})")
        if len(set(self.models)) != len(self.models) or len(self.models) < 2:
            raise ConfigError("models", self.models, "needs at least two distinct model names")


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


class FakeBackend:
    """The ``fake`` backend: runs a :class:`FakeScenario` in memory on linear latencies (no extras needed)."""

    name = "fake"

    def run(self, scenario: Mapping[str, Any] | FakeScenario, shadow: ShadowConfig, observers: tuple = ()) -> ScenarioResult:
        sc = scenario if isinstance(scenario, FakeScenario) else FakeScenario.from_dict(scenario)
        return FakeRun(sc, shadow, observers).run()
