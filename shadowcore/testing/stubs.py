"""Plain stand-ins for the two ports an :class:`~shadowcore.hook.EngineHook`
talks to, for tests that drive a hook without an engine: the state machines
(:mod:`shadowcore.testing.machines`), the conformance check's probes
(:mod:`shadowcore.testing.conformance`) and example-based tests.

Needs only the core (no hypothesis).

Invariants: :class:`StubJobSource` hands out jobs with missing tokens only, in
non-increasing switch probability (ties: lower ``sequence`` first), as the
:class:`~shadowcore.manager.ShadowManager` does; :class:`StubEnginePort`
reports a cached prefix only for the epoch it was computed in, and changes its
eviction counter on every eviction.
"""

from __future__ import annotations

import attrs

from shadowcore.job import SessionHistory, ShadowJob
from shadowcore.types import JobKey


class StubEnginePort:
    """An :class:`~shadowcore.hook.EnginePort` with a settable cache: per session,
    the epoch and number of tokens the instance holds, plus an eviction counter."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.evictions = 0
        self.cached: dict[str, tuple[int, int]] = {}

    def cached_prefix_tokens(self, history: SessionHistory) -> int:
        epoch, n = self.cached.get(history.session_id, (history.epoch, 0))
        return min(n, history.num_tokens) if epoch == history.epoch else 0

    def eviction_count(self) -> int:
        return self.evictions

    def evict(self, session_id: str, keep_tokens: int) -> None:
        epoch, n = self.cached.get(session_id, (0, 0))
        self.cached[session_id] = (epoch, min(n, keep_tokens))
        self.evictions += 1

    def computed(self, history: SessionHistory, epoch: int, start: int, num_tokens: int) -> None:
        """An engine computed ``[start, start + num_tokens)`` of ``history``; it
        caches the whole blocks of it."""
        if num_tokens <= 0 or epoch != history.epoch:
            return
        e, n = self.cached.get(history.session_id, (epoch, 0))
        if e != epoch:
            n = 0
        end = start + num_tokens
        end -= end % self.block_size
        if start <= n:
            self.cached[history.session_id] = (epoch, max(n, end))


@attrs.frozen
class ServedJob:
    """A job as the job source handed it to the hook (before planning)."""

    key: JobKey
    switch_probability: float
    epoch: int
    next_token: int
    num_missing_tokens: int
    imminent: bool = False  #: the job's ``imminent`` when served (an ``imminent_first`` order reads it)


class StubJobSource:
    """The part of :class:`~shadowcore.manager.ShadowManager` a hook uses:
    ``pending_jobs`` (jobs with missing tokens, highest switch probability
    first, ties by creation order) and ``job``. Records what it served last."""

    def __init__(self) -> None:
        self._jobs: dict[JobKey, ShadowJob] = {}
        self.served: list[ServedJob] | None = None

    def add(self, job: ShadowJob) -> None:
        self._jobs[job.key] = job

    def remove(self, key: JobKey) -> None:
        self._jobs.pop(key, None)

    def all(self) -> list[ShadowJob]:
        return list(self._jobs.values())

    def pending_jobs(self, instance_id: str) -> list[ShadowJob]:
        jobs = [j for j in self._jobs.values() if j.instance_id == instance_id and j.num_missing_tokens > 0]
        jobs.sort(key=lambda j: (-j.switch_probability, j.sequence))
        self.served = [
            ServedJob(j.key, j.switch_probability, j.epoch, j.next_token, j.num_missing_tokens, j.imminent) for j in jobs
        ]
        return jobs

    def job(self, key: JobKey) -> ShadowJob | None:
        return self._jobs.get(key)

__all__ = ["ServedJob", "StubEnginePort", "StubJobSource"]
