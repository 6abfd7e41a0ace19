"""The deterministic in-memory engine: production code, not test kit.

:mod:`~shadowcore.engine.instance` is one engine instance with vLLM v1
semantics (the simulator backend's engine and the kit's fake engine are this
one implementation); :mod:`~shadowcore.engine.cluster` holds a run's
instances; :mod:`~shadowcore.engine.workload` the frozen workload a run plays;
:mod:`~shadowcore.engine.driver` the one router-side session driver;
:mod:`~shadowcore.engine.run` a scenario under a policy on in-memory
instances; :mod:`~shadowcore.engine.records` what a run reports;
:mod:`~shadowcore.engine.kinds` the event loop's tie-break classes;
:mod:`~shadowcore.engine.scenario` the ``fake`` backend. Like the rest of
:mod:`shadowcore` it imports only attrs and numpy. :mod:`shadowcore.testing`
re-uses it; no backend imports the testing kit (``tests/test_layout.py``).
"""
