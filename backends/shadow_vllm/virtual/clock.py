"""The virtual timeline: the clock every virtual engine and the shadow
scheduler read, the event classes on the shared loop, and the fake sampler.

Invariants: no decision depends on wall time (a scheduler that reads a clock,
such as the shadow scheduler's ``shadow_clock``, is given :class:`VirtualClock`);
a fake token is a pure function of the request and the position (never an RNG).
"""

from __future__ import annotations

import hashlib

import attrs

#: Event kinds on the shared loop: an iteration ends (and frees its slots)
#: before work arriving at the same time is added; idle engines wake last.
STEP_END, ARRIVAL, WAKE = 0, 1, 2


@attrs.define(eq=False)
class VirtualClock:
    """Seconds on the virtual timeline; call it to read the time."""

    now_s: float = 0.0

    def __call__(self) -> float:
        return self.now_s


def hashed_token(request_id: str, index: int, vocab_size: int = 1024) -> int:
    """A fake sampled token: a pure function of the request and the position."""
    digest = hashlib.blake2b(f"{request_id}\x00{index}".encode(), digest_size=8).digest()
    return 3 + int.from_bytes(digest, "little") % (vocab_size - 3)  # skip the usual special ids
