"""A workload through vLLM schedulers in virtual time
(:class:`VirtualScenarioRun`): the core's router side and the one
:class:`~shadowcore.engine.driver.SessionDriver`, with virtual engines as its
serving port.

Invariants: same request ids, arrival times, tool gaps and outputs as the
simulator's run of the same workload; histories carry real token ids (new
input from :func:`session_tokens`, output as vLLM samples it); a normal
request's prompt is fresh ids, its leading tokens from its trace prefix's
hashes where it has one (:meth:`~shadowcore.workloads.prefix.PromptPrefix.token_ids`),
so vLLM's own prefix cache finds what the trace shares.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from shadow_vllm.virtual.clock import VirtualClock, hashed_token
from shadow_vllm.virtual.cluster import VirtualCluster
from shadow_vllm.virtual.config import VirtualEngineConfig, build_scheduler
from shadow_vllm.virtual.engine import VirtualEngine, VirtualRequest
from shadowcore.engine.driver import CallOutcome, SessionDriver
from shadowcore.engine.records import CallRecord
from shadowcore.engine.workload import draw_workload
from shadowcore.events import EventLoop
from shadowcore.latency import LatencyModel
from shadowcore.pipeline import build_runtime
from shadowcore.wire import ShadowTag, TagKind
from shadowcore.workloads.prefix import PromptPrefix


def session_tokens(session_id: str, index: int, num_tokens: int, vocab_size: int = 1024) -> list[int]:
    """The new input tokens of call ``index`` of a session (deterministic)."""
    return [hashed_token(f"{session_id}#{index}", i, vocab_size) for i in range(num_tokens)]


@attrs.define(eq=False)
class VirtualScenarioRun:
    """Agent sessions and normal traffic (the fake backend's scenario, same
    draws) through vLLM schedulers in virtual time, with the core's router
    side (:class:`~shadowcore.manager.ShadowManager`) placing calls.

    The router side is the simulator's own
    (:class:`~shadowcore.engine.driver.SessionDriver`, same request ids,
    arrival times, tool gaps, outputs), so the two runs can be compared step
    by step; this run is the driver's serving port for vLLM engines. Histories carry real token
    ids (new input from :func:`session_tokens`, output as vLLM samples it).
    ``latency`` maps each model to its latency model; ``engine_config`` gives
    the vLLM limits; ``shadow_feeder`` (optional) is called after every
    router-side event to turn the manager's jobs into shadow requests.
    """

    scenario: Any  # a ScenarioSpec: models, instances_per_model, SLOs, the synthetic workload's fields
    shadow: Any  # ShadowConfig
    latency: Mapping[str, LatencyModel]
    engine_config: Mapping[str, VirtualEngineConfig]  # per model
    scheduler_cls: type | None = None
    sessions: Sequence[Any] | None = None  # scripted SessionPlans in place of the workload's
    shadow_feeder: Callable[[VirtualScenarioRun], None] | None = None
    observers: tuple = ()
    workload: Any = None  # a Workload; None: drawn from the scenario (the fake backend's draws)
    loop: EventLoop = attrs.field(init=False, factory=EventLoop)
    clock: VirtualClock = attrs.field(init=False, factory=VirtualClock)
    cluster: VirtualCluster = attrs.field(init=False)
    runtime: Any = attrs.field(init=False)
    driver: SessionDriver = attrs.field(init=False)
    normal: list[VirtualRequest] = attrs.field(init=False, factory=list)

    def __attrs_post_init__(self) -> None:
        sc = self.scenario
        by_model = {
            m: [
                VirtualEngine(build_scheduler(self.scheduler_cls, self._config(m, f"{m}/{k}")), self.latency[m],
                              self.loop, self.clock, name=f"{m}/{k}",
                              transfer_bytes_per_s=self.engine_config[m].kv_transfer_bytes_per_s)
                for k in range(sc.instances_per_model)
            ]
            for m in sc.models
        }
        self.cluster = VirtualCluster(self.loop, by_model)
        self.runtime = build_runtime(self.shadow, self.cluster, sc.models)
        for obs in self.observers:
            self.runtime.observers.add(obs)
        if self.workload is None:
            self.workload = draw_workload(sc, list(self.cluster.by_id), sessions=self.sessions)
        elif self.sessions is not None:
            self.workload = attrs.evolve(self.workload, sessions=tuple(self.sessions))
        self.driver = SessionDriver(self.loop, self.runtime.manager, self)

    def _config(self, model: str, instance_id: str) -> VirtualEngineConfig:
        """The model's engine config; a shadow scheduler section gets this instance's id."""
        config = self.engine_config[model]
        extra = dict(config.additional_config)
        if "shadowprefill" in extra:
            extra["shadowprefill"] = {**extra["shadowprefill"], "instance_id": instance_id}
        return attrs.evolve(config, additional_config=extra)

    @property
    def calls(self) -> list[CallRecord]:
        return self.driver.calls

    def run(self) -> VirtualScenarioRun:
        self.driver.schedule(self.workload, list(self.cluster.by_id))
        self.loop.run()
        return self

    # -- the driver's serving port ---------------------------------------------------
    def input_token_ids(self, session_id: str, call_index: int, model: str, num_tokens: int) -> tuple[int, ...]:
        vocab = self.cluster.by_model[model][0].scheduler.vllm_config.model_config.get_vocab_size()
        return tuple(session_tokens(session_id, call_index, num_tokens, vocab))

    def start_call(self, request_id: str, placement: Any, history: Any, num_output_tokens: int,
                   on_tokens: Callable, on_finish: Callable[[CallOutcome], None]) -> None:
        engine = self.cluster.by_id[placement.instance_id]
        if self.shadow_feeder is not None:  # jobs closed by this call go before the call starts
            self.shadow_feeder(self)
        engine.add_request(
            request_id, list(history.token_ids), num_output_tokens,
            extra_args=ShadowTag(TagKind.ROUTED, history.session_id).to_extra_args(),
            on_token=lambda r, tok, f=on_tokens: self._token(f, tok),
            on_finish=lambda r, f=on_finish: f(CallOutcome(
                False, r.arrival_s, r.first_token_s, r.finish_s, len(r.prompt_token_ids), r.num_cached_tokens or 0)),
        )

    def start_normal(self, request_id: str, instance_id: str, num_prompt_tokens: int,
                     num_output_tokens: int, prefix: PromptPrefix | None = None) -> None:
        engine = self.cluster.by_id[instance_id]
        vocab = engine.scheduler.vllm_config.model_config.get_vocab_size()
        shared = [] if prefix is None else prefix.token_ids(num_prompt_tokens, vocab)  # equal hashes, equal ids
        prompt = shared + [hashed_token(request_id, i, vocab) for i in range(len(shared), num_prompt_tokens)]
        self.normal.append(engine.add_request(request_id, prompt, num_output_tokens))

    @property
    def normal_hit_rate(self) -> float:
        """Cached prompt tokens / prompt tokens of the normal requests vLLM
        prefilled (its own prefix cache's hits), NaN for none."""
        seen = [r for r in self.normal if r.num_cached_tokens is not None]
        total = sum(len(r.prompt_token_ids) for r in seen)
        return sum(r.num_cached_tokens for r in seen) / total if total else float("nan")

    def settle(self) -> None:
        if self.shadow_feeder is not None:
            self.shadow_feeder(self)
        self.cluster.kick_all()

    def _token(self, on_tokens: Callable, token: int) -> None:
        """Streamed output extends the session (and so every job on other models)."""
        on_tokens(1, [token])
        if self.shadow_feeder is not None:
            self.shadow_feeder(self)
