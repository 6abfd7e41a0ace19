"""A session trace as the engines' session plans (one conversion for every
driver: the simulator, P/D, vLLM virtual time).

:func:`trace_plans` maps each recorded model onto the run's models
(:func:`~shadow_traces.session_trace.model_map`), or re-routes every
call (:mod:`shadowcore.workloads.reroute`), and shifts arrivals so that the
first session arrives at ``start_s`` (offsets kept). Token counts, compactions
and tool gaps are the trace's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from shadow_traces.session_trace import SessionTrace, model_map
from shadowcore.config import PluginRef
from shadowcore.engine.workload import SessionPlan, from_agent_sessions
from shadowcore.workloads.reroute import reroute

__all__ = ["trace_plans"]


def trace_plans(trace: SessionTrace, models: Sequence[str], *, session_models: Mapping[str, str] | None = None,
                router: PluginRef | None = None, seed: int = 0, start_s: float = 0.0) -> list[SessionPlan]:
    """The trace's sessions as plans on ``models`` (see the module docstring)."""
    models = tuple(models)
    first = min(s.arrival_s for s in trace.sessions)
    if router is None or router.name == "replay":
        mapping = model_map(trace.models, models, session_models)
        agents = trace.agent_sessions(lambda m, _i: mapping[m] if m is not None else "")
    else:  # any model stands in until the router chooses
        agents = reroute(trace.agent_sessions(lambda _m, _i: models[0]), router, models, seed)
    return from_agent_sessions([attrs.evolve(a, arrival_s=a.arrival_s - first + start_s) for a in agents])
