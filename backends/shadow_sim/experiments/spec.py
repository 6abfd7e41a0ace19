"""An experiment: a cluster, agentic sessions from a Table 1 preset, normal
traffic relative to calibrated capacity, and the measurement window (§5.1).

:class:`Experiment` is the value a user writes (JSON or flags);
:class:`ExperimentRun` plays one (experiment, seed, window) under one policy on
the simulator. Every policy of a comparison sees the same sessions and the same
normal requests: both are drawn from the seed before the run.

Measurement: sessions arrive over ``[0, warmup_s + duration_s)``; those arriving
before ``warmup_s`` warm the caches and are not measured; the run then drains
until every session finishes (the event loop runs dry). Normal traffic keeps
arriving for ``drain_s`` after the last session arrival so that the drain is not
an idle cluster; normal requests are measured over ``[warmup_s, warmup_s +
duration_s)``.

Context windows: the sessions compact at the SMALLEST window among the models
(and a preset's token caps are scaled down to fit it), so that every call fits
whichever model the router picks and no shadow ever exceeds its target's window.
Qwen2.5-7B (and the other Qwen2.5-based models) are catalogued with their
YaRN-extended 131,072 tokens, the window the paper runs them at (its FusionBench
p99 prompt is 58K in Table 1 and 75K in Table 5; D.3 names YaRN for SWE-bench).
A pair with its own published statistics (Table 5) gets them through
:func:`~shadowcore.workloads.sessions.for_pair`.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from shadow_sim.experiments.normal import NormalTraffic
from shadow_sim.models import MODELS, get_model
from shadow_sim.simulator import SimRun, SimScenario
from shadowcore._validators import non_negative, positive, positive_int
from shadowcore.config import PluginRef, build_attrs
from shadowcore.engine.cluster import EngineCluster
from shadowcore.engine.workload import NormalRequest, SessionPlan, from_agent_sessions, normal_requests
from shadowcore.errors import ConfigError
from shadowcore.workloads.sessions import PRESETS, SessionPreset, SyntheticScores, for_pair, generate, get_preset

#: Model pairs by name: the paper's figure labels of Table 3 (and a few of ours).
PAIRS: dict[str, tuple[str, str]] = {
    "Q7/L70": ("Qwen2.5-7B", "Llama-3.1-70B"),
    "L8/L70": ("Llama-3.1-8B", "Llama-3.1-70B"),
    "L8/Nemo12": ("Llama-3.1-8B", "Mistral-Nemo-12B"),
    "M7/L70": ("Mistral-7B", "Llama-3.1-70B"),
    "M7/Mx8x22": ("Mistral-7B", "Mixtral-8x22B"),
    "OSS20/OSS120": ("gpt-oss-20b", "gpt-oss-120b"),
    "Q7/L3.3-70": ("Qwen2.5-7B", "Llama-3.3-70B"),
    "G2-9/Mx8x7": ("Gemma-2-9B", "Mixtral-8x7B"),
    "G2-9/Granite34": ("Gemma-2-9B", "Granite-34B-code"),
    "S7/S32": ("SWE-agent-LM-7B", "SWE-agent-LM-32B"),
    "S7/Q72": ("SWE-agent-LM-7B", "Qwen2.5-72B"),
}


#: The embedded default of ``shadowprefill simulate`` (issue 4): a FusionBench-like
#: Qwen2.5-7B / Llama-3.1-70B pair, 4 instances per model, Azure-conversation-like
#: normal traffic at rho = 0.7. Shorter measurement than the paper's 600 s (and a
#: higher session rate so that enough calls are measured) to finish in minutes.
SIMULATE_DEFAULT: dict[str, Any] = {
    "models": list(PAIRS["Q7/L70"]), "preset": "fusionbench", "instances_per_model": 4,
    "duration_s": 240.0, "warmup_s": 60.0, "drain_s": 60.0, "session_rate_per_s": 0.1,
    "normal": {"kind": "poisson", "source": "azure-conv", "rho": 0.7, "window": "peak"},
}


def get_pair(name: str) -> tuple[str, str]:
    if name not in PAIRS:
        raise ConfigError("pair", name, f"unknown model pair (valid: {', '.join(PAIRS)})")
    return PAIRS[name]


def _models(value: Any) -> tuple[str, ...]:
    return tuple(value)


def _check_models(_instance: Any, _attribute: Any, value: tuple[str, ...]) -> None:
    for i, name in enumerate(value):
        try:
            get_model(name)
        except ConfigError:
            raise ConfigError(f"models[{i}]", name,
                              f"unknown model (valid: {', '.join(sorted(MODELS))})") from None
    if len(value) < 2 or len({get_model(m).name for m in value}) != len(value):
        raise ConfigError("models", value, "needs at least two distinct models")


def _check_preset(_instance: Any, _attribute: Any, value: str) -> None:
    if value and value not in PRESETS:
        raise ConfigError("preset", value, f"unknown session preset (valid: {', '.join(sorted(PRESETS))})")


def _normal(value: Any) -> NormalTraffic:
    if isinstance(value, NormalTraffic):
        return value
    return build_attrs(NormalTraffic, "normal", value)


def _dict(value: Any) -> dict:
    return dict(value)


@attrs.frozen
class Experiment:
    """Everything but the policy, the seed and the window."""

    models: tuple[str, ...] = attrs.field(default=PAIRS["Q7/L70"], converter=_models, validator=_check_models)
    preset: str = attrs.field(default="fusionbench", validator=_check_preset)  # "": Markov sessions
    instances_per_model: int = attrs.field(default=4, validator=positive_int)
    duration_s: float = attrs.field(default=600.0, validator=positive)
    warmup_s: float = attrs.field(default=120.0, validator=non_negative)
    drain_s: float = attrs.field(default=120.0, validator=non_negative)
    session_rate_per_s: float = attrs.field(default=0.05, validator=positive)
    normal: NormalTraffic = attrs.field(default=attrs.Factory(NormalTraffic), converter=_normal)
    latency: str = "vidur"
    #: A latency profile (shipped name or JSON file; "" for none): see SimScenario.
    latency_profile: str = ""
    device: str = "H100-80GB"
    #: Further SimScenario fields (tp, slo, token_budget, block_size, Markov session fields...).
    scenario: dict = attrs.field(factory=dict, converter=_dict)
    #: A session-trace file replayed instead of the preset (shadow_sim.experiments.session_file),
    #: and its recorded model -> experiment model map (default: by name, then in order).
    sessions: str = ""
    session_models: dict = attrs.field(factory=dict, converter=_dict)
    #: Re-route the file's sessions (shadowcore.workloads.reroute; default "replay": the recorded models).
    session_router: PluginRef = attrs.field(default=PluginRef("replay"),
                                            converter=lambda v: PluginRef.parse("session_router", v)
                                            if not isinstance(v, PluginRef) else v)
    #: sha256 of the session file's bytes (set from ``sessions``): part of the value, so a
    #: resumed sweep never reuses runs of an edited file.
    sessions_sha256: str = attrs.field(init=False, default="")

    def __attrs_post_init__(self) -> None:
        for key in ("models", "preset", "instances_per_model", "duration_s", "warmup_s", "session_rate_per_s",
                    "latency", "latency_profile", "device", "seed", "normal_rate_per_s"):
            if key in self.scenario:
                raise ConfigError(f"scenario.{key}", self.scenario[key], "set it on the experiment, not in scenario")
        self.sim_scenario(0)  # validates the cluster (models fit the device, latency kind...)
        if self.sessions:
            from shadow_sim.experiments import session_file

            session_file.check(self)
            object.__setattr__(self, "sessions_sha256", session_file.digest(self.sessions))
        elif self.session_router.name != "replay":
            raise ConfigError("session_router", self.session_router.name, "re-routes a session file: set sessions")
        elif self.preset:
            self.session_preset()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], field: str = "experiment") -> Experiment:
        data = dict(data)
        if "pair" in data:
            if "models" in data:
                raise ConfigError(f"{field}.pair", data["pair"], "give either pair or models")
            data["models"] = get_pair(data.pop("pair"))
        if data.get("sessions") and "duration_s" not in data:  # measure every session of the file
            from shadow_sim.experiments import session_file

            data["duration_s"] = session_file.default_duration_s(data["sessions"])
        return build_attrs(cls, field, data)

    @property
    def end_s(self) -> float:
        return self.warmup_s + self.duration_s

    @property
    def window_tokens(self) -> int:
        return min(get_model(m).max_context_tokens for m in self.models)

    def sim_scenario(self, seed: int) -> SimScenario:
        return SimScenario.from_dict({
            **self.scenario, "models": list(self.models), "device": self.device, "latency": self.latency,
            "latency_profile": self.latency_profile, "instances_per_model": self.instances_per_model, "duration_s": self.end_s, "warmup_s": self.warmup_s,
            "session_rate_per_s": self.session_rate_per_s, "normal_rate_per_s": 0.0, "seed": seed,
        })

    def session_preset(self) -> SessionPreset:
        return fit_preset(get_preset(self.preset), self.models, self.window_tokens, self.session_rate_per_s)


def fit_preset(preset: SessionPreset, models: tuple[str, ...], window: int, rate_per_s: float) -> SessionPreset:
    """``preset`` on ``models``, every window ``window``; when its token caps do not
    fit that window, they are scaled down by one factor until they do (a cap only
    bounds a lognormal's far tail, so the distributions barely change). More models
    than the preset's pair re-route its sessions by accuracy per cost over all of
    them (Appendix C, "More than two models per router"), with skills and prices
    spread between the pair's."""
    preset = for_pair(preset, models)  # a pair's own published statistics (PAIR_PRESETS), where it has them
    changes: dict[str, Any] = {}
    if len(models) != len(preset.models):
        router = preset.router
        if not isinstance(router, SyntheticScores) or len(models) < len(preset.models):
            raise ConfigError("models", models, f"preset {preset.name!r} needs {len(preset.models)} models")
        # N models: skills and prices spread between the pair's (cheapest/weakest to priciest/strongest)
        n = len(models)
        skills = tuple(float(x) for x in np.linspace(router.skills[0], router.skills[-1], n))
        prices = tuple(float(x) for x in np.geomspace(router.prices[0], router.prices[-1], n))
        changes["router"] = attrs.evolve(router, skills=skills, prices=prices)
    later = preset.new_input.high + preset.tool.high + preset.output.high  # type: ignore[operator]
    factor = min(1.0, (window - preset.summary_tokens) / later,
                 window / (preset.first_input.high + preset.output.high))  # type: ignore[operator]
    if factor < 1.0:
        for name in ("first_input", "new_input", "tool", "output"):
            dist = getattr(preset, name)
            changes[name] = attrs.evolve(dist, high=max(dist.low, int(dist.high * factor)))
    return attrs.evolve(preset, models=tuple(models), windows=(window,) * len(models),
                        session_rate_per_s=rate_per_s, **changes)


@attrs.define(eq=False)
class ExperimentRun(SimRun):
    """One (experiment, seed, window) under one policy. ``capacity`` maps each
    model to its calibrated normal-traffic capacity (requests/s per instance).
    ``workload`` (after construction) holds the sessions and normal requests played."""

    experiment: Experiment | None = None
    capacity: dict[str, float] = attrs.Factory(dict)

    def build_cluster(self, extra: int) -> EngineCluster:
        base = super().build_cluster(extra)
        assert self.experiment is not None
        return attrs.evolve(base, window_tokens=self.experiment.window_tokens)

    def session_plans(self) -> list[SessionPlan]:
        ex = self.experiment
        assert ex is not None
        if ex.sessions:
            from shadow_sim.experiments import session_file

            return session_file.plans(ex, self.scenario.seed)
        if ex.preset:
            return from_agent_sessions(generate(ex.session_preset(), ex.end_s, self.scenario.seed))
        return super().session_plans()

    def normal_traffic(self) -> tuple[NormalRequest, ...]:
        ex = self.experiment
        assert ex is not None
        serving = [self.cluster.by_id[i] for i in self.serving_instances()]
        peers = collections.Counter(i.model for i in serving)  # serving instances per model
        streams = []
        for k, inst in enumerate(serving):
            streams.append((inst.instance_id, ex.normal.arrivals(
                self.capacity[inst.model], ex.end_s + ex.drain_s, self.scenario.seed, k, peers[inst.model])))
        return normal_requests(streams)


@attrs.define(eq=False)
class NormalOnlyRun(SimRun):
    """Capacity probe: normal traffic on the instances of ``models[0]`` only, no
    sessions (the other model is named for the scenario's validation, never built)."""

    arrivals: list[tuple[float, int, int]] = attrs.Factory(list)

    def build_cluster(self, extra: int) -> EngineCluster:
        model = self.scenario.models[0]
        insts = [self.build_instance(f"{model}/{k}", model, self.policy.kv)
                 for k in range(self.scenario.instances_per_model)]
        by_model = {m: (insts if m == model else []) for m in self.scenario.models}
        return EngineCluster(self.loop, by_model, {i.instance_id: i for i in insts})

    def session_plans(self) -> list[SessionPlan]:
        return []

    def normal_traffic(self) -> tuple[NormalRequest, ...]:
        return normal_requests((inst, self.arrivals) for inst in self.serving_instances())
