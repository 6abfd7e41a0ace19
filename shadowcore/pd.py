"""P/D push interface (§3.5): shadow KV on disaggregated clusters.

A shadow job runs on the session's sticky *prefill* instance of the other
model (its budget comes from
:class:`~shadowcore.slack.PrefillInstanceController`: at most 0.1 s per
iteration, empty queue, background TTFT slack). The sticky *decode* instance
then pulls the shadow KV in pushes of at most ``push_tokens`` (4K) whenever
its inbound link carries no normal transfer, into free decode memory; pushed
KV is held in the decode instance's shadow class, so it is reclaimed first.

Invariants:

* No push while the inbound link carries a normal transfer.
* A push never exceeds ``push_tokens``, the decode instance's free memory, or
  what the prefill instance holds beyond what the decode instance already has;
  it is whole blocks and starts where the decode instance's copy ends.
* Candidates are served in non-increasing switch probability (ties: job key).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import attrs

from shadowcore._validators import non_negative_int, positive_int, probability
from shadowcore.types import JobKey


@attrs.frozen
class DecodeLinkView:
    """What a decode instance knows when it may pull."""

    decode_instance_id: str
    link_busy: bool  # a normal KV transfer is on the inbound link
    num_free_tokens: int = attrs.field(validator=non_negative_int)  # free decode KV, in tokens


@attrs.frozen
class PushCandidate:
    """A shadow job whose prefill instance holds more than the decode instance."""

    job: JobKey
    num_prefill_held_tokens: int = attrs.field(validator=non_negative_int)
    num_decode_held_tokens: int = attrs.field(validator=non_negative_int)
    switch_probability: float = attrs.field(validator=probability)

    @property
    def num_pushable_tokens(self) -> int:
        return max(0, self.num_prefill_held_tokens - self.num_decode_held_tokens)


@attrs.frozen
class PushGrant:
    job: JobKey
    start_token: int
    num_tokens: int


class PushPolicy(ABC):
    """Strategy: which shadow KV a decode instance pulls next."""

    @abstractmethod
    def pull(self, link: DecodeLinkView, candidates: Sequence[PushCandidate]) -> PushGrant | None:
        """The next push onto ``link``, or None."""


@attrs.frozen
class ShadowPushPolicy(PushPolicy):
    """The paper's rule: 4K-token pushes on an idle link, most likely switch first."""

    push_tokens: int = attrs.field(default=4096, validator=positive_int)
    block_size: int = attrs.field(default=16, validator=positive_int)

    def pull(self, link: DecodeLinkView, candidates: Sequence[PushCandidate]) -> PushGrant | None:
        if link.link_busy:
            return None
        ready = [c for c in candidates if c.num_pushable_tokens >= self.block_size]
        if not ready:
            return None
        best = min(ready, key=lambda c: (-c.switch_probability, c.job.session_id, c.job.target_model))
        n = min(self.push_tokens, best.num_pushable_tokens, link.num_free_tokens)
        n -= n % self.block_size
        if n <= 0:
            return None
        return PushGrant(best.job, best.num_decode_held_tokens, n)


def backing_off(pushed: tuple[int, int, float] | None, epoch: int, num_decode_held_tokens: int, now_s: float,
                cold_age_s: float) -> bool:
    """The anti-churn rule of pushes: a job whose pushed KV the decode instance no longer holds
    (``pushed`` = (epoch, pushed up to token, end of that push); D's held prefix ends below it) is
    not pushed again until ``cold_age_s`` after that push ended. D reclaims shadow blocks first, so
    under memory pressure an immediate re-push would be lost again (the cold-age rule of shadow
    allocations, applied to pushes). One rule for every engine (the simulator's fabric, vLLM's
    decode scheduler)."""
    if pushed is None or pushed[0] != epoch or num_decode_held_tokens >= pushed[1]:
        return False
    return now_s - pushed[2] < cold_age_s


@attrs.frozen
class PushDecision:
    """One question to a push policy and its answer, in engine-neutral terms (the
    agreement harness matches them across engines: :mod:`shadowcore.testing.agreement`).

    ``candidates`` are (session, target, prefill held, decode held, switch
    probability) sorted; ``grant`` is (session, target, start, tokens) or None."""

    decode_id: str
    now_s: float
    link_busy: bool
    num_free_tokens: int
    candidates: tuple[tuple[str, str, int, int, float], ...]
    grant: tuple[str, str, int, int] | None

    @property
    def inputs(self) -> tuple:
        return (self.link_busy, self.num_free_tokens, self.candidates)

    @classmethod
    def of(cls, link: DecodeLinkView, candidates: Sequence[PushCandidate], grant: PushGrant | None,
           now_s: float) -> PushDecision:
        cands = tuple(sorted((c.job.session_id, c.job.target_model, c.num_prefill_held_tokens,
                              c.num_decode_held_tokens, round(c.switch_probability, 12)) for c in candidates))
        g = None if grant is None else (grant.job.session_id, grant.job.target_model, grant.start_token,
                                        grant.num_tokens)
        return cls(link.decode_instance_id, now_s, link.link_busy, link.num_free_tokens, cands, g)
