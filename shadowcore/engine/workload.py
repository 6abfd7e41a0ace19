"""What a run plays: one frozen :class:`Workload` of concrete sessions and
normal requests, drawn (or replayed) before the run.

A :class:`Workload` holds no distribution and no generator: every session is a
list of :class:`PlannedCall` (model, new input tokens, output tokens, tool gap
after the call, optional compaction) and every normal request names the
serving instance it arrives at. A synthetic workload is drawn from a scenario's
seed (:func:`draw_workload`); a replayed agent trace is converted into the same
value. Every driver (the simulator, the P/D simulator, vLLM virtual time) takes
a :class:`Workload` and plays it through
:class:`~shadowcore.engine.driver.SessionDriver`, so every policy of a
comparison sees the same sessions and the same normal requests.

:class:`ScenarioSpec` is the part of a scenario that the in-memory backends
share (models and instances, the synthetic workload, SLOs, KV block size and
token budget, seed); a backend's scenario inherits it and sets its own
defaults with :func:`defaults`.

Invariants:

* Same spec and seed, same workload, draw for draw: sessions come from the
  generator ``[seed, 1]``, the normal traffic of the k-th serving instance from
  ``[seed, 2, k]``; nothing else draws from them.
* A workload's session ids are unique, every session has at least one call,
  token counts are non-negative (outputs at least one), gaps and arrivals are
  finite and non-negative.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from shadowcore._validators import non_negative, non_negative_int, positive, positive_int, probability
from shadowcore.config import SloConfig, build_attrs
from shadowcore.errors import ConfigError
from shadowcore.workloads.prefix import PromptPrefix


def _tuple(v: Iterable) -> tuple:
    return tuple(v)


def _optional_non_negative_int(inst: Any, attribute: Any, value: int | None) -> None:
    if value is not None:
        non_negative_int(inst, attribute, value)


def _finite_non_negative(inst: Any, attribute: Any, value: float) -> None:
    non_negative(inst, attribute, value)
    if not math.isfinite(value):
        raise ConfigError(attribute.name, value, "must be finite")


@attrs.frozen
class PlannedCall:
    """One call of an agent session: ``num_new_tokens`` are appended to the
    session's history at arrival (new input and tool result), the model
    answers ``num_output_tokens``; the next call arrives ``gap_after_s`` after
    this one's last token (ignored on a session's last call). With
    ``compact_to_tokens`` the history is compacted to that many tokens before
    the new input is appended."""

    model: str
    num_new_tokens: int = attrs.field(validator=non_negative_int)
    num_output_tokens: int = attrs.field(validator=positive_int)
    gap_after_s: float = attrs.field(default=0.0, validator=_finite_non_negative)
    compact_to_tokens: int | None = attrs.field(default=None, validator=_optional_non_negative_int)


def _calls(value: Iterable[PlannedCall]) -> tuple[PlannedCall, ...]:
    calls = tuple(value)
    if not calls:
        raise ConfigError("calls", calls, "a session needs at least one call")
    return calls


@attrs.frozen
class SessionPlan:
    """One agent session as the driver plays it: its first call arrives at
    ``arrival_s``, each next one a tool gap after the previous one ended."""

    session_id: str
    arrival_s: float = attrs.field(validator=_finite_non_negative)
    calls: tuple[PlannedCall, ...] = attrs.field(converter=_calls)

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(c.model for c in self.calls)

    @property
    def inputs(self) -> tuple[int, ...]:
        return tuple(c.num_new_tokens for c in self.calls)

    @property
    def outputs(self) -> tuple[int, ...]:
        return tuple(c.num_output_tokens for c in self.calls)


def session(session_id: str, arrival_s: float, models: Sequence[str], inputs: Sequence[int],
            outputs: Sequence[int], gap_s: float | Sequence[float] = 2.0,
            compact_to: Sequence[int | None] = ()) -> SessionPlan:
    """A :class:`SessionPlan` from per-call columns (a scripted session):
    ``gap_s`` is one tool gap for every call or one per call."""
    n = len(models)
    gaps = (gap_s,) * n if isinstance(gap_s, (int, float)) else tuple(gap_s)
    compact = tuple(compact_to) or (None,) * n
    if not len(inputs) == len(outputs) == len(gaps) == len(compact) == n:
        raise ConfigError("session", session_id, f"needs one input, output, gap and compaction per call ({n})")
    return SessionPlan(session_id, arrival_s, tuple(
        PlannedCall(m, i, o, g, c) for m, i, o, g, c in zip(models, inputs, outputs, gaps, compact)))


def _optional_prefix(_inst: Any, attribute: Any, value: Any) -> None:
    if value is not None and not isinstance(value, PromptPrefix):
        raise ConfigError(attribute.name, value, "must be a PromptPrefix or None")


@attrs.frozen
class NormalRequest:
    """One normal (non-agent) request: ``num_prompt_tokens`` of prompt
    arriving at ``instance_id`` at ``arrival_s``, ``num_output_tokens`` long.
    The prompt is fresh, or with ``prefix`` (a trace's block hashes,
    :mod:`shadowcore.workloads.prefix`) its leading tokens are shared with
    every request of equal leading hashes."""

    instance_id: str
    arrival_s: float = attrs.field(validator=_finite_non_negative)
    num_prompt_tokens: int = attrs.field(validator=positive_int)
    num_output_tokens: int = attrs.field(validator=positive_int)
    prefix: PromptPrefix | None = attrs.field(default=None, validator=_optional_prefix)


def _unique_sessions(_inst: Any, _attribute: Any, value: tuple[SessionPlan, ...]) -> None:
    seen: set[str] = set()
    for s in value:
        if s.session_id in seen:
            raise ConfigError("sessions", s.session_id, "session ids must be unique")
        seen.add(s.session_id)


@attrs.frozen
class Workload:
    """Sessions and normal requests of one run, in the order the driver
    schedules them (at equal times, earlier entries go first)."""

    sessions: tuple[SessionPlan, ...] = attrs.field(default=(), converter=_tuple, validator=_unique_sessions)
    normal: tuple[NormalRequest, ...] = attrs.field(default=(), converter=_tuple)


def defaults(**values: Any) -> Callable[[type, list], list]:
    """A ``field_transformer`` giving inherited fields new defaults: a
    backend's scenario states its defaults once, the fields (and their
    validators) are declared once in :class:`ScenarioSpec`."""

    def transform(cls: type, fields: list) -> list:
        names = {f.name for f in fields}
        unknown = sorted(set(values) - names)
        if unknown:
            raise TypeError(f"{cls.__name__}: no fields {unknown} to give defaults")
        return [f.evolve(default=values[f.name]) if f.name in values else f for f in fields]

    return transform


@attrs.frozen
class ScenarioSpec:
    """The fields every in-memory scenario shares: the models and instances
    per model, the synthetic workload (Markov-routed sessions, Poisson normal
    traffic per serving instance), SLOs, KV block size, token budget and the
    seed the workload is drawn from. ``warmup_s``: calls and normal requests
    arriving before it are not measured."""

    models: tuple[str, ...] = attrs.field(default=("small", "large"), converter=_tuple)
    instances_per_model: int = attrs.field(default=2, validator=positive_int)
    duration_s: float = attrs.field(default=240.0, validator=positive)
    warmup_s: float = attrs.field(default=30.0, validator=non_negative)
    session_rate_per_s: float = attrs.field(default=0.1, validator=positive)
    calls_per_session: int = attrs.field(default=8, validator=positive_int)
    switch_probability: float = attrs.field(default=0.3, validator=probability)
    input_tokens_median: int = attrs.field(default=1500, validator=positive_int)
    output_tokens_median: int = attrs.field(default=120, validator=positive_int)
    tool_gap_s: float = attrs.field(default=2.0, validator=non_negative)
    normal_rate_per_s: float = attrs.field(default=1.5, validator=non_negative)
    normal_prompt_median: int = attrs.field(default=800, validator=positive_int)
    normal_output_median: int = attrs.field(default=150, validator=positive_int)
    slo: SloConfig = attrs.Factory(SloConfig)
    block_size: int = attrs.field(default=16, validator=positive_int)
    token_budget: int = attrs.field(default=2048, validator=positive_int)
    seed: int = attrs.field(default=0, validator=non_negative_int)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], field: str = "scenario") -> Any:
        data = dict(data)
        if "slo" in data:
            data["slo"] = build_attrs(SloConfig, f"{field}.slo", data["slo"])
        return build_attrs(cls, field, data)

    def serving_instances(self) -> list[str]:
        """The instances that receive normal traffic, in draw order."""
        return [f"{m}/{k}" for m in self.models for k in range(self.instances_per_model)]


# -- drawing ------------------------------------------------------------------------


def _lognormal(rng: np.random.Generator, median: float, sigma: float = 0.6) -> int:
    return max(1, round(median * float(np.exp(sigma * rng.standard_normal()))))


def draw_sessions(sc: ScenarioSpec) -> list[SessionPlan]:
    """Markov-routed sessions: Poisson arrivals over ``duration_s``, each of
    ``calls_per_session`` calls that switch model with ``switch_probability``."""
    rng = np.random.default_rng([sc.seed, 1])
    out, t = [], 0.0
    while True:
        t += float(rng.exponential(1.0 / sc.session_rate_per_s))
        if t >= sc.duration_s:
            return out
        models = [sc.models[int(rng.integers(len(sc.models)))]]
        for _ in range(sc.calls_per_session - 1):
            if rng.random() < sc.switch_probability:
                others = [m for m in sc.models if m != models[-1]]
                models.append(others[int(rng.integers(len(others)))])
            else:
                models.append(models[-1])
        inputs = [_lognormal(rng, sc.input_tokens_median) for _ in models]
        outputs = [_lognormal(rng, sc.output_tokens_median) for _ in models]
        out.append(session(f"s{len(out)}", t, models, inputs, outputs, sc.tool_gap_s))


def draw_normal(sc: ScenarioSpec, instance_index: int, rate_per_s: float | None = None,
                ) -> list[tuple[float, int, int]]:
    """Poisson normal traffic of the ``instance_index``-th serving instance as
    (arrival, prompt, output); ``rate_per_s`` defaults to the scenario's."""
    rate = sc.normal_rate_per_s if rate_per_s is None else rate_per_s
    if rate == 0:
        return []
    rng = np.random.default_rng([sc.seed, 2, instance_index])
    out, t = [], 0.0
    while True:
        t += float(rng.exponential(1.0 / rate))
        if t >= sc.duration_s:
            return out
        out.append((t, _lognormal(rng, sc.normal_prompt_median), _lognormal(rng, sc.normal_output_median)))


