"""The composition root: one place that wires router side -> shadow manager
-> engine hooks -> KV classes -> metrics from a :class:`ShadowConfig`.

The simulator, the in-memory fake engine and vLLM's engine core all call
:func:`build_runtime` with the same JSON configuration and get identical
objects; a backend then calls :meth:`ShadowRuntime.attach` once per engine
instance and drives the returned hook.

Invariants: the runtime owns the only ``numpy.random.Generator`` (seeded from
the configuration) and hands child generators to components; nothing here
reads wall time.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import attrs
import numpy as np

from shadowcore.config import ShadowConfig
from shadowcore.diagnostics import STEP_REASONS, unreachable_grant
from shadowcore.errors import ConfigError, PluginError
from shadowcore.hook import EngineHook, EnginePort
from shadowcore.kv import KVClassManager
from shadowcore.latency import LatencyModel
from shadowcore.manager import ClusterPort, ShadowManager
from shadowcore.metrics import ObserverSet
from shadowcore.pd import PushPolicy
from shadowcore.policy import PolicySpec, load_policy
from shadowcore.registry import load_reference

logger = logging.getLogger(__name__)


@attrs.define(eq=False)
class ShadowRuntime:
    config: ShadowConfig
    policy: PolicySpec
    manager: ShadowManager
    observers: ObserverSet
    rng: np.random.Generator
    hooks: dict[str, EngineHook] = attrs.Factory(dict)
    #: Warnings about this runtime's policy on its engines (see :meth:`notice`).
    notices: list[str] = attrs.Factory(list)
    _notice_keys: set[str] = attrs.field(init=False, factory=set)

    def attach(self, instance_id: str, port: EnginePort, latency: LatencyModel, *,
               prefill_iteration_s: float | None = None) -> EngineHook:
        """The hook for one engine instance (with its own slack controller).

        ``prefill_iteration_s``: the instance is a P/D prefill instance whose
        shadow iterations last at most that long; it runs the policy's
        ``prefill_slack`` (built with that ``max_iteration_s``), or ``slack``
        where the policy has none."""
        if instance_id in self.hooks:
            raise ValueError(f"instance {instance_id!r} already has a hook")
        child = np.random.default_rng(self.rng.integers(2**63))
        if prefill_iteration_s is not None and self.policy.prefill_slack is not None:
            slack = self.policy.prefill_slack.build(child, max_iteration_s=prefill_iteration_s)
        else:
            slack = self.policy.slack.build(child)
        hook = EngineHook(instance_id, self.manager, slack, latency, port, self.observers)
        self.hooks[instance_id] = hook
        return hook

    def push_policy(self, push_tokens: int, block_size: int) -> PushPolicy:
        """P/D: the policy's push policy (its ``push`` recipe) for a deployment
        of ``push_tokens`` per push and ``block_size`` tokens per block."""
        child = np.random.default_rng(self.rng.integers(2**63))
        return self.policy.push.build(child, push_tokens=push_tokens, block_size=block_size)

    def check_reach(self, hook: EngineHook, tpot_slo_s: float) -> None:
        """Report (:meth:`notice`) when ``hook``'s smallest grant can never fit
        a budget its controller gives under its latency model, on an instance
        whose TPOT SLO is ``tpot_slo_s`` (call it once the hook is final)."""
        why = unreachable_grant(hook.slack, hook.latency, hook.port.block_size, tpot_slo_s)
        if why is not None:
            self.notice(f"policy {self.policy.name!r} on {hook.instance_id}: {why}")

    def notice(self, message: str) -> None:
        """Log ``message`` as a warning and keep it in :attr:`notices` (each
        distinct text once, counting its instance out: one line per model
        and latency model, not per instance)."""
        key = message.split(": ", 1)[-1]
        if key not in self._notice_keys:
            self._notice_keys.add(key)
            self.notices.append(message)
            logger.warning("%s", message)

    def step_counts(self) -> dict[str, int]:
        """Iterations of every hook by reason (every reason listed, zeros included; see ``STEP_REASONS``)."""
        out = dict.fromkeys(STEP_REASONS, 0)
        for hook in self.hooks.values():
            for why, n in hook.step_counts.items():
                out[why] = out.get(why, 0) + n
        return out

    def kv_manager(self, num_blocks: int, block_size: int, kv_bytes_per_token: float) -> KVClassManager:
        """A KV class manager with this policy's rules (for backends that use the core's)."""
        return KVClassManager(num_blocks, block_size, self.policy.kv, kv_bytes_per_token)


def build_runtime(
    config: ShadowConfig,
    cluster: ClusterPort,
    models: Sequence[str],
    shadow_instances: dict[str, str] | None = None,
) -> ShadowRuntime:
    policy = load_policy(config.policy, field="shadow.policy")
    observers = ObserverSet()
    for i, ref in enumerate(config.observers):
        try:
            observers.add(load_reference(ref.name)(**ref.args))
        except (PluginError, TypeError) as e:
            raise ConfigError(f"shadow.observers[{i}].name", ref.name, str(e)) from None
    rng = np.random.default_rng(config.seed)
    manager = ShadowManager(
        cluster,
        tuple(models),
        policy.predictor.build(np.random.default_rng(rng.integers(2**63))),
        policy.targeting,
        shadow_instances=dict(shadow_instances or {}),
        oracle=policy.oracle,
        track_imminence=policy.slack.build(np.random.default_rng(0)).reads_imminence,
    )
    return ShadowRuntime(config, policy, manager, observers, rng)
