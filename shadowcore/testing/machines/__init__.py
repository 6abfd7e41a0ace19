"""Hypothesis state machines that plugin authors subclass to property-test
their KV class manager or slack controller against the core's invariants.

Four machines, each a :class:`hypothesis.stateful.RuleBasedStateMachine`, one
module per concern (``machines.kv``, ``machines.slack``, ``machines.switch``;
import them from here):

* :class:`KVClassMachine` drives a :class:`~shadowcore.kv.KVClassManager`
  (or anything with its public API: override :meth:`KVClassMachine.make_manager`)
  through allocations, extensions, releases and time steps, and keeps an
  independent model of who holds which block.
* :class:`SlackControllerMachine` drives one :class:`~shadowcore.hook.EngineHook`
  with a stub job source and a stub engine port through snapshots and
  outcomes; override :meth:`SlackControllerMachine.make_controller` (and
  optionally ``make_latency_model``, ``make_port``, ``make_job_source``).
* :class:`SwitchPredictorMachine` feeds a switch predictor transitions and
  checks its answers (override :meth:`SwitchPredictorMachine.make_predictor`).
* :class:`TargetingMachine` asks a targeting to choose from ranked lists
  (override :meth:`TargetingMachine.make_targeting`).

Each machine checks a set of named invariants (``checks``; all by default).
The tests of the core enable one at a time, so that a failure names the
invariant; a plugin author usually keeps them all::

    from hypothesis import Phase, settings
    from hypothesis import strategies as st
    from shadowcore.testing.machines import SlackControllerMachine

    class MyControllerMachine(SlackControllerMachine):
        def make_controller(self, draw):
            return MyController(beta=draw(st.floats(0.1, 1.0)))

    MyControllerMachine.TestCase.settings = settings(
        max_examples=50, stateful_step_count=25, deadline=None,
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],  # no slow "explain"
    )
    TestMyController = MyControllerMachine.TestCase

A controller that is not one of the shipped ones should also override the
expectations the machine cannot guess: ``idle_cap_s``,
``budget_upper_bound_s`` and ``credit_charged`` return ``None`` (check
skipped) for a controller they do not know; ``credit_delta`` reads
``controller.delta``.

This package imports hypothesis (the ``dev`` extra); :mod:`shadowcore` never
imports it. The stubs (:class:`StubEnginePort`, :class:`StubJobSource`) live
in :mod:`shadowcore.testing.stubs` and the rules in
:mod:`shadowcore.testing.contracts` (neither needs hypothesis); both are
re-exported here.
"""

from shadowcore.testing.contracts import EPS_S, decode_slack_reference_s, prefill_slack_reference_s
from shadowcore.testing.machines.kv import KV_CHECKS, KVClassMachine
from shadowcore.testing.machines.slack import SLACK_CHECKS, SlackControllerMachine
from shadowcore.testing.machines.switch import (
    PREDICTOR_CHECKS,
    TARGETING_CHECKS,
    SwitchPredictorMachine,
    TargetingMachine,
)
from shadowcore.testing.stubs import ServedJob, StubEnginePort, StubJobSource

__all__ = [
    "EPS_S",
    "KV_CHECKS",
    "PREDICTOR_CHECKS",
    "SLACK_CHECKS",
    "TARGETING_CHECKS",
    "KVClassMachine",
    "ServedJob",
    "SlackControllerMachine",
    "StubEnginePort",
    "StubJobSource",
    "SwitchPredictorMachine",
    "TargetingMachine",
    "decode_slack_reference_s",
    "prefill_slack_reference_s",
]
