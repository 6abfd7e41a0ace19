"""Switch prediction and targeting.

A :class:`SwitchPredictor` estimates, for a session's task and current model,
the probability that the next call switches and the distribution of the model
it switches to. A :class:`Targeting` strategy turns that distribution into the
set of models that get a shadow job, each with the probability that orders it.

Invariants:

* Probabilities are in [0, 1]; a next-model distribution sums to 1 over the
  models other than the current one (uniform when nothing is known).
* ``TopK(k)`` never targets more than ``k`` models; ``ProbabilityGate(g)``
  never targets a model whose switch probability is below ``g``.
* Predictors are deterministic functions of what they observed: no clock, no
  global RNG.
* Bounded: state a predictor keeps per session is dropped at
  :meth:`SwitchPredictor.observe_session_end`; state keyed by a client-named
  task is population knowledge, kept across sessions (bounded where the
  predictor has a ``max_tasks``).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

import attrs

from shadowcore._validators import non_negative, positive_int, probability


@attrs.frozen
class Target:
    """A model to shadow to, with the probability the next call goes there."""

    model: str
    switch_probability: float = attrs.field(validator=probability)


def next_model_distribution_from_counts(
    counts: Mapping[str, float], current_model: str, models: Sequence[str], pseudo_count: float = 0.0
) -> dict[str, float]:
    """P(next call goes to m | it switches) from (pseudo-)counts of next models.

    Each model ``m`` in ``models`` other than ``current_model`` gets the weight
    ``counts.get(m, 0) + pseudo_count`` (a symmetric Dirichlet prior; counts of
    models outside ``models`` and of staying are ignored), and the weights are
    divided by their sum. When the sum is not positive (nothing observed and no
    prior) the distribution is uniform over those models. The result has one
    entry per other model, in the order of ``models``, and sums to 1; it is
    empty when there is no other model. Shared by the predictors that keep
    transition counts (:class:`EmpiricalSwitchPredictor` and the policies'
    own), so they all normalise alike.
    """
    others = [m for m in models if m != current_model]
    weights = {m: counts.get(m, 0.0) + pseudo_count for m in others}
    total = sum(weights.values())
    if total <= 0:
        return {m: 1.0 / len(others) for m in others} if others else {}
    return {m: w / total for m, w in weights.items()}


@attrs.define
class TaskMemory:
    """Which client-named tasks a predictor keeps live counts of, and what it
    learned of their sessions' length.

    Per task: transitions observed, sessions ended (so P(another call | task)),
    and the keys ``(task, from_model)`` its counts live under. With
    ``max_tasks`` set, observing a task beyond that many drops the least
    recently observed one and returns its keys for the predictor to delete;
    tasks of fitted (past) sessions are pinned, never dropped (their counts
    are part of the fitted data). Deterministic: order is observation order.
    """

    max_tasks: int | None = attrs.field(default=None, validator=attrs.validators.optional(positive_int))
    _tasks: dict[str, list] = attrs.field(init=False, factory=dict)  # task -> [calls, ends, {from models}]
    _pinned: set[str] = attrs.field(init=False, factory=set)

    @property
    def num_tasks(self) -> int:
        return len(self._tasks)

    def pin(self, task: str) -> None:
        self._pinned.add(task)

    def observe(self, task: str, from_model: str | None, ended: bool) -> list[tuple[str, str]]:
        """Count a transition from ``from_model`` (or a session end); returns the
        ``(task, from_model)`` keys of a task dropped to keep ``max_tasks``."""
        entry = self._tasks.pop(task, None) or [0, 0, set()]
        self._tasks[task] = entry  # most recently observed last
        entry[1 if ended else 0] += 1
        if from_model is not None:
            entry[2].add(from_model)
        if self.max_tasks is None or len(self._tasks) <= self.max_tasks:
            return []
        victim = next((t for t in self._tasks if t not in self._pinned and t != task), None)
        if victim is None:
            return []
        return [(victim, m) for m in sorted(self._tasks.pop(victim)[2])]

    def another_call_probability(self, task: str, pseudo_count: float) -> float:
        """``(calls + a) / (calls + ends + 2a)``: 1/2 when nothing is known."""
        calls, ends, _ = self._tasks.get(task, (0, 0, ()))
        total = calls + ends + 2 * pseudo_count
        return 0.5 if total <= 0 else (calls + pseudo_count) / total


class SwitchPredictor(ABC):
    """Strategy: P(switch | task, current model) and the next-model distribution."""

    @abstractmethod
    def next_model_distribution(
        self, session_id: str, task: str, current_model: str, models: Sequence[str]
    ) -> dict[str, float]:
        """P(next call goes to m | it switches), for each ``m != current_model``."""

    @abstractmethod
    def switch_probability(self, session_id: str, task: str, current_model: str) -> float:
        """P(the next call uses another model than ``current_model``)."""

    def observe_transition(self, session_id: str, task: str, from_model: str, to_model: str) -> None:
        """Online update: the session's call after ``from_model`` went to ``to_model``."""

    def observe_session_end(self, session_id: str, task: str) -> None:
        """The session ended (the manager's ``on_session_end``): it makes no
        further call. An implementer must drop every state it keeps for
        ``session_id`` (a gateway ends sessions by the thousand) and may learn
        from it, e.g. P(another call | task). Default: nothing kept, nothing
        learned."""

    def limit_tasks(self, max_tasks: int) -> None:
        """Keep live state of at most ``max_tasks`` tasks (least recently
        observed dropped first): a serving front door names tasks after what
        clients send. An implementer that keeps state per task must honour it.
        Default: nothing is kept per task."""


