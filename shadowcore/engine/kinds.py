"""The tie-break classes of a run's one event loop (one owner of the rule).

At equal times an iteration end (or a KV link completion) frees its slots
before new work arrives; a routed call arrives before a normal request;
wake-ups of idle instances come last. Within a class, insertion order.
"""

STEP_END, CALL, NORMAL, WAKE = 0, 1, 2, 3
