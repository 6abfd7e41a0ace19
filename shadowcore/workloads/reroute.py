"""Re-routing replayed sessions: "what if my router switched more?".

A replayed session keeps its token counts, compactions and tool gaps; only
each call's model is chosen again, by a :class:`~shadowcore.workloads.sessions.SessionRouter`
over the run's models. Routers by name (``--router NAME[:{json}]``,
``Experiment.session_router``):

* ``replay`` -- the recorded model column (the default; no re-routing);
* ``markov`` -- ``{"p_switch": 0.3}``: :class:`~shadowcore.workloads.sessions.MarkovRouter`;
* ``accuracy-per-cost`` -- ``{"rho": 0.8, "skills": [...], "prices": [...],
  "noise": 0.3}``: :class:`~shadowcore.workloads.sessions.AccuracyPerCostRouter`
  over a seeded synthetic score matrix (:class:`~shadowcore.workloads.sessions.SyntheticScores`;
  skills and prices default to the presets' spread between the cheapest and
  the strongest model), one task per session task (the session id when none);
* any other name: a plugin of the entry-point group
  ``shadowprefill.session_routers`` (or ``package.module:factory``), a factory
  ``factory(models, tasks, max_steps, rng, **args) -> SessionRouter``.

Determinism: the router is built from ``[seed, 3]`` and session ``i`` (in
arrival order) routes with the generator ``[seed, 2, i]``, as
:func:`~shadowcore.workloads.sessions.generate` does; no global RNG.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from shadowcore.config import PluginRef
from shadowcore.errors import ConfigError, PluginError
from shadowcore.registry import Registry
from shadowcore.workloads.sessions import AgentSession, MarkovRouter, SessionRouter, SyntheticScores

__all__ = ["BUILTIN", "SESSION_ROUTER_GROUP", "build_router", "reroute", "session_routers"]

SESSION_ROUTER_GROUP = "shadowprefill.session_routers"
session_routers = Registry(SESSION_ROUTER_GROUP)
BUILTIN = ("replay", "markov", "accuracy-per-cost")

_SKILLS = (-1.0, 1.43)  # the presets' pair (sessions.py): a tie at median difficulty
_PRICES = (1.0, 3.0)


def _markov(models: tuple[str, ...], _tasks: tuple[str, ...], _max_steps: int, _rng: np.random.Generator,
            p_switch: float = 0.3) -> SessionRouter:
    return MarkovRouter(models, p_switch)


def _accuracy_per_cost(models: tuple[str, ...], tasks: tuple[str, ...], max_steps: int, rng: np.random.Generator,
                       rho: float = 0.8, skills: Sequence[float] | None = None,
                       prices: Sequence[float] | None = None, noise: float = 0.3) -> SessionRouter:
    n = len(models)
    skills = tuple(skills) if skills is not None else tuple(float(x) for x in np.linspace(*_SKILLS, n))
    prices = tuple(prices) if prices is not None else tuple(float(x) for x in np.geomspace(*_PRICES, n))
    return SyntheticScores(rho, skills, prices, noise).build(models, tasks, max_steps, rng)


def build_router(ref: PluginRef, models: Sequence[str], tasks: Sequence[str], max_steps: int,
                 seed: int) -> SessionRouter | None:
    """The router ``ref`` names over ``models`` (None for ``replay``)."""
    if ref.name == "replay":
        if ref.args:
            raise ConfigError("session_router.args", dict(ref.args), "replay takes no arguments")
        return None
    factory: Any = {"markov": _markov, "accuracy-per-cost": _accuracy_per_cost}.get(ref.name)
    if factory is None:
        try:
            factory = session_routers.load(ref.name)
        except PluginError as e:
            raise ConfigError("session_router", ref.name, f"{e} (built-in: {', '.join(BUILTIN)})") from None
    try:
        router = factory(tuple(models), tuple(tasks), max_steps, np.random.default_rng([seed, 3]), **ref.args)
    except TypeError as e:
        raise ConfigError("session_router.args", dict(ref.args), f"{ref.name}: {e}") from None
    if not isinstance(router, SessionRouter):
        raise ConfigError("session_router", ref.name, f"the factory returned {type(router).__name__}, "
                          "not a SessionRouter")
    return router


def reroute(sessions: Sequence[AgentSession], ref: PluginRef, models: Sequence[str], seed: int) -> list[AgentSession]:
    """``sessions`` with every call's model chosen by ``ref``'s router (tokens, compactions, gaps kept)."""
    tasks = tuple(dict.fromkeys(s.task or s.session_id for s in sessions))
    max_steps = max((len(s.calls) for s in sessions), default=1)
    router = build_router(ref, models, tasks, max_steps, seed)
    if router is None:
        return list(sessions)
    out = []
    for i, s in enumerate(sessions):
        rng, task, model, calls = np.random.default_rng([seed, 2, i]), s.task or s.session_id, None, []
        for step, c in enumerate(s.calls):
            model = router.route(rng, step, task, model)
            if model not in models:
                raise ConfigError("session_router", ref.name, f"routed to {model!r}, not one of {list(models)}")
            calls.append(attrs.evolve(c, model=model))
        out.append(attrs.evolve(s, calls=tuple(calls)))
    return out
