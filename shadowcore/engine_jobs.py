"""The engine side of shadow jobs: one :class:`~shadowcore.job.ShadowJob` per
live shadow request, served to the core's :class:`~shadowcore.hook.EngineHook`
(a :class:`~shadowcore.hook.JobSource`, as the router side's manager is).

For engines that receive shadow work as requests rather than from an
in-process router side (the vLLM scheduler does): the router side (the
gateway) decides which shadows to send; each arrives as an engine request
tagged shadow (:mod:`shadowcore.wire`) whose prompt is the session context so
far. :class:`EngineJobs` turns it into a job whose
history is that prompt (counts only: vLLM's own block hashes name the
prefix) and hands jobs to the hook exactly as
:class:`~shadowcore.manager.ShadowManager` does (``pending_jobs``, ``job``).

Invariants:

* At most one job per (session, target model): opening a newer shadow of the
  same key supersedes the older one (returned to the caller, which finishes
  its request); the job's epoch is the tag's.
* Jobs are served in non-increasing switch probability, ties by the order
  in which their (session, target) key first came, and only those with
  tokens missing. A key keeps its place (sequence) across the requests that
  supersede or follow each other, as the router side's job keeps its
  creation order while it lives, until a routed call of the session runs on
  this engine (the router side then closes the job: :meth:`forget_session`)
  or the key is among the oldest beyond ``max_remembered_keys``.
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

    request: Any  # the engine's request object (vLLM: vllm.v1.request.Request); has ``request_id``
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
    #: request id -> entry; read it, never change it (the scheduler's per-step "any shadow?" test)
    by_request: dict[str, ShadowEntry] = attrs.field(init=False, factory=dict)
    _by_history: dict[int, ShadowEntry] = attrs.field(init=False, factory=dict)
    _next_sequence: int = attrs.field(init=False, default=0)
    #: Keys remembered after their request finished (least recently opened first), so that the
    #: next shadow of the key keeps its place; bounded by ``max_remembered_keys``.
    _sequences: dict[JobKey, int] = attrs.field(init=False, factory=dict)
    _keys_by_session: dict[str, set[JobKey]] = attrs.field(init=False, factory=dict)
    max_remembered_keys: int = 65536

    def forget_session(self, session_id: str) -> None:
        """The session's call runs here: the router side closes its job for this
        model (a later shadow of it is a new job, ordered as one)."""
        for key in self._keys_by_session.pop(session_id, ()):
            self._sequences.pop(key, None)

    def _forget(self, key: JobKey) -> None:
        self._sequences.pop(key, None)
        keys = self._keys_by_session.get(key.session_id)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._keys_by_session[key.session_id]

    def open(self, request: Any, tag: ShadowTag) -> tuple[ShadowEntry, ShadowEntry | None]:
        """A job for ``request``; also the entry it superseded, if any."""
        key = JobKey(tag.session_id, tag.target_model)
        old = self._by_key.get(key)
        if old is not None:
            self.close(old.request_id)
        sequence = self._sequences.pop(key, None)  # the job lives on with a longer context (as the manager's)
        if sequence is None:
            sequence = self._next_sequence
            self._next_sequence += 1
        self._sequences[key] = sequence
        self._keys_by_session.setdefault(key.session_id, set()).add(key)
        while len(self._sequences) > self.max_remembered_keys:
            self._forget(next(iter(self._sequences)))
        history = SessionHistory(tag.session_id, epoch=tag.epoch, num_tokens=request.num_prompt_tokens)
        job = ShadowJob(
            key, self.instance_id, history, self.block_size, switch_probability=tag.switch_probability,
            sequence=sequence, epoch=tag.epoch, imminent=tag.imminent,
        )
        entry = ShadowEntry(request, tag, job)
        self._by_key[key] = entry
        self.by_request[request.request_id] = entry
        self._by_history[id(history)] = entry
        return entry, old

    def close(self, request_id: str) -> ShadowEntry | None:
        entry = self.by_request.pop(request_id, None)
        if entry is not None:
            self._by_key.pop(entry.job.key, None)
            self._by_history.pop(id(entry.job.history), None)
        return entry

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.by_request

    def __len__(self) -> int:
        return len(self.by_request)

    def entries(self) -> list[ShadowEntry]:
        return list(self.by_request.values())

    def entry(self, request_id: str) -> ShadowEntry | None:
        return self.by_request.get(request_id)

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
