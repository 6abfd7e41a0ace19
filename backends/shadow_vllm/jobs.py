"""The engine side of shadow jobs: one :class:`~shadowcore.job.ShadowJob` per
live shadow request, served to the core's :class:`~shadowcore.hook.EngineHook`.

The router side (the gateway, issue 6) decides which shadows to send; each
arrives as a vLLM request tagged shadow (:mod:`shadowcore.wire`) whose prompt
is the session context so far. :class:`EngineJobs` turns it into a job whose
history is that prompt (counts only: vLLM's own block hashes name the
prefix) and hands jobs to the hook exactly as
:class:`~shadowcore.manager.ShadowManager` does (``pending_jobs``, ``job``).

Invariants:

* At most one job per (session, target model): opening a newer shadow of the
  same key supersedes the older one (returned to the caller, which finishes
  its request); the job's epoch is the tag's.
* Jobs are served in non-increasing switch probability, ties by arrival
  order, and only those with tokens missing.
* Every job belongs to exactly one live request and goes away with it.
"""

from __future__ import annotations

from typing import Any

import attrs

from shadowcore.job import SessionHistory, ShadowJob
from shadowcore.types import JobKey
from shadowcore.wire import ShadowTag


@attrs.define(eq=False)
class ShadowEntry:
    """One shadow request and its job."""

    request: Any  # vllm.v1.request.Request
    tag: ShadowTag
    job: ShadowJob

    @property
    def request_id(self) -> str:
        return self.request.request_id


@attrs.define(eq=False)
class EngineJobs:
    """The hook's job source inside one vLLM engine."""

    instance_id: str
    block_size: int
    _by_key: dict[JobKey, ShadowEntry] = attrs.field(init=False, factory=dict)
    _by_request: dict[str, ShadowEntry] = attrs.field(init=False, factory=dict)
    _by_history: dict[int, ShadowEntry] = attrs.field(init=False, factory=dict)
    _next_sequence: int = attrs.field(init=False, default=0)

    def open(self, request: Any, tag: ShadowTag) -> tuple[ShadowEntry, ShadowEntry | None]:
        """A job for ``request``; also the entry it superseded, if any."""
        key = JobKey(tag.session_id, tag.target_model)
        old = self._by_key.get(key)
        if old is not None:
            self.close(old.request_id)
        history = SessionHistory(tag.session_id, epoch=tag.epoch, num_tokens=request.num_prompt_tokens)
        job = ShadowJob(
            key, self.instance_id, history, self.block_size, switch_probability=tag.switch_probability,
            sequence=self._next_sequence, epoch=tag.epoch,
        )
        self._next_sequence += 1
        entry = ShadowEntry(request, tag, job)
        self._by_key[key] = entry
        self._by_request[request.request_id] = entry
        self._by_history[id(history)] = entry
        return entry, old

    def close(self, request_id: str) -> ShadowEntry | None:
        entry = self._by_request.pop(request_id, None)
        if entry is not None:
            self._by_key.pop(entry.job.key, None)
            self._by_history.pop(id(entry.job.history), None)
        return entry

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_request

    def __len__(self) -> int:
        return len(self._by_request)

    def entries(self) -> list[ShadowEntry]:
        return list(self._by_request.values())

    def entry(self, request_id: str) -> ShadowEntry | None:
        return self._by_request.get(request_id)

    def entry_for_key(self, key: JobKey) -> ShadowEntry | None:
        return self._by_key.get(key)

    def entry_for_history(self, history: SessionHistory) -> ShadowEntry | None:
        return self._by_history.get(id(history))

    # -- the hook's job source (as ShadowManager) ----------------------------------------
    def pending_jobs(self, instance_id: str) -> list[ShadowJob]:
        jobs = [e.job for e in self._by_key.values() if e.job.num_missing_tokens > 0]
        jobs.sort(key=lambda j: (-j.switch_probability, j.sequence))
        return jobs

    def job(self, key: JobKey) -> ShadowJob | None:
        entry = self._by_key.get(key)
        return None if entry is None else entry.job
