"""No silent no-op: a policy whose smallest grant can never fit a budget on
an engine is named at load with the numbers, and results count the planned
iterations by what decided their shadow work, the same whichever engine path ran them."""

from __future__ import annotations

import copy
import logging

import pytest

from shadowcore.config import PluginRef, ShadowConfig
from shadowcore.diagnostics import STEP_REASONS, smallest_grant_tokens, unreachable_grant
from shadowcore.engine.scenario import FakeBackend
from shadowcore.latency import LinearLatencyModel
from shadowcore.slack import EagerController, HarvestController, NoShadowController, SloSlackController

SCENARIO = {"duration_s": 30.0, "warmup_s": 0.0}


class _Count:
    def __init__(self) -> None:
        self.plans = 0

    def on_plan(self, snapshot, plan) -> None:
        self.plans += 1


def test_beta_quarter_on_the_fake_engine_is_named_and_plans_nothing(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="shadowcore.pipeline"):
        result = FakeBackend().run(SCENARIO, ShadowConfig(PluginRef("harvest-slo", {"beta": 0.25})))
    assert result.metrics["shadow_tokens"] == 0
    assert len(result.notices) == 2  # one per model (the small one and the 3x slower one), not per instance
    small = next(n for n in result.notices if "on small/" in n)
    assert "n_min 256 predicted 9.4 ms > idle budget 6.25 ms" in small
    assert [r.getMessage() for r in caplog.records if "n_min" in r.getMessage()] == list(result.notices)
    assert result.metrics["steps_granted"] == 0 and result.metrics["steps_below_n_min"] > 0


def test_paper_beta_plans_and_says_nothing() -> None:
    result = FakeBackend().run(SCENARIO, ShadowConfig(PluginRef("harvest-slo")))
    assert result.notices == ()
    assert result.metrics["steps_granted"] > 0 and result.metrics["shadow_tokens"] > 0


def test_step_counts_cover_every_iteration_whichever_path_ran_it() -> None:
    """An observer makes the hooks plan every iteration (no fast path); without one the engine skips and
    proves most of them empty. The counts are the same either way and sum to the iterations."""
    scenario = {**SCENARIO, "normal_rate_per_s": 8.0, "num_blocks": 640}
    counter = _Count()
    planned = FakeBackend().run(scenario, ShadowConfig(PluginRef("harvest-slo")), observers=(counter,))
    fast = FakeBackend().run(scenario, ShadowConfig(PluginRef("harvest-slo")))
    counts = {why: planned.metrics[f"steps_{why}"] for why in STEP_REASONS}
    assert sum(counts.values()) == counter.plans
    assert {why: fast.metrics[f"steps_{why}"] for why in STEP_REASONS} == counts
    for why in ("waiting", "no_jobs", "granted", "zero_budget", "no_room"):  # the engine blocks only with a queue
        assert counts[why] > 0, counts


@pytest.mark.parametrize("controller", [NoShadowController(), EagerController(), SloSlackController(n_min=0)])
def test_reachable_or_never_granting_controllers_are_not_flagged(controller) -> None:
    assert unreachable_grant(controller, LinearLatencyModel(), 16, 0.025) is None


def test_the_check_reads_a_copy_and_names_every_budget() -> None:
    harvest = HarvestController(beta=0.25)
    before = copy.deepcopy(harvest.credit)
    why = unreachable_grant(harvest, LinearLatencyModel(), 16, 0.025)
    assert harvest.credit == before  # the probe's 20 decode-only iterations credited a copy
    assert why is not None and why.startswith("n_min 256 predicted 9.4 ms > idle budget 6.25 ms; adds 6.4 ms > ")
    assert "credit budget 6.25 ms" in why
    assert smallest_grant_tokens(SloSlackController(n_min=0), 16) == 16
    assert "one block (16 tokens)" in unreachable_grant(SloSlackController(n_min=0, beta=0.01),
                                                        LinearLatencyModel(), 16, 0.025)


@pytest.mark.parametrize("policy", ["no-shadow", "host-tier"])
def test_a_never_granting_hook_plans_every_iteration_for_an_observer_and_nothing_without(policy) -> None:
    """A controller that never grants: with no observer its hook is inert (``_fastpath.inert``) and the
    engine runs every iteration as with no hook; an observer, added after the run is built, sees every one
    of them planned (as many ``on_plan`` as iterations, empty ones included); the results are the same either way."""
    from shadowcore.engine.scenario import FakeRun, FakeScenario

    fields = {**SCENARIO, "normal_rate_per_s": 8.0}
    runs = []
    for observed in (False, True):
        run = FakeRun(FakeScenario.from_dict(fields), ShadowConfig(PluginRef(policy)))
        counter = _Count()
        if observed:
            run.runtime.observers.add(counter)
        result = run.run()
        runs.append((result.metrics, counter.plans, sum(i.iteration for i in run.cluster.by_id.values())))
    (quiet, none, iterations), (seen, plans, iterations_seen) = runs
    assert none == 0 and iterations > 1000
    assert plans == iterations_seen == iterations
    assert quiet == seen  # the step counts too: a controller that never grants is counted on no path
