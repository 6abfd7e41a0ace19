"""Replaying a session-trace file (:mod:`shadow_traces.session_trace`) as
an experiment's agent sessions (``Experiment.sessions``; ``shadowprefill
simulate --sessions FILE``; ``sweep --sessions FILE``).

The sessions keep their own token counts (``input_tokens`` appended per call,
``output_tokens``, compactions), tool gaps and per-call model -- or, with
``Experiment.session_router`` (``--router``), every call's model is chosen again
by a router (:mod:`shadowcore.workloads.reroute`; seeded by the experiment's
seed). A replayed recorded model is played on the experiment model :func:`~shadow_traces.session_trace.model_map`
maps it to (``Experiment.session_models`` first, then same names, then the
unused models in order of first appearance). Arrivals keep their offsets, shifted
so that the first session arrives at ``warmup_s`` (the warm-up is normal traffic
only and every session is measured); without ``duration_s`` the measured window
is the sessions' arrival span + 1 s, and a session arriving after the window is
an error, not dropped.

Every call must fit the run's smallest context window (prompt + output): the
simulator compacts only where the trace says so, and a call that does not fit
is an error naming the session and call, not a silent cut.
"""

from __future__ import annotations

import functools
import hashlib
import os
from typing import Any

from shadow_traces.replay import trace_plans
from shadow_traces.session_trace import SessionTrace, model_map, read_session_trace
from shadowcore.engine.workload import SessionPlan
from shadowcore.errors import ConfigError

Experiment = Any  # shadow_sim.experiments.spec.Experiment (which imports this module lazily)

#: Seconds after the last session arrival that the default measured window adds.
WINDOW_PAD_S = 1.0


def load(path: str) -> SessionTrace:
    """The trace at ``path`` (cached per file version: path, size, mtime)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise ConfigError("sessions", path, str(e)) from None
    return _load(path, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _load(path: str, _size: int, _mtime_ns: int) -> SessionTrace:
    return read_session_trace(path)


def digest(path: str) -> str:
    """sha256 of the file's bytes."""
    try:
        with open(path, "rb") as fh:
            return hashlib.file_digest(fh, "sha256").hexdigest()
    except OSError as e:
        raise ConfigError("sessions", path, str(e)) from None


def default_duration_s(path: str) -> float:
    """The measured window that holds every session's arrival."""
    return load(path).arrival_span_s + WINDOW_PAD_S


def models_of(ex: Experiment) -> dict[str, str]:
    return model_map(load(ex.sessions).models, ex.models, ex.session_models)


def _replayed(ex: Experiment) -> bool:
    return ex.session_router.name == "replay"


def check(ex: Experiment) -> None:
    """Errors before anything runs: models that cannot be mapped, calls without a
    model (unless a router re-routes them), calls beyond the context window,
    sessions after the measured window, a router that does not build."""
    trace = load(ex.sessions)
    if _replayed(ex):
        models_of(ex)
    else:
        plans(ex)  # builds the router and routes every call once: a bad router fails here
    window = ex.window_tokens
    first = min(s.arrival_s for s in trace.sessions)
    for s in trace.sessions:
        at = s.arrival_s - first + ex.warmup_s
        if at >= ex.end_s:
            raise ConfigError("duration_s", ex.duration_s,
                              f"session {s.session_id!r} arrives {s.arrival_s - first:g} s after the first; "
                              f"the measured window must hold it (omit duration_s to fit all sessions)")
        for i, (c, prompt) in enumerate(zip(s.calls, s.prompt_lengths())):
            if c.model is None and _replayed(ex):
                raise ConfigError(f"sessions {ex.sessions}", f"{s.session_id}#{i}",
                                  "the call records no model (a router must choose it; replay needs one)")
            if c.output_tokens < 1:
                raise ConfigError(f"sessions {ex.sessions}", f"{s.session_id}#{i}",
                                  "output_tokens = 0: the engines generate at least one token per call")
            if prompt + c.output_tokens > window:
                raise ConfigError(f"sessions {ex.sessions}", f"{s.session_id}#{i}",
                                  f"prompt + output = {prompt + c.output_tokens} tokens exceed the run's "
                                  f"{window}-token context window (smallest of {', '.join(ex.models)}): "
                                  "choose models with a larger window")


def plans(ex: Experiment, seed: int = 0) -> list[SessionPlan]:
    """The experiment's session plans from its trace file (``seed``: the run's, for a router)."""
    return trace_plans(load(ex.sessions), ex.models, session_models=ex.session_models, router=ex.session_router,
                       seed=seed, start_s=ex.warmup_s)
