"""Workloads: normal-traffic traces (Azure LLM inference, BurstGPT, Mooncake,
GitHub Copilot coding agent) loaded into one request list; synthetic agentic
sessions fitted to the paper's Table 1 (:mod:`shadowcore.workloads.sessions`)."""

from shadowcore.workloads.sessions import PRESETS, AgentSession, CallSpec, SessionPreset, generate, get_preset
from shadowcore.workloads.traces import (
    FORMATS,
    Trace,
    TraceError,
    TraceRequest,
    load_azure,
    load_burstgpt,
    load_copilot,
    load_mooncake,
    load_trace,
)

__all__ = [
    "FORMATS",
    "PRESETS",
    "AgentSession",
    "CallSpec",
    "SessionPreset",
    "Trace",
    "TraceError",
    "TraceRequest",
    "generate",
    "get_preset",
    "load_azure",
    "load_burstgpt",
    "load_copilot",
    "load_mooncake",
    "load_trace",
]
