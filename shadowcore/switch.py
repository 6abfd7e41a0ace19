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
"""

from __future__ import annotations

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


@attrs.define
class EmpiricalSwitchPredictor(SwitchPredictor):
    """Transition counts per (task, current model), with a symmetric Dirichlet
    prior of ``pseudo_count`` per outcome.

    ``fit`` loads past sessions; predicting for a session that was part of the
    fitted set leaves that session out (leave-one-session-out), so a replayed
    session never predicts its own future. Live transitions are added online.
    """

    pseudo_count: float = attrs.field(default=1.0, validator=non_negative)
    _counts: dict[tuple[str, str], dict[str, float]] = attrs.field(
        init=False, factory=lambda: defaultdict(lambda: defaultdict(float))
    )
    _fitted: dict[str, dict[tuple[str, str], dict[str, float]]] = attrs.field(init=False, factory=dict)

    def fit(self, sessions: Iterable[tuple[str, str, Sequence[str]]]) -> EmpiricalSwitchPredictor:
        """Learn from past sessions: ``(session_id, task, models of its calls)``."""
        for session_id, task, calls in sessions:
            own = self._fitted.setdefault(session_id, defaultdict(lambda: defaultdict(float)))
            for a, b in zip(calls, calls[1:]):
                self._counts[(task, a)][b] += 1.0
                own[(task, a)][b] += 1.0
        return self

    def observe_transition(self, session_id: str, task: str, from_model: str, to_model: str) -> None:
        self._counts[(task, from_model)][to_model] += 1.0

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
    "TopK",
    "next_model_distribution_from_counts",
    "rank_targets",
]
