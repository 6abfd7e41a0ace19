"""The wire contract between the router side (gateway) and engines that run
the shadow scheduler: how a request says what it is.

A request to a vLLM engine carries its tag in the per-request extra
arguments (``SamplingParams.extra_args`` offline, the ``vllm_xargs`` field of
the OpenAI-compatible API over HTTP). vLLM only passes flat string, integer
and float values there, so a tag is a few flat keys, all prefixed
``shadowprefill_``. A request without any such key is normal traffic.

* A **routed** call: ``shadowprefill_kind = "routed"`` and its session id.
  The engine hook treats it as a routed call in Algorithm 1 (routed-step
  protection) and its prompt becomes the session context.
* A **shadow** request: ``shadowprefill_kind = "shadow"``, the session id,
  the target model (the engine's own model), the session epoch and the switch
  probability. Its prompt is the session context so far; it is prefill-only
  (one output token at most) and the engine runs it only in slack. A newer
  shadow request of the same (session, target) supersedes an older one.

The engine answers a shadow request with how it ended, in the request's
``stop_reason`` (a string, returned as is by vLLM's OpenAI-compatible API):
:class:`ShadowStop`, ``shadowprefill:<end>`` optionally followed by
``held=<n>`` (the prompt tokens whose KV the engine holds for the request when
it ended, for ends that leave part of the prompt uncomputed) and a free-text
detail in parentheses.

Invariants: :meth:`ShadowTag.to_extra_args` and :func:`parse_tag` are
inverse, as are :meth:`ShadowStop.to_stop_reason` and :func:`parse_stop`;
malformed tags raise one ``ValueError`` naming the key and value.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from typing import Any

import attrs

from shadowcore._validators import non_empty_str, non_negative_int, probability

PREFIX = "shadowprefill_"
KIND_KEY = PREFIX + "kind"
SESSION_KEY = PREFIX + "session"
TARGET_KEY = PREFIX + "target_model"
EPOCH_KEY = PREFIX + "epoch"
PROBABILITY_KEY = PREFIX + "switch_probability"
IMMINENT_KEY = PREFIX + "imminent"


STOP_PREFIX = "shadowprefill:"
HELD_KEY = "held="


class TagKind(enum.Enum):
    ROUTED = "routed"
    SHADOW = "shadow"


@attrs.frozen
class ShadowTag:
    """What a request is, as the engine's scheduler reads it."""

    kind: TagKind
    session_id: str = attrs.field(validator=non_empty_str)
    target_model: str = ""  # shadow requests only
    epoch: int = attrs.field(default=0, validator=non_negative_int)
    switch_probability: float = attrs.field(default=1.0, validator=probability)
    #: The session's routed call has finished and its next call has not arrived (``ShadowJob.imminent``);
    #: sent only when true, so a tag without it reads false.
    imminent: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    def __attrs_post_init__(self) -> None:
        if self.kind is TagKind.SHADOW and not self.target_model:
            raise ValueError(f"{TARGET_KEY}: a shadow request needs its target model")

    @property
    def is_shadow(self) -> bool:
        return self.kind is TagKind.SHADOW

    def to_extra_args(self) -> dict[str, str | int | float]:
        out: dict[str, str | int | float] = {KIND_KEY: self.kind.value, SESSION_KEY: self.session_id}
        if self.kind is TagKind.SHADOW:
            out[TARGET_KEY] = self.target_model
            out[EPOCH_KEY] = self.epoch
            out[PROBABILITY_KEY] = self.switch_probability
            if self.imminent:
                out[IMMINENT_KEY] = True
        return out


