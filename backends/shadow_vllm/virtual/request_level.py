"""The paper's request-level prototype (Appendix D.1) on virtual engines
(:class:`RequestLevelFeeder`): after each call completes, its prompt and
output go to the other models' instances as a lowest-priority request with one
output token, through the router side's
:class:`~shadow_gateway.request_level.RequestLevelShadower` (newest per
session, one in flight per instance, sent only when that instance's waiting
queue is empty).

Invariants: the feeder only submits through the shadower and reads the run;
a session's pending shadow on an instance is dropped when that session's next
call is seen there (at the feeder's next call: it runs on router-side events).
The engines must use ``scheduling_policy="priority"``.
"""

from __future__ import annotations

import itertools
from typing import Any


class RequestLevelFeeder:
    """The request-level baseline on a :class:`~shadow_vllm.virtual.VirtualScenarioRun`
    (its ``shadow_feeder``, called after every router-side event): completed
    calls go to the other models' instances through a ``RequestLevelShadower``."""

    def __init__(self) -> None:
        self.shadower: Any = None
        self._num_calls_seen = 0
        self._num_requests_seen: dict[str, int] = {}  # per instance: requests already looked at (in added order)

    def __call__(self, run: Any) -> None:
        from shadow_gateway.request_level import Destination, RequestLevelShadower

        from shadow_vllm.backend import virtual_submitter

        engines = run.cluster.by_id
        if self.shadower is None:
            self.shadower = RequestLevelShadower(virtual_submitter(engines, lambda: self.shadower),
                                                 lambda i: len(engines[i].scheduler.waiting))
        for instance, engine in engines.items():  # calls seen on an instance drop that session's pending shadow
            seen = self._num_requests_seen.get(instance, 0)
            for rid in itertools.islice(engine.requests, seen, None):  # only those added since the last call
                if "#" in rid and not rid.startswith("shadow-"):
                    self.shadower.on_call_arrival(rid.split("#")[0], instance)
            self._num_requests_seen[instance] = len(engine.requests)
        for call in run.calls[self._num_calls_seen:]:
            placed = next(e for e in run.cluster.by_model[call.model]
                          if f"{call.session_id}#{call.call_index}" in e.requests)
            handle = placed.requests[f"{call.session_id}#{call.call_index}"]
            others = [Destination(engine.name, model) for model, engines_of in run.cluster.by_model.items()
                      if model != call.model for engine in engines_of]
            self.shadower.on_call_complete(call.session_id, handle.prompt_token_ids, handle.output_token_ids, others)
        self._num_calls_seen = len(run.calls)
        self.shadower.pump()