@attrs.define
class EmpiricalSwitchPredictor(SwitchPredictor):
    """Transition counts per (task, current model), with a symmetric Dirichlet
    prior of ``pseudo_count`` per outcome.

    ``fit`` loads past sessions; predicting for a session that was part of the
    fitted set leaves that session out (leave-one-session-out), so a replayed
    session never predicts its own future. Live transitions are added online.

    ``max_tasks`` (default: no bound) keeps the live counts of at most that
    many tasks, the least recently observed dropped first: the task is named
    by the client (a gateway's ``X-Session-Task``), so without a bound a
    client sending fresh names grows the map without end. Ended sessions are
    counted per task (:meth:`another_call_probability`).
    """

    pseudo_count: float = attrs.field(default=1.0, validator=non_negative)
    max_tasks: int | None = attrs.field(default=None, validator=attrs.validators.optional(positive_int))
    _counts: dict[tuple[str, str], dict[str, float]] = attrs.field(
        init=False, factory=lambda: defaultdict(lambda: defaultdict(float))
    )
    _fitted: dict[str, dict[tuple[str, str], dict[str, float]]] = attrs.field(init=False, factory=dict)
    _task_memory: TaskMemory = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._task_memory = TaskMemory(self.max_tasks)

    def fit(self, sessions: Iterable[tuple[str, str, Sequence[str]]]) -> EmpiricalSwitchPredictor:
        """Learn from past sessions: ``(session_id, task, models of its calls)``."""
        for session_id, task, calls in sessions:
            self._task_memory.pin(task)
            own = self._fitted.setdefault(session_id, defaultdict(lambda: defaultdict(float)))
            for a, b in itertools.pairwise(calls):
                self._counts[(task, a)][b] += 1.0
                own[(task, a)][b] += 1.0
        return self

    def observe_transition(self, session_id: str, task: str, from_model: str, to_model: str) -> None:
        self._counts[(task, from_model)][to_model] += 1.0
        for key in self._task_memory.observe(task, from_model, ended=False):
            self._counts.pop(key, None)

    def observe_session_end(self, session_id: str, task: str) -> None:
        for key in self._task_memory.observe(task, None, ended=True):
            self._counts.pop(key, None)

    def limit_tasks(self, max_tasks: int) -> None:
        self.max_tasks = self._task_memory.max_tasks = max_tasks

    def another_call_probability(self, task: str) -> float:
        """P(a call of ``task`` is followed by another one), from the live
        transitions and session ends of that task (see :class:`TaskMemory`)."""
        return self._task_memory.another_call_probability(task, self.pseudo_count)

    def num_tasks(self) -> int:
        """Tasks with live counts kept (at most ``max_tasks`` unpinned ones)."""
        return self._task_memory.num_tasks

    def _row(self, session_id: str, task: str, current: str) -> dict[str, float]:
        row = dict(self._counts.get((task, current), {}))
        own = self._fitted.get(session_id, {}).get((task, current), {})
        for model, n in own.items():
            row[model] = row.get(model, 0.0) - n
        return row

    def switch_probability(self, session_id: str, task: str, current_model: str) -> float:
        row = self._row(session_id, task, current_model)
        stay = row.get(current_model, 0.0) + self.pseudo_count
        switch = sum(n for m, n in row.items() if m != current_model) + self.pseudo_count
        if stay + switch <= 0:  # nothing known and no prior (pseudo_count=0): the prior's limit
            return 0.5
        return switch / (stay + switch)

    def next_model_distribution(
        self, session_id: str, task: str, current_model: str, models: Sequence[str]
    ) -> dict[str, float]:
        row = self._row(session_id, task, current_model)
        return next_model_distribution_from_counts(row, current_model, models, self.pseudo_count)