def parse_tag(extra_args: Mapping[str, Any] | None) -> ShadowTag | None:
    """The tag in a request's extra arguments, or ``None`` for normal traffic."""
    if not extra_args or KIND_KEY not in extra_args:
        return None
    raw_kind = extra_args[KIND_KEY]
    try:
        kind = TagKind(raw_kind)
    except ValueError:
        known = ", ".join(k.value for k in TagKind)
        raise ValueError(f"{KIND_KEY} = {raw_kind!r}: must be one of {known}") from None
    session = extra_args.get(SESSION_KEY)
    if not isinstance(session, str) or not session:
        raise ValueError(f"{SESSION_KEY} = {session!r}: must be a non-empty string")
    if kind is TagKind.ROUTED:
        return ShadowTag(kind, session)
    target = extra_args.get(TARGET_KEY)
    if not isinstance(target, str) or not target:
        raise ValueError(f"{TARGET_KEY} = {target!r}: a shadow request needs its target model")
    epoch = _number(extra_args, EPOCH_KEY, 0)
    if epoch != int(epoch) or epoch < 0:
        raise ValueError(f"{EPOCH_KEY} = {extra_args.get(EPOCH_KEY)!r}: must be a non-negative integer")
    p = _number(extra_args, PROBABILITY_KEY, 1.0)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{PROBABILITY_KEY} = {p!r}: must be in [0, 1]")
    raw = extra_args.get(IMMINENT_KEY, False)  # a bool, or (as numbers may) a string
    imminent = raw if isinstance(raw, bool) else {"true": True, "false": False}.get(raw.lower()) \
        if isinstance(raw, str) else None
    if imminent is None:
        raise ValueError(f"{IMMINENT_KEY} = {raw!r}: must be true or false")
    return ShadowTag(kind, session, target, int(epoch), float(p), imminent)


def _number(extra_args: Mapping[str, Any], key: str, default: float) -> float:
    value = extra_args.get(key, default)
    if isinstance(value, str):  # HTTP clients may send numbers as strings
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"{key} = {value!r}: not a number") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{key} = {value!r}: not a finite number")
    return float(value)


class ShadowEnd(enum.Enum):
    """Why an engine ended a shadow request."""

    PREFILLED = "prefilled"  # every prompt token's KV is computed (or was cached)
    SUPERSEDED = "superseded"  # a newer shadow of the same (session, target) replaced it
    OVER_CAP = "exceeds-shadow-cap"  # the prompt needs more blocks than the shadow class may hold
    BELOW_N_MIN = "tail-below-n-min"  # the rest is smaller than the policy's n_min: never planned
    NO_SHADOW = "policy-runs-no-shadows"  # the engine's policy runs no shadow work
    REJECTED = "rejected"  # the request cannot be a shadow (the detail says why)
    PUSHED = "pushed"  # P/D decode engine: the push offer's handle was read (NixlConnector: one read per handle)


@attrs.frozen
class ShadowStop:
    """How a shadow request ended; ``num_held_tokens`` (when known) is the
    prompt prefix whose KV the engine held for it at the end."""

    end: ShadowEnd
    num_held_tokens: int | None = attrs.field(default=None, validator=attrs.validators.optional(non_negative_int))
    detail: str = ""

    def to_stop_reason(self) -> str:
        out = STOP_PREFIX + self.end.value
        if self.num_held_tokens is not None:
            out += f" {HELD_KEY}{self.num_held_tokens}"
        if self.detail:
            out += f" ({self.detail})"
        return out


def parse_stop(stop_reason: object) -> ShadowStop | None:
    """The :class:`ShadowStop` in a ``stop_reason``, or ``None`` when it is not
    one (a token id, ``None``, another string)."""
    if not isinstance(stop_reason, str) or not stop_reason.startswith(STOP_PREFIX):
        return None
    head, _, detail = stop_reason[len(STOP_PREFIX):].partition(" (")
    if detail and not detail.endswith(")"):
        raise ValueError(f"stop_reason = {stop_reason!r}: unterminated detail")
    name, _, held = head.partition(" ")
    try:
        end = ShadowEnd(name)
    except ValueError:
        known = ", ".join(e.value for e in ShadowEnd)
        raise ValueError(f"stop_reason = {stop_reason!r}: unknown end {name!r} (one of {known})") from None
    num_held = None
    if held:
        if not held.startswith(HELD_KEY) or not held[len(HELD_KEY):].isdigit():
            raise ValueError(f"stop_reason = {stop_reason!r}: expected {HELD_KEY}<non-negative integer>")
        num_held = int(held[len(HELD_KEY):])
    return ShadowStop(end, num_held, detail[:-1])


#: ``kv_transfer_params`` of a request to a P/D prefill (P) engine: vLLM's
#: disaggregation protocol, "compute the prompt and keep its KV for a remote
#: decode". The one definition both the gateway (a call's P phase) and the
#: P-role shadow scheduler (a shadow's KV kept for D) send; callers copy it
#: (``dict(PREFILL_KV_PARAMS)``) before handing it to vLLM, which mutates it.
PREFILL_KV_PARAMS: Mapping[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
    "remote_host": None, "remote_port": None,
}
