"""The one router-side session driver: plays a
:class:`~shadowcore.engine.workload.Workload` on a shared event loop against
any engines that implement :class:`ServingPort`, with the core's
:class:`~shadowcore.manager.ShadowManager` placing every call.

Used by the simulator (:class:`~shadowcore.engine.run.ScenarioRun`), the P/D
simulator and vLLM virtual time; the gateway is the live driver of the same
manager API.

Invariants:

* Per call, in this order: the manager places it (``on_call_arrival``), the
  port starts it on the placed instance, the port settles (idle engines wake,
  shadow requests are fed). Its streamed tokens extend the session
  (``on_output_tokens``) as they arrive. When it finishes, it is recorded and
  (unless it was the session's last) the manager is told the tool gap started
  (``on_call_done``) and the next call is scheduled ``gap_after_s`` later (or the session ends), then
  the port settles again.
* A compacting call (``compact_to_tokens``) on a port with token ids asks
  the port for ``compact_to_tokens + num_new_tokens`` ids at once: the first
  ``compact_to_tokens`` are the summary the new epoch starts from, the rest
  the call's new input, so the history stays a token history an engine can
  prefill (vLLM virtual time) and the same call gets the same ids every run.
* A rejected call (longer than a whole KV pool) is not recorded: its id goes
  to ``rejected`` and the session ends there (the agent cannot go on).
* Request ids: ``{session}#{index}`` for calls, ``n{count}:{instance}`` for
  normal requests (count in arrival order over the run).
* Event order: sessions are scheduled before normal requests, both in the
  workload's order; calls under the ``CALL`` class, normal requests under
  ``NORMAL`` (:mod:`shadowcore.engine.kinds`). Normal requests are fed one at
  a time (the heap holds only the next, queued before the current one is
  started), in arrival order and at equal arrivals in the workload's order:
  exactly the order the heap gave them when all were queued up front (no other
  event is of their class), at a heap of the cluster's size rather than the
  workload's. A port that ``feeds_normal`` gets them all up front, with these
  ids, per instance in this order, and starts each at its arrival itself (the
  simulator's cluster: an instance's arrivals touch no other instance).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Protocol

import attrs

from shadowcore.engine.kinds import CALL, NORMAL
from shadowcore.engine.records import CallRecord
from shadowcore.engine.workload import NormalRequest, SessionPlan, Workload
from shadowcore.errors import ConfigError
from shadowcore.events import EventLoop
from shadowcore.job import SessionHistory
from shadowcore.manager import ShadowManager
from shadowcore.types import CallArrival, CallPlacement
from shadowcore.workloads.prefix import PromptPrefix


@attrs.frozen
class CallOutcome:
    """How a routed call ended, as the engine saw it."""

    rejected: bool
    arrival_s: float
    first_token_s: float
    finish_s: float
    num_prompt_tokens: int
    num_cached_tokens: int


#: ``(num_tokens, token_ids or None)``: the call's streamed output, as it arrives.
OnTokens = Callable[[int, Sequence[int] | None], None]


class ServingPort(Protocol):
    """What the driver needs from the engines it drives. An implementer must
    start each request at the loop's current time on the instance named, call
    ``on_tokens`` for every output token as it is sampled and ``on_finish``
    exactly once when the call ends (or is rejected), and never reorder or
    delay router-side events."""

    def input_token_ids(self, session_id: str, call_index: int, model: str,
                        num_tokens: int) -> tuple[int, ...] | None:
        """The new input's token ids (engines that look up prefixes by token), or None (by count).
        For a compacting call ``num_tokens`` also counts the summary, which comes first."""

    def start_call(self, request_id: str, placement: CallPlacement, history: SessionHistory,
                   num_output_tokens: int, on_tokens: OnTokens,
                   on_finish: Callable[[CallOutcome], None]) -> None:
        """Start a routed call whose prompt is ``history`` on ``placement.instance_id``."""

    def start_normal(self, request_id: str, instance_id: str, num_prompt_tokens: int,
                     num_output_tokens: int, prefix: PromptPrefix | None = None) -> None:
        """Start a normal request on ``instance_id``; its outcome is the port's to keep.
        The prompt is fresh, or its leading tokens are named by ``prefix``
        (:mod:`shadowcore.workloads.prefix`: equal hashes, equal tokens). The
        driver passes ``prefix`` only when a request has one, so a port that
        never replays prefixes may leave the parameter out."""

    def settle(self) -> None:
        """After a router-side event: wake idle engines (and feed shadow work)."""

    # Optional: a port whose ``feeds_normal`` is true takes every normal request up front instead of through
    # start_normal, ``feed_normal({instance id: [(request id, NormalRequest), ...] in arrival order})``, and
    # starts each at its arrival itself (the request ids and the order are the ones start_normal would see).


@attrs.define(eq=False)
class SessionDriver:
    """Plays one workload: sessions through the manager, normal requests
    straight to their instances. ``calls`` and ``rejected`` are its record."""

    loop: EventLoop
    manager: ShadowManager
    port: ServingPort
    calls: list[CallRecord] = attrs.Factory(list)
    rejected: list[str] = attrs.Factory(list)  # request ids of rejected calls
    _num_normal: int = 0

    def schedule(self, workload: Workload, instances: Sequence[str]) -> None:
        """Put every session's first call and every normal request on the
        loop; ``instances`` are the ids normal requests may name. A request
        on another instance, or a call to a model the manager does not route
        to, is one :class:`ConfigError` before anything runs."""
        known = set(instances)
        for r in workload.normal:
            if r.instance_id not in known:
                raise ConfigError("workload.normal.instance_id", r.instance_id,
                                  f"is not a serving instance of this cluster ({', '.join(instances)})")
        models = tuple(self.manager.models)
        for s in workload.sessions:
            for i, call in enumerate(s.calls):
                if call.model not in models:
                    raise ConfigError(f"workload.sessions[{s.session_id}].calls[{i}].model", call.model,
                                      f"is not a model of this cluster ({', '.join(models)})")
        for s in workload.sessions:
            self.loop.at(s.arrival_s, CALL, lambda t, s=s: self._call(s, 0))
        normal = sorted(workload.normal, key=_arrival_s)  # stable: equal arrivals in the workload's order
        if not getattr(self.port, "feeds_normal", False):
            self._feed(normal)
            return
        by_instance: dict[str, list[tuple[str, NormalRequest]]] = {}
        for k, r in enumerate(normal, 1):  # the ids _normal gives, in the same arrival order
            by_instance.setdefault(r.instance_id, []).append((_normal_id(k, r), r))
        self._num_normal = len(normal)
        self.port.feed_normal(by_instance)

    def _feed(self, normal: list[NormalRequest]) -> None:
        """Queue ``normal``'s requests one by one: each event queues the next, then starts its own."""
        it = iter(normal)
        loop = self.loop

        def fire(t: float, r: NormalRequest) -> None:
            nxt = next(it, None)
            if nxt is not None:
                loop.at(nxt.arrival_s, NORMAL, lambda t, r=nxt: fire(t, r))
            self._normal(r)

        first = next(it, None)
        if first is not None:
            loop.at(first.arrival_s, NORMAL, lambda t, r=first: fire(t, r))

    def _normal(self, r: NormalRequest) -> None:
        self._num_normal += 1
        rid = _normal_id(self._num_normal, r)
        if r.prefix is None:
            self.port.start_normal(rid, r.instance_id, r.num_prompt_tokens, r.num_output_tokens)
        else:
            self.port.start_normal(rid, r.instance_id, r.num_prompt_tokens, r.num_output_tokens, prefix=r.prefix)

    def _call(self, s: SessionPlan, index: int) -> None:
        call = s.calls[index]
        manager = self.manager
        summary = call.compact_to_tokens or 0
        ids = self.port.input_token_ids(s.session_id, index, call.model, summary + call.num_new_tokens)
        summary_ids = None
        if ids is not None and call.compact_to_tokens is not None:  # the summary, then the new input
            summary_ids, ids = tuple(ids[:summary]), tuple(ids[summary:])
        placement = manager.on_call_arrival(CallArrival(
            s.session_id, call.model, call.num_new_tokens, self.loop.now_s,
            compact_to_tokens=call.compact_to_tokens, new_token_ids=ids, summary_token_ids=summary_ids))
        self.port.start_call(
            f"{s.session_id}#{index}", placement, manager.history(s.session_id), call.num_output_tokens,
            partial(manager.on_output_tokens, s.session_id),
            lambda out, s=s, i=index, p=placement: self._call_done(s, i, p, out),
        )
        self.port.settle()

    def _call_done(self, s: SessionPlan, index: int, placement: CallPlacement, out: CallOutcome) -> None:
        if out.rejected:
            self.rejected.append(f"{s.session_id}#{index}")
            self.manager.on_session_end(s.session_id)
            return
        self.calls.append(CallRecord(
            s.session_id, index, placement.model, placement.is_switch, out.arrival_s,
            out.first_token_s - out.arrival_s, out.finish_s - out.arrival_s, out.num_prompt_tokens,
            out.num_cached_tokens,
        ))
        if index + 1 < len(s.calls):
            self.manager.on_call_done(s.session_id)
            self.loop.at(self.loop.now_s + s.calls[index].gap_after_s, CALL, lambda t: self._call(s, index + 1))
        else:
            self.manager.on_session_end(s.session_id)
        self.port.settle()


def _arrival_s(r: NormalRequest) -> float:
    return r.arrival_s


def _normal_id(k: int, r: NormalRequest) -> str:
    """The request id of the ``k``-th normal request in arrival order (from 1), both ways of feeding them."""
    return f"n{k}:{r.instance_id}"
