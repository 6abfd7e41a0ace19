"""Simulator backend for shadowprefill.

Submodules (import them directly; this package imports nothing on purpose):

* :mod:`shadow_sim.models`   -- model architectures and the built-in catalog.
* :mod:`shadow_sim.hardware` -- accelerator specs and tensor-parallel sizing.
* :mod:`shadow_sim.roofline` -- the analytic per-iteration latency model.
"""
