"""``example-gated-top1``: Harvest-SLO's budget, spent on one likely target.

The paper's Harvest-SLO shadows every model the router did not choose, and
Predictive gates all of them on a switch probability. This policy combines
the two differently: the SLO-slack controller (Algorithm 1) decides how much
shadow work fits in an iteration, and :class:`GatedTopK` spends it on at most
``top_k`` models (default 1), each only if the probability that the next call
goes there is at least ``gate``. Fewer, likelier targets waste less prefill
and KV room when sessions rarely switch.

Only public core pieces are used: :class:`~shadowcore.slack.SloSlackController`,
:class:`~shadowcore.switch.EmpiricalSwitchPredictor`, and the
:class:`~shadowcore.switch.Targeting` strategy interface.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from shadowcore.errors import ConfigError
from shadowcore.kv import KVClassPolicy
from shadowcore.policy import Component, PolicySpec
from shadowcore.slack import SloSlackController
from shadowcore.switch import EmpiricalSwitchPredictor, Target, Targeting

NAME = "example-gated-top1"


def _top_k(_instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(attribute.name, value, "must be an integer >= 1")


def _gate(_instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ConfigError(attribute.name, value, "must be a number in [0, 1]")


@attrs.frozen
class GatedTopK(Targeting):
    """The ``top_k`` most likely next models whose switch probability is at
    least ``gate``.

    Keeps the Targeting contract: a subset of ``ranked``, in its order. The
    attribute names are the policy's argument names, so a bad value is
    reported as ``policy.args.top_k`` / ``policy.args.gate``.
    """

    top_k: int = attrs.field(default=1, validator=_top_k)
    gate: float = attrs.field(default=0.1, validator=_gate)

    def choose(self, ranked: Sequence[Target]) -> list[Target]:
        return [t for t in ranked[: self.top_k] if t.switch_probability >= self.gate]


def example_gated_top1(
    beta: float = 0.5,
    delta: float = 0.025,
    n_min: int = 256,
    margin: float = 0.1,
    top_k: int = 1,
    gate: float = 0.1,
    shadow_cap: float = 0.25,
    pseudo_count: float = 1.0,
) -> PolicySpec:
    """SLO-slack controller + :class:`GatedTopK` targeting (JSON keyword arguments only)."""
    slack = {"beta": beta, "delta": delta, "n_min": n_min, "margin": margin}
    # Build each piece once here, so that a bad value is reported under the
    # argument name the user wrote (``policy.args.beta``), not under the
    # component field (``policy.args.slack.beta``) that PolicySpec would use.
    SloSlackController(**slack)
    EmpiricalSwitchPredictor(pseudo_count=pseudo_count)
    try:
        kv = KVClassPolicy(shadow_cap_fraction=shadow_cap)
    except ConfigError as e:
        raise ConfigError("shadow_cap", e.value, e.problem) from None
    return PolicySpec(
        name=NAME,
        description="Harvest-SLO budget, shadowing only the most likely next model when P >= gate.",
        slack=Component(SloSlackController, slack),
        predictor=Component(EmpiricalSwitchPredictor, {"pseudo_count": pseudo_count}),
        targeting=GatedTopK(top_k, gate),
        kv=kv,
    )
