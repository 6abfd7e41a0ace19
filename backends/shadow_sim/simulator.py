"""The simulator backend: a multi-model cluster of engine instances (the
core kit's vLLM-v1-like engine) with catalog models, tensor parallelism, KV
pools sized from HBM, host tiers per GPU, latency from a Vidur-grounded or a
roofline model, and GPU energy.

The ``sim`` backend (:mod:`shadow_sim.backend`) runs a :class:`SimScenario`
as a :class:`SimRun` (or, with ``pd`` set, :class:`shadow_sim.disagg.PDRun`).
Same seed, same result: the workload is drawn from the scenario seed before
the run; events are processed from one heap with the tie-break rule of
:mod:`shadowcore.engine.kinds`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from shadow_sim.hardware import get_device, tensor_parallel_degree
from shadow_sim.latency import KINDS as LATENCY_KINDS
from shadow_sim.latency import latency_model, resolve_profile, vidur_available
from shadow_sim.models import get_model
from shadowcore._validators import fraction_open_closed, positive, positive_int
from shadowcore.config import build_attrs
from shadowcore.engine.cluster import EngineCluster
from shadowcore.engine.instance import EngineInstance, EngineLimits, pool_blocks
from shadowcore.engine.run import ScenarioRun
from shadowcore.engine.workload import ScenarioSpec, SessionPlan, defaults, from_agent_sessions
from shadowcore.errors import ConfigError
from shadowcore.kv import KVClassManager, KVClassPolicy
from shadowcore.latency import BatchShape
from shadowcore.workloads.sessions import SessionPreset, for_pair, generate, get_preset


def _tuple(v: Iterable) -> tuple:
    return tuple(v)


@attrs.frozen
class PDConfig:
    """Prefill/decode disaggregation of every model (§3.5, Appendix C): each
    model gets ``num_prefill`` prefill-only and ``num_decode`` decode instances
    (these replace ``instances_per_model``); a decode instance receives KV over
    an inbound link of ``link_bytes_per_s`` per GPU; shadow KV moves in pushes
    of at most ``push_tokens``; shadow iterations on prefill instances last at
    most ``max_iteration_s``. Run by :class:`shadow_sim.disagg.PDRun`."""

    num_prefill: int = attrs.field(default=3, validator=positive_int)
    num_decode: int = attrs.field(default=1, validator=positive_int)
    link_bytes_per_s: float = attrs.field(default=50e9, validator=positive)
    push_tokens: int = attrs.field(default=4096, validator=positive_int)
    max_iteration_s: float = attrs.field(default=0.1, validator=positive)


def _pd_config(value: Any) -> PDConfig | None:
    """``None`` (colocated), a :class:`PDConfig`, or its fields as a mapping."""
    if value is None or isinstance(value, PDConfig):
        return value
    return build_attrs(PDConfig, "pd", value)


@attrs.frozen(field_transformer=defaults(
    models=("Qwen2.5-7B", "Llama-3.1-70B"), instances_per_model=4, duration_s=600.0, warmup_s=120.0,
    session_rate_per_s=0.05, calls_per_session=10, input_tokens_median=1000, output_tokens_median=200,
    normal_rate_per_s=1.0, normal_prompt_median=1000, normal_output_median=200,
))
class SimScenario(ScenarioSpec):
    """A cluster and a workload: the shared :class:`ScenarioSpec` fields (SLO
    floors: TTFT >= 1 s, TPOT >= 25 ms) with the simulator's defaults, and
    the simulator's own. Model names come from the catalog
    (:data:`shadow_sim.models.MODELS`); ``tp`` of 0 means the paper's rule
    (smallest of 1, 2, 4, 8 at which weights take at most half of HBM)."""

    device: str = "H100-80GB"
    latency: str = "vidur"  # "vidur" (needs the sim extra), "roofline" or "auto"
    #: A latency profile applied to every instance's latency model
    #: (:mod:`shadowcore.calibration`): a shipped name
    #: (:func:`shadow_sim.latency.shipped_profiles`), a JSON file, or "" for none.
    latency_profile: str = ""
    tp: tuple[int, ...] = attrs.field(default=(), converter=_tuple)
    max_num_seqs: int = attrs.field(default=256, validator=positive_int)
    memory_utilization: float = attrs.field(default=0.9, validator=fraction_open_closed)
    #: A Table 1 session preset (``shadowcore.workloads.sessions.PRESETS``) instead
    #: of the Markov session fields above; its small/large models map to
    #: ``models[0]``/``models[1]`` and it compacts at their context windows.
    preset: str = ""
    pd: PDConfig | None = attrs.field(default=None, converter=_pd_config)  # None: colocated

    def __attrs_post_init__(self) -> None:
        for i, name in enumerate(self.models):
            try:
                get_model(name)
            except ConfigError as e:
                raise ConfigError(f"models[{i}]", name, e.problem) from None
        if len(set(self.models)) != len(self.models) or len(self.models) < 2:
            raise ConfigError("models", self.models, "needs at least two distinct models")
        get_device(self.device)
        if self.latency not in LATENCY_KINDS:
            raise ConfigError("latency", self.latency, f"must be one of {', '.join(LATENCY_KINDS)}")
        if self.latency == "vidur" and not vidur_available():
            raise ConfigError("latency", self.latency, "needs the sim extra: pip install -e '.[sim]' (or use roofline)")
        resolve_profile(self.latency_profile)  # a bad file or name fails here, before anything runs
        if self.tp and len(self.tp) != len(self.models):
            raise ConfigError("tp", self.tp, f"needs one entry per model ({len(self.models)})")
        for i, t in enumerate(self.tp):
            if t not in (0, 1, 2, 4, 8):
                raise ConfigError(f"tp[{i}]", t, "must be 0 (auto), 1, 2, 4 or 8")
        if self.preset:
            self.session_preset()  # unknown names list the valid ones; windows must fit
        for i, name in enumerate(self.models):  # the model must fit the device (before anything runs)
            try:
                self.tp_of(name)
            except ConfigError as e:
                raise ConfigError(f"models[{i}]", name, f"{e.problem} on {self.device}") from None

    def session_preset(self) -> SessionPreset:
        """The preset mapped onto this cluster's models and context windows."""
        preset = for_pair(get_preset(self.preset), self.models)
        if len(self.models) != len(preset.models):
            raise ConfigError("models", self.models, f"preset {self.preset!r} needs {len(preset.models)} models")
        windows = tuple(get_model(m).max_context_tokens for m in self.models)
        try:
            return attrs.evolve(preset, models=self.models, windows=windows,
                                session_rate_per_s=self.session_rate_per_s)
        except ConfigError as e:
            raise ConfigError("preset", self.preset, f"does not fit these models' windows {windows}: {e}") from None

    def tp_of(self, model: str) -> int:
        config, device = get_model(model), get_device(self.device)
        t = self.tp[self.models.index(model)] if self.tp else 0
        return t or tensor_parallel_degree(config, device)


