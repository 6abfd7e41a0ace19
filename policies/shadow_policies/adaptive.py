"""Our policy: adaptive top-k targeting with a session-aware next-model predictor
(``adaptive-host``), built on Harvest-SLO+Host.

With N > 2 models the paper shadows either every other model (most shadow
tokens wasted: 89% at N=5) or only the top-1 predicted next model (about a
quarter of the gain lost; Appendix C). ``adaptive-host`` shadows the SMALLEST set
of most likely next models whose predicted probability mass reaches ``mass``
(nucleus targeting): one target when the predictor is confident, more when it is
not, and never a model whose switch probability is below ``floor``. Its
predictor adds the session's own transitions (weight ``session_weight``) to the
per-(task, model) counts, because consecutive steps of a task are alike: a
session that went from A to C before is likely to do it again. The session's
own counts are dropped when it ends.

Invariants: at least one target when any candidate has probability >= ``floor``;
targets are a prefix of the ranked candidates (so ordering by switch probability
is kept); deterministic in what was observed (no clock, no RNG).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import attrs

from shadow_policies.building import policy_spec, slo_slack, user_args
from shadowcore._validators import non_negative, probability
from shadowcore.errors import ConfigError
from shadowcore.policy import Component, PolicySpec
from shadowcore.switch import EmpiricalSwitchPredictor, Target, Targeting


def _mass(_instance: object, attribute: attrs.Attribute, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigError(attribute.name, value, "must be in (0, 1]")


@attrs.frozen
class NucleusTargets(Targeting):
    """The shortest prefix of the ranked targets whose share of the total switch
    probability reaches ``mass``; targets below ``floor`` are never chosen."""

    mass: float = attrs.field(default=0.8, validator=_mass)
    floor: float = attrs.field(default=0.02, validator=probability)

    def choose(self, ranked: Sequence[Target]) -> list[Target]:
        total = sum(t.switch_probability for t in ranked)
        if total <= 0:
            return list(ranked[:1])
        out, acc = [], 0.0
        for t in ranked:
            if t.switch_probability < self.floor:
                break
            out.append(t)
            acc += t.switch_probability
            if acc >= self.mass * total - 1e-12:
                break
        return out


@attrs.define
class SessionAwarePredictor(EmpiricalSwitchPredictor):
    """:class:`EmpiricalSwitchPredictor` plus the session's own transition counts,
    weighted by ``session_weight``."""

    session_weight: float = attrs.field(default=2.0, validator=non_negative)
    _own: dict[str, dict[str, dict[str, float]]] = attrs.field(
        init=False, factory=lambda: defaultdict(lambda: defaultdict(lambda: defaultdict(float))))

    def observe_transition(self, session_id: str, task: str, from_model: str, to_model: str) -> None:
        super().observe_transition(session_id, task, from_model, to_model)
        self._own[session_id][from_model][to_model] += 1.0

    def observe_session_end(self, session_id: str, task: str) -> None:
        """The session's own counts go with it (the task's counts stay)."""
        self._own.pop(session_id, None)
        super().observe_session_end(session_id, task)

    def num_sessions(self) -> int:
        """Sessions whose own transitions are kept (live sessions with a transition)."""
        return len(self._own)

    def _row(self, session_id: str, task: str, current: str) -> dict[str, float]:
        row = super()._row(session_id, task, current)
        own = self._own.get(session_id, {}).get(current, {})
        for model, n in own.items():
            row[model] = row.get(model, 0.0) + self.session_weight * n
        return row


@user_args
def adaptive_host(mass: float = 0.8, floor: float = 0.02, session_weight: float = 2.0, beta: float = 0.5,
                  delta: float = 0.025, n_min: int = 256, margin: float = 0.1, chunk_tokens: int = 2048,
                  **kv) -> PolicySpec:
    spec = policy_spec("adaptive-host", "Harvest-SLO+Host with nucleus (adaptive top-k) targeting and a "
                       "session-aware next-model predictor.", slo_slack(beta, delta, n_min, margin, chunk_tokens),
                       targeting=NucleusTargets(mass, floor), host=True, **kv)
    predictor = Component(SessionAwarePredictor, {"pseudo_count": kv.get("pseudo_count", 1.0),
                                                  "session_weight": session_weight})
    return attrs.evolve(spec, predictor=predictor)
