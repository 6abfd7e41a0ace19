"""The deterministic in-memory engine: production code, not test kit.

:mod:`shadowcore.engine.instance` is one engine instance with vLLM v1
semantics (the simulator backend's engine and the kit's fake engine are this
one implementation); :mod:`shadowcore.engine.scenario` holds the cluster and
the router-side session driver. Like the rest of :mod:`shadowcore` it imports
only attrs and numpy. :mod:`shadowcore.testing` re-uses it; no backend imports
the testing kit.
"""
