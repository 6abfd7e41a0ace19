"""Our second policy: expected-benefit targeting with a population-backoff
predictor (``benefit-host``), built on Harvest-SLO+Host.

Where the gain and the waste come from (N = 5, one instance per model): a
shadow token pays off only if the session's next call switches to that target
*and* the block is still cached then; every other shadow token is waste, and
every shadow chunk that rides on an iteration carrying a routed call stretches
that call. The paper's predictor counts transitions per (task, current model);
with many distinct tasks (the synthetic presets draw from 1,000) it has almost
never seen the task, so its next-model distribution is the uniform prior and
all-targets spends most of its shadow work on targets the session never visits,
while top-1 picks an arbitrary one of four.

``benefit-host`` changes three things:

* **Predictor** (:class:`PopulationBackoffPredictor`): a hierarchical estimate.
  The population's transition counts from the current model (all tasks, learned
  online) form the prior, weighted by ``prior_strength`` pseudo-observations;
  the (task, current model) counts and the session's own transitions (weight
  ``session_weight``) are added on top. Where a session goes next depends on
  the current model (an accuracy-per-cost router sends easy steps to cheaper
  models and hard ones to more capable ones, so the extremes mostly stay or
  move to a neighbour), and the population learns that within minutes; how
  sharp it gets is the router's property, not ours.
* **Targeting** (:class:`ExpectedBenefitTargets`): shadow to model ``m`` only
  when its absolute probability ``P(switch) * P(m | switch)`` is at least
  ``gate``, at most ``max_k`` targets, most likely first. A shadow token saves
  one prefill token of the switch call with probability ``P``; ``gate`` is the
  price of a shadow token relative to a saved one (slack is cheap but not free:
  KV space under the shadow cap, routed-step stretch), so expected benefit
  exceeds expected cost exactly when ``P >= gate``. Jobs are ordered across
  sessions by the same absolute ``P`` (the manager's order), which is expected
  saved prefill per shadow token on that instance.
* **No routed-step credit by default** (``delta = 0``): shadow chunks use only
  idle time and the SLO slack of iterations without a routed call, so a routed
  call's own iterations are never stretched by shadow work.

Invariants: targets are a prefix of the ranked candidates, never more than
``max_k``, none below ``gate``; the predictor is a deterministic function of
the transitions it observed (no clock, no RNG); its next-model distribution
sums to 1 over the models other than the current one.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import attrs

from shadow_policies.building import policy_spec, slo_slack, user_args
from shadowcore._validators import non_negative, positive_int, probability
from shadowcore.errors import ConfigError
from shadowcore.policy import Component, PolicySpec
from shadowcore.switch import (
    ProbabilityGate,
    SwitchPredictor,
    Target,
    Targeting,
    TaskMemory,
    TopK,
    next_model_distribution_from_counts,
)


@attrs.frozen
class ExpectedBenefitTargets(Targeting):
    """The most likely targets whose absolute switch probability is at least
    ``gate``, at most ``max_k`` of them."""

    gate: float = attrs.field(default=0.1, validator=probability)
    max_k: int = attrs.field(default=2, validator=positive_int)

    def choose(self, ranked: Sequence[Target]) -> list[Target]:
        return ProbabilityGate(self.gate).choose(TopK(self.max_k).choose(ranked))


def _counts() -> defaultdict:
    return defaultdict(lambda: defaultdict(float))


@attrs.define
class PopulationBackoffPredictor(SwitchPredictor):
    """Next-call model from (session, task, current model) counts backed off to
    the population's transitions from the current model.

    ``row[m] = strength * p_pop(m | current) + n_task(current -> m) +
    session_weight * n_session(current -> m)`` over every model ``m`` (the current
    one included: staying), where ``p_pop`` is the population's share with a
    symmetric Dirichlet prior of ``pseudo_count`` per model seen. With nothing
    observed it is uniform over the models it has seen, and ``switch_probability``
    is 1/2 (the limit of the prior). The session's own counts are dropped when it
    ends; ``max_tasks`` bounds the tasks whose counts are kept (least recently
    observed dropped first; default: no bound).
    """

    prior_strength: float = attrs.field(default=4.0, validator=non_negative)
    session_weight: float = attrs.field(default=2.0, validator=non_negative)
    pseudo_count: float = attrs.field(default=1.0, validator=non_negative)
    _population: dict[str, dict[str, float]] = attrs.field(init=False, factory=_counts)
    _task: dict[tuple[str, str], dict[str, float]] = attrs.field(init=False, factory=_counts)
    max_tasks: int | None = attrs.field(default=None, validator=attrs.validators.optional(positive_int))
    _own: dict[str, dict[str, dict[str, float]]] = attrs.field(  # session -> from -> to
        init=False, factory=lambda: defaultdict(_counts))
    _known: dict[str, None] = attrs.field(init=False, factory=dict)  # every model seen, in order
    _task_memory: TaskMemory = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._task_memory = TaskMemory(self.max_tasks)

    def observe_transition(self, session_id: str, task: str, from_model: str, to_model: str) -> None:
        self._known.update(dict.fromkeys((from_model, to_model)))
        self._population[from_model][to_model] += 1.0
        self._task[(task, from_model)][to_model] += 1.0
        self._own[session_id][from_model][to_model] += 1.0
        for key in self._task_memory.observe(task, from_model, ended=False):
            self._task.pop(key, None)

    def observe_session_end(self, session_id: str, task: str) -> None:
        """The session's own counts go with it; the task's stay (at most ``max_tasks`` tasks)."""
        self._own.pop(session_id, None)
        for key in self._task_memory.observe(task, None, ended=True):
            self._task.pop(key, None)

    def limit_tasks(self, max_tasks: int) -> None:
        self.max_tasks = self._task_memory.max_tasks = max_tasks

    def another_call_probability(self, task: str) -> float:
        """P(a call of ``task`` is followed by another one) (see :class:`~shadowcore.switch.TaskMemory`)."""
        return self._task_memory.another_call_probability(task, self.pseudo_count)

    def num_sessions(self) -> int:
        """Sessions whose own transitions are kept (live sessions with a transition)."""
        return len(self._own)

    def num_tasks(self) -> int:
        return self._task_memory.num_tasks

    def _row(self, session_id: str, task: str, current: str, models: Sequence[str]) -> dict[str, float]:
        pop = self._population.get(current, {})
        prior = {m: pop.get(m, 0.0) + self.pseudo_count for m in models}
        total = sum(prior.values())
        row = {m: (self.prior_strength * w / total if total > 0 else 0.0) for m, w in prior.items()}
        for m, n in self._task.get((task, current), {}).items():
            row[m] = row.get(m, 0.0) + n
        for m, n in self._own.get(session_id, {}).get(current, {}).items():
            row[m] = row.get(m, 0.0) + self.session_weight * n
        return row

    def _models(self, current: str, models: Sequence[str] = ()) -> list[str]:
        self._known.update(dict.fromkeys((current, *models)))
        return list(self._known)

    def switch_probability(self, session_id: str, task: str, current_model: str) -> float:
        row = self._row(session_id, task, current_model, self._models(current_model))
        if len(row) == 1:  # no other model known yet: the prior's limit
            return 0.5
        stay = row.get(current_model, 0.0)
        switch = sum(w for m, w in row.items() if m != current_model)
        return 0.5 if stay + switch <= 0 else switch / (stay + switch)

    def next_model_distribution(
        self, session_id: str, task: str, current_model: str, models: Sequence[str]
    ) -> dict[str, float]:
        row = self._row(session_id, task, current_model, self._models(current_model, models))
        return next_model_distribution_from_counts(row, current_model, models)  # the prior is already in the row


@user_args
def benefit_host(gate: float = 0.1, max_k: int = 2, prior_strength: float = 4.0, session_weight: float = 2.0,
                 beta: float = 0.5, delta: float = 0.0, n_min: int = 256, margin: float = 0.1,
                 chunk_tokens: int = 2048, **kv) -> PolicySpec:
    spec = policy_spec("benefit-host", "Harvest-SLO+Host with expected-benefit targeting (absolute switch "
                       "probability >= gate, at most max_k), a population-backoff predictor and no routed-step "
                       "credit.", slo_slack(beta, delta, n_min, margin, chunk_tokens),
                       targeting=ExpectedBenefitTargets(gate, max_k), host=True, **kv)
    predictor = Component(PopulationBackoffPredictor, {"prior_strength": prior_strength,
                                                       "session_weight": session_weight,
                                                       "pseudo_count": kv.get("pseudo_count", 1.0)})
    try:
        return attrs.evolve(spec, predictor=predictor)
    except ConfigError as e:  # name the keyword the user wrote, not the component's field
        raise ConfigError(e.field.removeprefix("predictor."), e.value, e.problem) from None