@attrs.define
class FixedSwitchPredictor(SwitchPredictor):
    """A constant switch probability with uniform next models (tests, Markov routers)."""

    probability: float = attrs.field(default=0.3, validator=probability)

    def switch_probability(self, session_id: str, task: str, current_model: str) -> float:
        return self.probability

    def next_model_distribution(
        self, session_id: str, task: str, current_model: str, models: Sequence[str]
    ) -> dict[str, float]:
        others = [m for m in models if m != current_model]
        return {m: 1.0 / len(others) for m in others}


def rank_targets(p_switch: float, distribution: Mapping[str, float]) -> list[Target]:
    """Targets by non-increasing P(switch to m); ties by model name."""
    ranked = sorted(distribution.items(), key=lambda kv: (-kv[1], kv[0]))
    return [Target(m, min(1.0, max(0.0, p_switch * p))) for m, p in ranked]


class Targeting(ABC):
    """Strategy: which of the ranked candidate models get a shadow job."""

    @abstractmethod
    def choose(self, ranked: Sequence[Target]) -> list[Target]:
        """A subset of ``ranked`` (already in non-increasing probability)."""


@attrs.frozen
class AllOthers(Targeting):
    """Shadow to every model the router did not choose (the paper's default)."""

    def choose(self, ranked: Sequence[Target]) -> list[Target]:
        return list(ranked)


@attrs.frozen
class TopK(Targeting):
    """Shadow only to the ``k`` most likely next models (top-1 in Appendix C)."""

    k: int = attrs.field(default=1, validator=positive_int)

    def choose(self, ranked: Sequence[Target]) -> list[Target]:
        return list(ranked[: self.k])


@attrs.frozen
class ProbabilityGate(Targeting):
    """Shadow only where P(switch to m) >= ``threshold`` (Predictive: 0.25)."""

    threshold: float = attrs.field(default=0.25, validator=probability)

    def choose(self, ranked: Sequence[Target]) -> list[Target]:
        return [t for t in ranked if t.switch_probability >= self.threshold]


@attrs.frozen
class NoTargets(Targeting):
    """Never shadow (No Shadow, Host Tier, Oracle baselines)."""

    def choose(self, ranked: Sequence[Target]) -> list[Target]:
        return []


__all__ = [
    "AllOthers",
    "EmpiricalSwitchPredictor",
    "FixedSwitchPredictor",
    "NoTargets",
    "ProbabilityGate",
    "SwitchPredictor",
    "Target",
    "Targeting",
    "TaskMemory",
    "TopK",
    "next_model_distribution_from_counts",
    "rank_targets",
]
