"""What the shadow scheduler reads from vLLM's configuration.

The policy configuration reaches vLLM's engine-core process (in-process or
spawned) as JSON in ``VllmConfig.additional_config["shadowprefill"]``
(``--additional-config`` on the command line, ``additional_config=`` for
``LLM``/``EngineArgs``) and is rebuilt there with the core's loaders::

    {"shadowprefill": {
        "shadow": {"policy": "harvest-slo", "seed": 0},      # a ShadowConfig
        "instance_id": "small-0",                            # optional
        "slo": {"ttft_s": 1.0, "tpot_s": 0.025},             # routed and normal requests
        "latency": {"name": "linear", "args": {"overhead_s": 0.003}},
        "pd": {"role": "prefill", "max_iteration_s": 0.1, "push_tokens": 4096}  # optional
    }}

``pd`` (:class:`PDEngineConfig`) is read by the P/D schedulers of
:mod:`shadow_vllm.pd` only: a prefill-role engine's shadow iterations last at
most ``max_iteration_s`` (the policy's ``prefill_slack``), a decode-role
engine pulls shadow KV in pushes of at most ``push_tokens``.

``latency`` is the :class:`~shadowcore.latency.LatencyModel` of the hardware
the engine runs on: ``"linear"`` is
:class:`~shadowcore.latency.LinearLatencyModel` with coefficients from the
configuration (the CPU default: deterministic, so the same snapshots give the
same plans, and cheap to calibrate with ``benchmarks/``); any other name is a
``package.module:factory`` reference called with ``args`` (e.g. the
simulator's Vidur model of an H100 for GPU engines).

Invariants: :meth:`EngineShadowConfig.from_vllm` either returns a validated
configuration or raises one :class:`~shadowcore.errors.ConfigError` whose
field path starts with ``additional_config.shadowprefill``; the policy is
resolved (and its arguments checked) before the engine serves anything.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs

from shadowcore._validators import non_empty_str, one_of, positive, positive_int
from shadowcore.config import PluginRef, ShadowConfig, SloConfig, build_attrs
from shadowcore.errors import ConfigError, PluginError
from shadowcore.latency import LatencyModel, LinearLatencyModel
from shadowcore.policy import load_policy
from shadowcore.registry import load_reference

CONFIG_KEY = "shadowprefill"
FIELD = f"additional_config.{CONFIG_KEY}"
SCHEDULER_CLS = "shadow_vllm.scheduler.ShadowScheduler"
ASYNC_SCHEDULER_CLS = "shadow_vllm.scheduler.AsyncShadowScheduler"
#: The P/D engines' schedulers by role (their async twins: ``AsyncPrefill...``, ``AsyncDecode...``).
PD_SCHEDULER_CLS = {"prefill": "shadow_vllm.pd.PrefillShadowScheduler", "decode": "shadow_vllm.pd.DecodeShadowScheduler"}


PD_ROLES = ("prefill", "decode")


@attrs.frozen
class PDEngineConfig:
    """A P/D engine's settings (the simulator's ``PDConfig`` fields that live on an engine)."""

    role: str = attrs.field(validator=one_of(*PD_ROLES))
    max_iteration_s: float = attrs.field(default=0.1, validator=positive)
    push_tokens: int = attrs.field(default=4096, validator=positive_int)

    def to_dict(self) -> dict[str, Any]:
        return {"role": self.role, "max_iteration_s": self.max_iteration_s, "push_tokens": self.push_tokens}


@attrs.frozen
class EngineShadowConfig:
    """The shadow scheduler's configuration for one engine."""

    shadow: ShadowConfig = attrs.Factory(ShadowConfig)
    instance_id: str = attrs.field(default="vllm", validator=non_empty_str)
    slo: SloConfig = attrs.Factory(SloConfig)
    latency: PluginRef = attrs.field(factory=lambda: PluginRef("linear"))
    #: Keep shadows whose missing tokens (all idle shadows together) are below the
    #: policy's ``n_min`` open, as the simulator keeps such jobs pending, instead of
    #: finishing them (``shadowprefill:tail-below-n-min``). Only for clients that end
    #: them themselves (abort, or a superseding shadow): docs/vllm.md, "Tails below n_min".
    keep_tails_below_n_min: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    #: Refit the latency model online from the engine's measured steps
    #: (``shadowcore.latency_fit.OnlineLatencyFit`` arguments: ``min_steps``,
    #: ``every``, ``window``); None: the configured model stays (the default).
    refit: Mapping[str, int] | None = None
    #: A latency profile applied to ``latency`` (:mod:`shadowcore.calibration`):
    #: a shipped name (``shadowprefill latency show``), a JSON file, or its
    #: fields; "" for none. The same value ``simulate --latency-profile`` takes,
    #: so a policy sees the same iteration times in simulation and on the engine.
    latency_profile: str | Mapping[str, Any] = ""
    #: P/D settings (:mod:`shadow_vllm.pd`'s schedulers); None: the engine is colocated.
    pd: PDEngineConfig | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "shadow": json.loads(self.shadow.to_json()),
            "instance_id": self.instance_id,
            "slo": {"ttft_s": self.slo.ttft_s, "tpot_s": self.slo.tpot_s},
            "latency": self.latency.to_dict(),
            "keep_tails_below_n_min": self.keep_tails_below_n_min,
            **({"refit": dict(self.refit)} if self.refit is not None else {}),
            **({"latency_profile": self.latency_profile} if self.latency_profile else {}),
            **({"pd": self.pd.to_dict()} if self.pd is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: Any, field: str = FIELD) -> EngineShadowConfig:
        if isinstance(data, str):  # the JSON text itself
            try:
                data = json.loads(data)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{field}:{e.lineno}:{e.colno}", data, e.msg) from None
        if not isinstance(data, Mapping):
            raise ConfigError(field, data, "must be a JSON object")
        known = {"shadow", "instance_id", "slo", "latency", "keep_tails_below_n_min", "refit", "latency_profile", "pd"}
        for k in data:
            if k not in known:
                raise ConfigError(f"{field}.{k}", data[k], f"unknown field (known: {', '.join(sorted(known))})")
        shadow_data = data.get("shadow", {})
        if isinstance(shadow_data, Mapping) and isinstance(shadow_data.get("policy"), str):
            shadow_data = {**shadow_data, "policy": {"name": shadow_data["policy"]}}  # errors name the full path
        shadow = ShadowConfig.from_dict(shadow_data, field=f"{field}.shadow")
        load_policy(shadow.policy, field=f"{field}.shadow.policy")  # resolve it here: one error, full path
        slo = build_attrs(SloConfig, f"{field}.slo", data.get("slo", {}))
        latency = PluginRef.parse(f"{field}.latency", data.get("latency", "linear"))
        instance_id = data.get("instance_id", "vllm")
        if not isinstance(instance_id, str) or not instance_id:
            raise ConfigError(f"{field}.instance_id", instance_id, "must be a non-empty string")
        keep_tails = data.get("keep_tails_below_n_min", False)
        if not isinstance(keep_tails, bool):
            raise ConfigError(f"{field}.keep_tails_below_n_min", keep_tails, "must be true or false")
        profile = data.get("latency_profile", "")
        pd = data.get("pd")
        if pd is not None:
            if not isinstance(pd, Mapping) or "role" not in pd:
                raise ConfigError(f"{field}.pd", pd, f"must be a JSON object with a role ({' or '.join(PD_ROLES)})")
            pd = build_attrs(PDEngineConfig, f"{field}.pd", pd)
        config = cls(shadow, instance_id, slo, latency, keep_tails, _refit(data.get("refit"), f"{field}.refit"),
                     dict(profile) if isinstance(profile, Mapping) else profile, pd)
        config.profile()  # a bad name, file or field fails here, before the engine serves
        return config

    def profile(self) -> Any:
        """The :class:`~shadowcore.calibration.LatencyProfile` to apply (the identity for "")."""
        from shadowcore.calibration import LatencyProfile

        if not self.latency_profile:
            return LatencyProfile()
        from shadow_sim.latency import resolve_profile

        return resolve_profile(self.latency_profile, field=f"{FIELD}.latency_profile")

    @classmethod
    def from_vllm(cls, vllm_config: Any) -> EngineShadowConfig:
        """The configuration in ``vllm_config.additional_config`` (defaults when absent)."""
        extra = getattr(vllm_config, "additional_config", None) or {}
        if not isinstance(extra, Mapping):
            raise ConfigError("additional_config", extra, "must be a mapping")
        return cls.from_dict(extra.get(CONFIG_KEY, {}))

    def attach_refit(self, hook: Any, asynchronous: bool) -> Any:
        """The online latency refit of ``hook`` when configured (None otherwise)."""
        if self.refit is None:
            return None
        if asynchronous:
            raise ConfigError(f"{FIELD}.refit", dict(self.refit), "needs measured step times: the synchronous "
                              "scheduler (under async scheduling a step's end is not observed)")
        from shadowcore.latency_fit import OnlineLatencyFit

        fit = OnlineLatencyFit(hook, **self.refit, tpot_slo_s=self.slo.tpot_s)
        hook.observers.add(fit)
        return fit

    def build_latency(self) -> LatencyModel:
        field = f"{FIELD}.latency"
        if self.latency.name == "linear":
            return self.profile().apply(build_attrs(LinearLatencyModel, f"{field}.args", self.latency.args))
        try:
            factory = load_reference(self.latency.name)
        except PluginError as e:
            raise ConfigError(f"{field}.name", self.latency.name, str(e)) from None
        try:
            model = factory(**self.latency.args)
        except ConfigError as e:
            raise ConfigError(f"{field}.args.{e.field}", e.value, e.problem) from None
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{field}.args", dict(self.latency.args), str(e)) from None
        if not callable(getattr(model, "predict_s", None)):  # predict_decodes_s is optional
            raise ConfigError(f"{field}.name", self.latency.name, "did not return a LatencyModel (no predict_s)")
        return self.profile().apply(model)


