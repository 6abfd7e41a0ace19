"""Request-level shadow prefill (the paper's prototype, Appendix D.1): the
baseline for stock vLLM engines, and the gateway's fallback when an instance
does not run the shadow scheduler. Router side: no engine import.

After a routed call completes, its prompt and response go to the other
models' instances as lowest-priority requests with one output token (the
destination computes its own KV; vLLM's prefix cache keeps it). The engines
need ``--scheduling-policy priority`` or the priority is silently ignored.

:class:`RequestLevelShadower` is a small state machine with no I/O of its
own. The caller plugs in how a shadow is submitted (``submit``: an
in-process engine, a virtual-time vLLM engine
(:func:`shadow_vllm.backend.virtual_submitter`) or an HTTP client; :func:`completions_body` builds the OpenAI-compatible request) and how
long a destination's waiting queue is (``num_waiting``; over HTTP
:func:`parse_num_waiting` reads vLLM's ``/metrics``), and reports each
shadow's end with :meth:`RequestLevelShadower.on_shadow_finished`.

Invariants (``tests/vllm/test_request_level*.py``):

* At most one shadow in flight per destination instance.
* A shadow is admitted only when the destination's waiting queue is empty
  (``num_waiting(instance) == 0`` at :meth:`pump` time).
* A newer completed call of a session supersedes that session's pending (not
  yet submitted) shadow on the same instance; a routed call of the session
  arriving at the instance drops its pending shadow (the call computes the
  context itself). Across sessions the newest pending shadow goes first.
* Shadow work never fails a routed call: a ``submit`` or ``num_waiting``
  that raises is counted (``stats.num_failed``) and the shadow dropped; no
  exception leaves this class from the routed-call path.
* Pending shadows per instance are bounded (``max_pending_per_instance``);
  the oldest is dropped first and counted (``stats.num_dropped``).
"""

from __future__ import annotations

import itertools
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from shadowcore._validators import non_empty_str, non_negative_int, positive_int
from shadowcore.wire import ShadowTag, TagKind

#: The priority a request-level shadow gets: vLLM runs lower values first, and
#: routed and normal requests use the default 0.
LOWEST_PRIORITY = 1_000_000


def _token_ids(value: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(t) for t in value)


@attrs.frozen
class Destination:
    """An instance that should hold a session's context, and its model."""

    instance_id: str = attrs.field(validator=non_empty_str)
    model: str = attrs.field(validator=non_empty_str)


@attrs.frozen
class ShadowSubmission:
    """One request-level shadow: ``prompt_token_ids`` (the completed call's
    prompt and response) with one output token at the lowest priority."""

    submission_id: str = attrs.field(validator=non_empty_str)
    session_id: str = attrs.field(validator=non_empty_str)
    destination: Destination
    prompt_token_ids: tuple[int, ...] = attrs.field(converter=_token_ids, repr=False)
    sequence: int = attrs.field(validator=non_negative_int)  # completion order (newest is largest)
    priority: int = LOWEST_PRIORITY
    max_tokens: int = attrs.field(default=1, validator=positive_int)

    def __attrs_post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"shadow {self.submission_id}: prompt_token_ids is empty")

    @property
    def extra_args(self) -> dict[str, str | int | float]:
        """The wire tag (``shadowcore.wire``): inert on stock vLLM, a shadow
        job on an engine that runs the shadow scheduler."""
        return ShadowTag(TagKind.SHADOW, self.session_id, self.destination.model).to_extra_args()


def completions_body(submission: ShadowSubmission, served_model: str | None = None) -> dict[str, Any]:
    """The JSON body of ``POST /v1/completions`` for a shadow on vLLM's
    OpenAI-compatible server (token ids as the prompt, ``priority``,
    ``vllm_xargs`` for the tag)."""
    return {
        "model": served_model or submission.destination.model,
        "prompt": list(submission.prompt_token_ids),
        "max_tokens": submission.max_tokens,
        "priority": submission.priority,
        "temperature": 0.0,
        "vllm_xargs": submission.extra_args,
    }