@attrs.define(eq=False)
class SimRun(ScenarioRun):
    """A :class:`SimScenario` under one policy.

    Instances of one model share one latency model (:meth:`latency_of`): a
    latency model is a pure function of its batch (its memo caches only such
    values), so sharing it changes no result, and each instance's own copy
    of the Vidur tables (about 20 MB of Python floats) made memory, setup
    time and cache misses grow with the instance count."""

    #: model -> its instances' latency model (built on first use)
    _latency: dict[str, Any] = attrs.field(init=False, factory=dict)

    def latency_of(self, model: str) -> Any:
        """The latency model every instance of ``model`` in this run uses."""
        latency = self._latency.get(model)
        if latency is None:
            sc: SimScenario = self.scenario
            base = latency_model(get_model(model), get_device(sc.device), sc.tp_of(model), kind=sc.latency)
            latency = self._latency[model] = resolve_profile(sc.latency_profile).apply(base)
        return latency

    def build_instance(
        self, instance_id: str, model: str, kv_policy: KVClassPolicy,
        engine_cls: type[EngineInstance] = EngineInstance,
    ) -> EngineInstance:
        sc: SimScenario = self.scenario
        config, device, tp = get_model(model), get_device(sc.device), sc.tp_of(model)
        latency = self.latency_of(model)
        kv_bytes = float(config.kv_bytes_per_token())
        blocks = pool_blocks(device.hbm_bytes * tp, config.serving_weight_bytes, kv_bytes, sc.block_size,
                             sc.memory_utilization)
        if kv_policy.host is not None:  # the policy's host tier is per GPU
            host = attrs.evolve(kv_policy.host, capacity_bytes=kv_policy.host.capacity_bytes * tp)
            kv_policy = attrs.evolve(kv_policy, host=host)
        kv = KVClassManager(blocks, sc.block_size, kv_policy, kv_bytes)
        tpot = max(sc.slo.tpot_s, 5 * latency.predict_s(BatchShape((), (sc.input_tokens_median,))))
        return engine_cls(
            instance_id, model, kv, latency, tpot, EngineLimits(sc.token_budget, sc.max_num_seqs),
            num_gpus=tp, idle_power_w=device.idle_power_w, busy_power_w=device.busy_power_w,
            validate_values=False,  # speed: the engine tests run the same code with validation on
        )

    def build_cluster(self, extra: int) -> EngineCluster:
        """The base cluster, with placement estimates windowed at the smallest
        context window of the scenario's models."""
        return attrs.evolve(super().build_cluster(extra), window_tokens=self.placement_window_tokens())

    def placement_window_tokens(self) -> int:
        return min(get_model(m).max_context_tokens for m in self.scenario.models)

    def session_plans(self) -> list[SessionPlan]:
        """The scenario's Markov sessions, or its preset's sessions when it names one."""
        sc: SimScenario = self.scenario
        if not sc.preset:
            return super().session_plans()
        return from_agent_sessions(generate(sc.session_preset(), sc.duration_s, sc.seed))

    def summary(self) -> dict[str, float]:
        out = super().summary()
        wall = self.loop.now_s
        energy = sum(i.energy_j(wall) for i in self.cluster.by_id.values())
        good = sum(1 for _, met in self.normal if met) + len(self.calls)
        out["energy_j"] = energy
        out["energy_per_good_request_j"] = energy / good if good else float("nan")
        return out