def engine_args(policy: str | Mapping[str, Any] = "harvest-slo", *, asynchronous: bool = False,
                **config: Any) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` / ``EngineArgs`` that load the shadow
    scheduler with ``policy`` (a name or ``{"name": ..., "args": {...}}``);
    ``config`` holds the other :class:`EngineShadowConfig` fields
    (``instance_id``, ``slo``, ``latency``, ``keep_tails_below_n_min``, ``pd``, ``seed``); with
    ``pd`` the scheduler is :mod:`shadow_vllm.pd`'s of its role (the engine also needs
    ``kv_transfer_config``)."""
    seed = config.pop("seed", 0)
    data = {"shadow": {"policy": policy, "seed": seed}, **config}
    parsed = EngineShadowConfig.from_dict(data)  # fail here, not in the engine process
    if parsed.pd is not None:  # a P/D engine: shadow_vllm.pd's scheduler of its role
        cls = PD_SCHEDULER_CLS[parsed.pd.role]
        return {"scheduler_cls": cls.replace(".Prefill", ".AsyncPrefill").replace(".Decode", ".AsyncDecode")
                if asynchronous else cls, "additional_config": {CONFIG_KEY: data}}
    return {
        "scheduler_cls": ASYNC_SCHEDULER_CLS if asynchronous else SCHEDULER_CLS,
        "additional_config": {CONFIG_KEY: data},
    }


def _refit(data: Any, field: str) -> dict[str, int] | None:
    """The ``refit`` field, checked by building the refit's settings."""
    if data is None:
        return None
    if not isinstance(data, Mapping):
        raise ConfigError(field, data, "must be a JSON object (min_steps, every, window) or null")
    from shadowcore.latency_fit import OnlineLatencyFit

    known = {"min_steps", "every", "window"}
    for k in data:
        if k not in known:
            raise ConfigError(f"{field}.{k}", data[k], f"unknown field (known: {', '.join(sorted(known))})")

    class _Hook:  # what the settings' validators need of a hook
        latency = LinearLatencyModel()

    try:
        OnlineLatencyFit(_Hook(), **data)
    except ConfigError as e:
        raise ConfigError(f"{field}.{e.field}", e.value, e.problem) from None
    return dict(data)
