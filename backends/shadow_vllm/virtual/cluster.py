"""Virtual engines on one timeline (:class:`VirtualCluster`): the router
side's :class:`~shadowcore.manager.ClusterPort`.

Invariants: prefix lookups go through each engine's vLLM KV cache manager, so
histories must carry token ids; placement estimates price the queued prefill
work with the engine's latency model, windowed as the simulator's are
(:func:`~shadowcore.latency.windowed_prefill_s`).
"""

from __future__ import annotations

from typing import Any

import attrs

from shadow_vllm.virtual.engine import VirtualEngine
from shadowcore.events import EventLoop
from shadowcore.latency import windowed_prefill_s


@attrs.define(eq=False)
class VirtualCluster:
    """Virtual engines on one timeline, by instance id and model: the
    router side's :class:`~shadowcore.manager.ClusterPort` (histories must
    carry token ids; prefix lookups go through each vLLM KV cache manager)."""

    loop: EventLoop
    by_model: dict[str, list[VirtualEngine]]
    #: The placement estimate's window, as the simulator's ``EngineCluster.window_tokens`` (0: none).
    window_tokens: int = 0

    @property
    def by_id(self) -> dict[str, VirtualEngine]:
        return {e.name: e for engines in self.by_model.values() for e in engines}

    def instances(self, model: str) -> list[str]:
        return [e.name for e in self.by_model[model]]

    def block_size(self, instance_id: str) -> int:
        return self.by_id[instance_id].block_size

    def cached_prefix_tokens(self, instance_id: str, history: Any) -> int:
        if history.token_ids is None:
            raise ValueError(f"session {history.session_id}: a vLLM prefix lookup needs token ids")
        return self.by_id[instance_id].cached_prefix_tokens(history.token_ids)

    def estimated_prefill_completion_s(self, instance_id: str, num_uncached_tokens: int) -> float:
        engine = self.by_id[instance_id]
        sched = engine.scheduler
        queued = sum(max(0, r.num_tokens - r.num_computed_tokens - 1) for r in [*sched.waiting, *sched.running])
        budget = sched.max_num_scheduled_tokens
        return self.loop.now_s + windowed_prefill_s(engine.latency, queued + num_uncached_tokens, budget,
                                                    self.window_tokens)

    def kick_all(self) -> None:
        for engine in self.by_id.values():
            engine.wake()
