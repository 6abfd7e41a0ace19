"""shadowcore: the backend-agnostic policy core of shadowprefill.

Imports only attrs, numpy and the standard library (a test enforces it). The
data path, in reading order: router side and shadow manager
(:mod:`shadowcore.manager`) -> engine hook (:mod:`shadowcore.hook`) -> KV
classes (:mod:`shadowcore.kv`) -> metrics (:mod:`shadowcore.metrics`), wired
in one composition root (:mod:`shadowcore.pipeline`).
"""

from shadowcore.config import PluginRef, ShadowConfig, SloConfig, parse_ref, parse_refs
from shadowcore.errors import ConfigError, PluginError, ShadowError
from shadowcore.hook import EngineHook, EnginePort
from shadowcore.job import SessionHistory, ShadowJob
from shadowcore.kv import HostTierParams, KVClass, KVClassManager, KVClassPolicy
from shadowcore.latency import BatchShape, LatencyModel, LinearLatencyModel, PrefillChunk
from shadowcore.manager import ClusterPort, ShadowManager
from shadowcore.pipeline import ShadowRuntime, build_runtime
from shadowcore.policy import Component, PolicySpec, load_policy
from shadowcore.slack import SlackController
from shadowcore.switch import SwitchPredictor, Targeting
from shadowcore.types import (
    CallArrival,
    CallPlacement,
    JobKey,
    RequestKind,
    RequestView,
    ShadowGrant,
    SlackBudget,
    StepOutcome,
    StepPlan,
    StepSnapshot,
)

__all__ = [
    "BatchShape", "CallArrival", "CallPlacement", "ClusterPort", "Component", "ConfigError", "EngineHook",
    "EnginePort", "HostTierParams", "JobKey", "KVClass", "KVClassManager", "KVClassPolicy", "LatencyModel",
    "LinearLatencyModel", "PluginError", "PluginRef", "PolicySpec", "PrefillChunk", "RequestKind", "RequestView",
    "SessionHistory", "ShadowConfig", "ShadowError", "ShadowGrant", "ShadowJob", "ShadowManager", "ShadowRuntime",
    "SlackBudget", "SlackController", "SloConfig", "StepOutcome", "StepPlan", "StepSnapshot", "SwitchPredictor",
    "Targeting", "build_runtime", "load_policy", "parse_ref", "parse_refs",
]
