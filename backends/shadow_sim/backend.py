"""The ``sim`` backend: a :class:`~shadow_sim.simulator.SimScenario` (a plain
scenario, or an experiment for ``shadowprefill simulate``) under one policy.

It is the simulator's facade and imports what it runs; nothing in
:mod:`shadow_sim` imports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shadow_sim.disagg import PDRun
from shadow_sim.experiments.sweep import simulate_table
from shadow_sim.simulator import SimRun, SimScenario
from shadowcore.config import ShadowConfig
from shadowcore.engine.records import ScenarioResult


class SimBackend:
    """The ``sim`` backend: the simulator (catalog models on H100/H200, Vidur-grounded latency, P/D, energy)."""

    name = "sim"

    def run(self, scenario: Mapping[str, Any] | SimScenario, shadow: ShadowConfig, observers: tuple = ()) -> ScenarioResult:
        sc = scenario if isinstance(scenario, SimScenario) else SimScenario.from_dict(scenario)
        run_cls = SimRun if sc.pd is None else PDRun
        return run_cls(sc, shadow, observers).run()

    def compare(self, scenario: Mapping[str, Any], configs: Any, out: Any = None, wide: bool = False) -> str | None:
        """``shadowprefill simulate`` on this backend: an experiment (the embedded
        default for an empty scenario, or ``{"experiment": {...}}``) through the
        experiment runner, writing the result folder ``out`` when given; None
        for a plain scenario (run policy by policy)."""
        return simulate_table(scenario, configs, out=out, wide=wide)