_WAITING = re.compile(r"^vllm:num_requests_waiting(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.MULTILINE)


def parse_num_waiting(metrics_text: str, source: str = "/metrics") -> int:
    """``vllm:num_requests_waiting`` from a Prometheus exposition (summed over
    label sets; 0 for a declared gauge without a sample, as prometheus'
    multiprocess mode shows one never set); a missing gauge is an error naming
    ``source``."""
    values = _WAITING.findall(metrics_text)
    if not values and "# TYPE vllm:num_requests_waiting gauge" in metrics_text:
        return 0  # declared, never set (prometheus multiprocess mode before the first request): nothing waits
    if not values:
        raise ValueError(f"{source}: no vllm:num_requests_waiting gauge")
    return round(sum(float(v) for v in values))


@attrs.define
class ShadowerStats:
    num_requested: int = 0  # shadows created from completed calls
    num_submitted: int = 0
    num_completed: int = 0
    num_superseded: int = 0  # replaced by a newer call of the same session before submission
    num_dropped: int = 0  # pending bound, or the session's routed call arrived first
    num_failed: int = 0  # submit / num_waiting raised, or the engine reported a failure
    num_deferred: int = 0  # pump found the destination's waiting queue non-empty


@attrs.define(eq=False)
class RequestLevelShadower:
    """The router-side manager of request-level shadows (one per gateway)."""

    submit: Callable[[ShadowSubmission], None]
    num_waiting: Callable[[str], int]
    max_pending_per_instance: int = attrs.field(default=64, validator=positive_int)
    stats: ShadowerStats = attrs.Factory(ShadowerStats)
    errors: list[tuple[str, BaseException]] = attrs.Factory(list)
    _pending: dict[str, OrderedDict[str, ShadowSubmission]] = attrs.Factory(dict)  # instance -> session -> shadow
    _inflight: dict[str, ShadowSubmission] = attrs.Factory(dict)  # instance -> shadow
    _sequence: itertools.count = attrs.Factory(itertools.count)

    # -- router side ----------------------------------------------------------------
    def on_call_arrival(self, session_id: str, instance_id: str) -> None:
        """A routed call of ``session_id`` was placed on ``instance_id``: a
        pending shadow of that session there is no longer needed."""
        pending = self._pending.get(instance_id)
        if pending is not None and pending.pop(session_id, None) is not None:
            self.stats.num_dropped += 1

    def on_call_complete(
        self,
        session_id: str,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        destinations: Sequence[Destination],
    ) -> list[ShadowSubmission]:
        """Queue the completed call's context for each destination (the other
        models' instances) and submit what may go now; returns what was submitted."""
        context = (*prompt_token_ids, *output_token_ids)
        if not context:
            return []
        for dest in destinations:
            seq = next(self._sequence)
            shadow = ShadowSubmission(f"shadow-{session_id}-{seq}", session_id, dest, context, seq)
            self.stats.num_requested += 1
            pending = self._pending.setdefault(dest.instance_id, OrderedDict())
            if pending.pop(session_id, None) is not None:
                self.stats.num_superseded += 1
            pending[session_id] = shadow  # newest last
            while len(pending) > self.max_pending_per_instance:
                pending.popitem(last=False)
                self.stats.num_dropped += 1
        return self.pump()

    # -- engine side ----------------------------------------------------------------
    def on_shadow_finished(self, submission_id: str, ok: bool = True) -> list[ShadowSubmission]:
        """A shadow ended (its one token came back, or it failed); frees its
        instance's slot and submits the next pending shadow if allowed."""
        for instance, shadow in list(self._inflight.items()):
            if shadow.submission_id == submission_id:
                del self._inflight[instance]
                if ok:
                    self.stats.num_completed += 1
                else:
                    self.stats.num_failed += 1
                break
        return self.pump()

    def pump(self) -> list[ShadowSubmission]:
        """Submit, per instance with no shadow in flight and an empty waiting
        queue, its newest pending shadow."""
        out = []
        for instance, pending in self._pending.items():
            if not pending or instance in self._inflight:
                continue
            try:
                waiting = int(self.num_waiting(instance))
            except Exception as exc:  # noqa: BLE001 - a probe failure never reaches the routed path
                self._fail(instance, exc)
                continue
            if waiting > 0:
                self.stats.num_deferred += 1
                continue
            _, shadow = pending.popitem(last=True)
            self._inflight[instance] = shadow
            try:
                self.submit(shadow)
            except Exception as exc:  # noqa: BLE001 - a failed shadow is dropped, never raised
                self._inflight.pop(instance, None)
                self._fail(instance, exc)
                continue
            self.stats.num_submitted += 1
            out.append(shadow)
        return out

    def _fail(self, instance: str, exc: BaseException) -> None:
        self.stats.num_failed += 1
        self.errors.append((instance, exc))
        del self.errors[:-32]  # keep the latest few for diagnosis

    # -- queries --------------------------------------------------------------------
    def inflight(self, instance_id: str) -> ShadowSubmission | None:
        return self._inflight.get(instance_id)

    def pending(self, instance_id: str) -> tuple[ShadowSubmission, ...]:
        """Pending shadows of an instance, oldest first."""
        return tuple(self._pending.get(instance_id, {}).values())


__all__ = [
    "LOWEST_PRIORITY",
    "Destination",
    "RequestLevelShadower",
    "ShadowSubmission",
    "ShadowerStats",
    "completions_body",
    "parse_num_waiting",
]