def normal_requests(streams: Iterable[tuple[str, Iterable[tuple]]]) -> tuple[NormalRequest, ...]:
    """(instance id, its (arrival, prompt, output) list) streams as one tuple,
    stream after stream; an entry may carry a fourth item, its
    :class:`~shadowcore.workloads.prefix.PromptPrefix` (or None)."""
    return tuple(NormalRequest(inst, *entry) for inst, arrivals in streams for entry in arrivals)


def draw_workload(sc: ScenarioSpec, serving: Sequence[str] | None = None, normal_rate_per_s: float | None = None,
                  sessions: Sequence[SessionPlan] | None = None) -> Workload:
    """Markov sessions (or ``sessions``, and then none are drawn) and Poisson
    normal traffic on ``serving`` (default: :meth:`ScenarioSpec.serving_instances`),
    the k-th instance drawing from ``[seed, 2, k]``."""
    serving = sc.serving_instances() if serving is None else serving
    normal = normal_requests((inst, draw_normal(sc, k, normal_rate_per_s)) for k, inst in enumerate(serving))
    return Workload(tuple(draw_sessions(sc) if sessions is None else sessions), normal)


def from_agent_sessions(agents: Iterable[Any]) -> list[SessionPlan]:
    """Sessions generated by :func:`shadowcore.workloads.sessions.generate`
    (or any values with its ``AgentSession`` fields) as plans: each call's
    appended tokens, output and compaction, the tool gaps between calls."""
    return [
        SessionPlan(a.session_id, a.arrival_s, tuple(
            PlannedCall(c.model, c.num_appended_tokens, c.num_output_tokens, gap, c.compact_to_tokens)
            for c, gap in zip(a.calls, (*a.tool_gaps_s, 0.0))))
        for a in agents
    ]
