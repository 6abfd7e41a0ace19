"""Machines for the two routing-side strategies:

* :class:`SwitchPredictorMachine` feeds a :class:`~shadowcore.switch.SwitchPredictor`
  transitions of a few sessions and tasks (as the
  :class:`~shadowcore.manager.ShadowManager` does on every call) and asks it
  in between.
* :class:`TargetingMachine` asks a :class:`~shadowcore.switch.Targeting` to
  choose from ranked lists as :func:`~shadowcore.switch.rank_targets` builds
  them (ties and zero probabilities likely).

The rules are those of :mod:`shadowcore.testing.contracts`
(:func:`~shadowcore.testing.contracts.predictor_problems`,
:func:`~shadowcore.testing.contracts.targeting_problems`), so a machine and
``check_policy`` never disagree on what is a violation.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from shadowcore.switch import SwitchPredictor, Target, Targeting, TopK
from shadowcore.testing import strategies as sst
from shadowcore.testing.contracts import predictor_problems, targeting_problems
from shadowcore.testing.machines._base import Draw
from shadowcore.testing.machines._base import pick as _pick

__all__ = ["PREDICTOR_CHECKS", "TARGETING_CHECKS", "SwitchPredictorMachine", "TargetingMachine"]

PREDICTOR_CHECKS = frozenset({"contract", "deterministic"})
TARGETING_CHECKS = frozenset({"contract", "at_most"})
_MODEL_NAMES = ("m0", "m1", "m2", "m3", "m4")


class SwitchPredictorMachine(RuleBasedStateMachine):
    """Drives a switch predictor through observed transitions and questions.

    ``"contract"``: every answer keeps the predictor rules of
    :mod:`shadowcore.testing.contracts` (a switch probability in [0, 1]; a
    next-model distribution over the other models only, each in [0, 1],
    summing to 1).

    ``"deterministic"``: a copy of the predictor taken before the first
    transition and fed the same transitions gives the same answers (no clock,
    no global RNG, no dependence on anything but what it observed).

    Subclass hooks: :meth:`make_predictor` (the predictor under test), and
    ``checks``.
    """

    checks: ClassVar[frozenset[str]] = PREDICTOR_CHECKS

    def __init__(self) -> None:
        super().__init__()
        self.predictor: Any = None

    def make_predictor(self, draw: Draw) -> SwitchPredictor:
        """The predictor under test (default: a shipped one, random parameters)."""
        return draw(sst.switch_predictors())

    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        self.models = _MODEL_NAMES[: data.draw(st.integers(2, len(_MODEL_NAMES)), label="models")]
        self.predictor = self.make_predictor(data.draw)
        self.twin = copy.deepcopy(self.predictor) if "deterministic" in self.checks else None
        self.sessions = [f"s{i}" for i in range(data.draw(st.integers(1, 3), label="sessions"))]
        self.tasks = ["", "code", "search"][: data.draw(st.integers(1, 3), label="tasks")]
        self.current = {s: _pick(data, self.models) for s in self.sessions}
        self.task = {s: _pick(data, self.tasks) for s in self.sessions}

    @rule(data=st.data())
    def transition(self, data: st.DataObject) -> None:
        """A session's next call went to some model (the same one: no switch)."""
        s = _pick(data, self.sessions)
        to = _pick(data, self.models)
        for p in (self.predictor, self.twin):
            if p is not None:
                p.observe_transition(s, self.task[s], self.current[s], to)
        self.current[s] = to

    @rule(data=st.data())
    def ask(self, data: st.DataObject) -> None:
        s = _pick(data, self.sessions)
        current = _pick(data, self.models) if data.draw(st.booleans()) else self.current[s]
        if "contract" in self.checks:
            problems = predictor_problems(self.predictor, s, self.task[s], current, self.models)
            assert not problems, "\n".join(problems)
        if self.twin is not None:
            args = (s, self.task[s], current)
            a = (self.predictor.switch_probability(*args), self.predictor.next_model_distribution(*args, self.models))
            b = (self.twin.switch_probability(*args), self.twin.next_model_distribution(*args, self.models))
            assert a == b, f"same transitions, different answers for {args}: {a} != {b}"


class TargetingMachine(RuleBasedStateMachine):
    """Asks a targeting strategy to choose, again and again.

    ``"contract"``: every choice is a subsequence of the ranked list (each
    target one of the ranked ones, unchanged, in ranked order, no model twice).

    ``"at_most"``: a choice has at most :meth:`max_targets` targets (``TopK``:
    ``k``; ``None``, the default for any other: not checked).

    Subclass hooks: :meth:`make_targeting`, :meth:`max_targets`, ``checks``.
    """

    checks: ClassVar[frozenset[str]] = TARGETING_CHECKS

    def __init__(self) -> None:
        super().__init__()
        self.targeting: Any = None

    def make_targeting(self, draw: Draw) -> Targeting:
        """The targeting under test (default: a shipped one, random parameters)."""
        return draw(sst.targetings())

    def max_targets(self) -> int | None:
        return self.targeting.k if isinstance(self.targeting, TopK) else None

    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        self.targeting = self.make_targeting(data.draw)

    @rule(ranked=sst.ranked_targets())
    def choose(self, ranked: list[Target]) -> None:
        chosen = self.targeting.choose(list(ranked))
        if "contract" in self.checks:
            problems = targeting_problems(ranked, chosen)
            assert not problems, "\n".join(problems)
        bound = self.max_targets()
        if "at_most" in self.checks and bound is not None:
            assert len(chosen) <= bound, f"{len(chosen)} targets > {bound}: {chosen}"
