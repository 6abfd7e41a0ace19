"""Frozen values that cross a boundary: engine -> hook (snapshots), hook ->
engine (plans), engine -> hook (outcomes), router -> manager (arrivals) and
manager -> router (placements).

Invariants: every value here is immutable and validated at construction; a
backend that builds one from its own state cannot hand the core a negative
count or a NaN time. Times are seconds on the backend's clock (virtual in the
simulator, monotonic in vLLM); the core never reads a clock itself.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Callable

import attrs

from shadowcore._validators import (
    non_empty_str,
    non_negative,
    non_negative_int,
    positive,
    positive_int,
    probability,
)
from shadowcore.errors import ConfigError
from shadowcore.latency import BatchShape, PrefillChunk


class RequestKind(enum.Enum):
    """Who a request in the batch belongs to."""

    ROUTED = "routed"  # a call of an agent session that the router placed here
    NORMAL = "normal"  # other users' traffic


class Phase(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@attrs.frozen
class RequestView:
    """One request in the batch an engine is about to run (its view for Eq. 1).

    For a prefill, ``num_scheduled_tokens`` is this iteration's chunk and
    ``num_remaining_prefill_tokens`` what is left after it. For a decode,
    ``num_scheduled_tokens`` is 1, ``first_token_s`` is set and
    ``num_decode_steps`` counts the iterations completed since the first token.
    """

    request_id: str = attrs.field(validator=non_empty_str)
    kind: RequestKind
    phase: Phase
    arrival_s: float = attrs.field(validator=non_negative)
    num_scheduled_tokens: int = attrs.field(validator=non_negative_int)
    num_context_tokens: int = attrs.field(validator=non_negative_int)
    ttft_slo_s: float = attrs.field(validator=positive)
    tpot_slo_s: float = attrs.field(validator=positive)
    num_remaining_prefill_tokens: int = attrs.field(default=0, validator=non_negative_int)
    first_token_s: float | None = None
    num_decode_steps: int = attrs.field(default=0, validator=non_negative_int)

    def __attrs_post_init__(self) -> None:
        if self.phase is Phase.DECODE and self.first_token_s is None:
            raise ValueError(f"request {self.request_id}: a decode needs first_token_s")


@attrs.frozen
class DecodeAggregate:
    """Decodes of normal requests a snapshot carries as aggregates instead of
    views (an engine's private fast path, ``shadowcore.engine._fastpath``):
    ``num_decodes`` of them, their contexts' sum and longest (0 with none),
    and ``min_slack_s(now_s, margin)``, the smallest
    :func:`shadowcore.slack.decode_slack_s` among them, exactly (``inf`` for none).
    An implementer must give bit for bit what the views would give."""

    num_decodes: int = attrs.field(validator=non_negative_int)
    total_context: int = attrs.field(validator=non_negative_int)
    max_context: int = attrs.field(validator=non_negative_int)
    min_slack_s: Callable[[float, float], float]


@attrs.frozen
class StepSnapshot:
    """What an engine shows the hook before one iteration (``begin_step``).

    ``batch`` is the normal and routed work the engine has already scheduled
    for this iteration; shadow chunks are planned on top of it and go last.
    ``num_free_token_budget`` is what remains of the iteration's token budget
    after ``batch``; ``num_shadow_room_tokens`` is what the KV class manager
    lets shadow chunks take now (cap, free and cold blocks).

    ``aggregate`` (engine-private, None in every snapshot a hook is given):
    more decodes of the same iteration, not in ``batch``, as aggregates; the
    engine's fast path asks the core's own slack controllers for a budget on
    such a snapshot. It has no ``batch_shape`` (the engine times the batch).
    """

    instance_id: str = attrs.field(validator=non_empty_str)
    iteration: int = attrs.field(validator=non_negative_int)
    now_s: float = attrs.field(validator=non_negative)
    batch: tuple[RequestView, ...] = attrs.field(converter=tuple)
    num_waiting: int = attrs.field(validator=non_negative_int)
    admission_blocked: bool
    tpot_slo_s: float = attrs.field(validator=positive)
    num_free_token_budget: int = attrs.field(validator=non_negative_int)
    num_shadow_room_tokens: int = attrs.field(validator=non_negative_int)
    aggregate: DecodeAggregate | None = None

    @property
    def is_idle(self) -> bool:
        return not self.batch and (self.aggregate is None or not self.aggregate.num_decodes)

    @property
    def has_routed(self) -> bool:  # aggregated decodes are normal requests
        return any(r.kind is RequestKind.ROUTED for r in self.batch)

    @functools.cached_property
    def batch_shape(self) -> BatchShape:
        """The batch as a latency model sees it (computed once per snapshot)."""
        if self.aggregate is not None:
            raise ValueError(f"{self.instance_id}: a snapshot with a decode aggregate has no batch shape")
        prefills = tuple(
            PrefillChunk(r.num_scheduled_tokens, r.num_context_tokens)
            for r in self.batch
            if r.phase is Phase.PREFILL and r.num_scheduled_tokens > 0
        )
        decodes = tuple(r.num_context_tokens for r in self.batch if r.phase is Phase.DECODE)
        return BatchShape(prefills, decodes)


class BudgetReason(enum.Enum):
    """Which line of Algorithm 1 set the budget."""

    WAITING = "waiting"  # line 1: waiting queue non-empty
    BLOCKED = "blocked"  # line 1: an admission was blocked by memory
    IDLE = "idle"  # line 3: shadow-only iteration, beta*T
    ROUTED_CREDIT = "routed-credit"  # line 5: a routed call is in the batch
    SLO_SLACK = "slo-slack"  # line 7: min over the batch of sigma_r
    CREDIT = "credit"  # Harvest: the credit on every busy iteration
    EAGER = "eager"  # normal-priority shadow requests, no slack control
    PREFILL_SLACK = "prefill-slack"  # P/D prefill instance (§3.5)
    DISABLED = "disabled"


@attrs.frozen
class SlackBudget:
    """The time a shadow chunk may occupy in one iteration.

    When ``bounds_stretch`` is true the budget bounds the time *added* to the
    iteration (credit cases); otherwise it bounds the whole iteration.
    ``math.inf`` means no time bound (Eager).
    """

    budget_s: float = attrs.field(validator=non_negative)
    reason: BudgetReason
    bounds_stretch: bool = False

    @classmethod
    def zero(cls, reason: BudgetReason) -> SlackBudget:
        return cls(0.0, reason)

    @property
    def is_unbounded(self) -> bool:
        return math.isinf(self.budget_s)


@attrs.frozen
class JobKey:
    """Identity of a shadow job: one per (session, target model)."""

    session_id: str = attrs.field(validator=non_empty_str)
    target_model: str = attrs.field(validator=non_empty_str)


@attrs.frozen
class ShadowGrant:
    """One shadow chunk in a plan: compute tokens ``[start_token, start_token +
    num_tokens)`` of the session history (``epoch``) on this instance.
    ``switch_probability`` and ``imminent`` are the job's when granted (the
    grant order's keys, :class:`StepPlan`)."""

    job: JobKey
    epoch: int = attrs.field(validator=non_negative_int)
    start_token: int = attrs.field(validator=non_negative_int)
    num_tokens: int = attrs.field(validator=positive_int)
    switch_probability: float = attrs.field(validator=probability)
    imminent: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    @property
    def end_token(self) -> int:
        return self.start_token + self.num_tokens


@attrs.frozen
class StepPlan:
    """The hook's answer to one snapshot: shadow chunks to run, in batch order,
    after everything in the snapshot's batch.

    Grant order (``EngineHook``'s invariant): non-increasing switch
    probability; with ``imminent_first`` (the controller's option) every
    imminent grant comes before every other, each group in non-increasing
    switch probability."""

    instance_id: str
    iteration: int
    budget: SlackBudget
    grants: tuple[ShadowGrant, ...] = attrs.field(converter=tuple)
    predicted_base_s: float = attrs.field(validator=non_negative)
    predicted_s: float = attrs.field(validator=non_negative)
    normal_priority: bool = False
    #: The grants were ordered imminent jobs first (``SlackController.imminent_first``).
    imminent_first: bool = False

    @property
    def num_shadow_tokens(self) -> int:
        return sum(g.num_tokens for g in self.grants)

    @property
    def predicted_stretch_s(self) -> float:
        return self.predicted_s - self.predicted_base_s


@attrs.frozen
class ChunkResult:
    """What the engine did with one grant: tokens actually computed (0 when the
    chunk was dropped, e.g. preempted or its KV could not be allocated)."""

    grant: ShadowGrant
    num_computed_tokens: int = attrs.field(validator=non_negative_int)

    def __attrs_post_init__(self) -> None:
        if self.num_computed_tokens > self.grant.num_tokens:
            raise ValueError("a chunk cannot compute more tokens than it was granted")


@attrs.frozen
class StepOutcome:
    """What an engine reports after one iteration (``end_step``)."""

    instance_id: str = attrs.field(validator=non_empty_str)
    iteration: int = attrs.field(validator=non_negative_int)
    duration_s: float = attrs.field(validator=non_negative)
    results: tuple[ChunkResult, ...] = attrs.field(default=(), converter=tuple)

    @property
    def num_shadow_tokens(self) -> int:
        return sum(r.num_computed_tokens for r in self.results)


@attrs.frozen
class CallArrival:
    """A routed call of an agent session arrives with the router's choice.

    The call's prompt is the session history plus ``num_new_input_tokens``.
    ``new_token_ids``, when the backend has real tokens (vLLM, gateway), are
    those input tokens; the simulator leaves it ``None``.
    """

    session_id: str = attrs.field(validator=non_empty_str)
    model: str = attrs.field(validator=non_empty_str)
    num_new_input_tokens: int = attrs.field(validator=non_negative_int)
    now_s: float = attrs.field(validator=non_negative)
    task: str = ""
    new_token_ids: tuple[int, ...] | None = None
    #: When set, the session history is first replaced by a summary of this many
    #: tokens (compaction at the model's window); the call's prompt is then the
    #: summary plus its new input. Every shadow job restarts from the new epoch.
    compact_to_tokens: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(non_negative_int)
    )
    #: The summary's token ids, for a backend with real tokens: with
    #: ``new_token_ids`` and ``compact_to_tokens`` both set these must be set too
    #: (``compact_to_tokens`` of them), so the new epoch is a token history an
    #: engine can prefill and look up (vLLM virtual time, the gateway).
    summary_token_ids: tuple[int, ...] | None = None

    def __attrs_post_init__(self) -> None:
        if self.summary_token_ids is None:
            if self.compact_to_tokens is not None and self.new_token_ids is not None:
                raise ConfigError("summary_token_ids", None,
                                  "a compacting call that carries token ids needs the summary's token ids")
            return
        if self.compact_to_tokens is None:
            raise ConfigError("summary_token_ids", len(self.summary_token_ids),
                              "given without compact_to_tokens (no compaction to summarise)")
        if len(self.summary_token_ids) != self.compact_to_tokens:
            raise ConfigError("summary_token_ids", len(self.summary_token_ids),
                              f"must hold compact_to_tokens = {self.compact_to_tokens} ids")
        if self.new_token_ids is None:
            raise ConfigError("summary_token_ids", len(self.summary_token_ids),
                              "summary ids need the call's new_token_ids too (a history has ids or counts)")


@attrs.frozen
class CallPlacement:
    """Where a routed call runs and what it can expect there.

    ``num_oracle_prefix_tokens`` is non-zero only under an oracle policy: the
    backend must treat that prefix as cached on the instance for free.
    """

    session_id: str
    model: str
    instance_id: str
    is_switch: bool
    num_prompt_tokens: int = attrs.field(validator=non_negative_int)
    num_expected_cached_tokens: int = attrs.field(validator=non_negative_int)
    num_oracle_prefix_tokens: int = attrs.field(default=0, validator=non_negative_int)
