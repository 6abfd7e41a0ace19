"""Workloads: normal-traffic traces (Azure LLM inference, BurstGPT, Mooncake,
GitHub Copilot coding agent) loaded into one request list."""

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
    "Trace",
    "TraceError",
    "TraceRequest",
    "load_azure",
    "load_burstgpt",
    "load_copilot",
    "load_mooncake",
    "load_trace",
]
