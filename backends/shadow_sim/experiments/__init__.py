"""Experiments on the simulator: capacity calibration, normal traffic, the
runner (one scenario under several policies, matched calls, seeds x windows),
metrics, and the ``sweep`` / ``reproduce`` commands."""
