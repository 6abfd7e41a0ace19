"""[1]-[2] Router side and shadow manager.

The :class:`ShadowManager` sees every routed call of every session. On a
call's arrival it places the call (sticky instance of the chosen model, unless
another instance of that model would finish the uncached prefill sooner),
ends the shadow job on the chosen model (the call takes over from whatever
that job built), and creates or extends jobs on the models the targeting
strategy picks. Output tokens extend the history, and so every job, as they
are generated.

Invariants:

* A switch call never waits for its shadow: placement reads only what is
  cached now; the job on the chosen model is closed at arrival, so no shadow
  chunk for it is planned afterwards.
* Jobs are handed to an instance in non-increasing switch probability (ties:
  older job first), and only jobs with missing tokens are handed out.
* Flat cost: ``pending_jobs`` looks only at the instance's *active* jobs, a
  superset of its jobs with missing tokens kept per instance: a job enters it
  when it opens, when its session's history grows or starts a new epoch (the
  manager's ``on_*`` methods, the only writers of a history), and when a
  refresh lowers its held prefix (the job tells the manager); it leaves it
  when ``pending_jobs`` finds it complete (nothing missing, nothing in
  flight), from where only those events can make tokens go missing again.
  Idle sessions whose jobs are complete cost nothing per call.
* Per session, at most one job per target model; a job lives on one instance.
* With ``track_imminence`` (set when the policy's controller reads it), a
  session's jobs are ``imminent`` exactly between the end of a routed call
  (:meth:`ShadowManager.on_call_done`) and the arrival of its next call;
  without it no job is ever imminent.
* The manager owns its sessions: drivers read them through :meth:`ShadowManager.session`
  (a frozen :class:`SessionInfo`) and :meth:`ShadowManager.history`, never by
  reaching into its state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Protocol, runtime_checkable

import attrs

from shadowcore.job import SessionHistory, ShadowJob
from shadowcore.switch import SwitchPredictor, Targeting, rank_targets
from shadowcore.types import CallArrival, CallPlacement, JobKey


def _no_tokens(instance_id: str) -> int:
    return 0


def _priority(job: ShadowJob) -> tuple[float, int]:
    """``pending_jobs``' order: highest switch probability first, then creation order."""
    return -job.switch_probability, job.sequence


@runtime_checkable
class ClusterPort(Protocol):
    """What a backend tells the router side about its instances."""

    def instances(self, model: str) -> Sequence[str]:
        """Instance ids serving ``model`` for routed calls, in a fixed order."""
        ...

    def block_size(self, instance_id: str) -> int:
        ...

    def cached_prefix_tokens(self, instance_id: str, history: SessionHistory) -> int:
        """Tokens of ``history`` cached on the instance now (device or host)."""
        ...

    def estimated_prefill_completion_s(self, instance_id: str, num_uncached_tokens: int) -> float:
        """When a prefill of ``num_uncached_tokens`` would finish if sent now
        (queued work ahead of it included)."""
        ...


class PlacementFloorPort(Protocol):
    """What a :class:`ClusterPort` may add so that placement reads fewer estimates (the simulator's
    cluster does: an exact estimate there may have to bring an instance up to date first)."""

    def prefill_completion_floor_s(self, instance_id: str, num_uncached_tokens: int) -> float:
        """A value that :meth:`ClusterPort.estimated_prefill_completion_s` with these arguments is not below
        now, whatever work is queued on the instance (``-inf`` when nothing better is known). Placement (a
        call's, and a new shadow job's least-loaded choice with ``num_uncached_tokens`` 0) skips an instance
        whose floor is not below the best estimate so far, so a floor above the estimate would place calls
        and jobs elsewhere: an implementer must guarantee the bound."""
        ...


@attrs.define(eq=False)
class SessionState:
    session_id: str
    task: str
    history: SessionHistory
    current_model: str | None = None
    sticky: dict[str, str] = attrs.Factory(dict)  # model -> instance id
    num_calls: int = 0
    jobs: dict[str, ShadowJob] = attrs.Factory(dict)  # target model -> open job


@attrs.frozen
class SessionInfo:
    """What a driver may read of one session: a snapshot, except ``history``,
    which is the live history the session's jobs share (read it, never append:
    the manager's ``on_*`` methods are the only writers)."""

    session_id: str
    task: str
    current_model: str | None
    sticky: Mapping[str, str]  # model -> instance id
    num_calls: int
    history: SessionHistory


@attrs.define(eq=False)
class ShadowManager:
    """Router-side owner of sessions and shadow jobs (one per deployment)."""

    cluster: ClusterPort
    models: tuple[str, ...] = attrs.field(converter=tuple)
    predictor: SwitchPredictor
    targeting: Targeting
    shadow_instances: dict[str, str] = attrs.Factory(dict)  # model -> dedicated instance
    oracle: bool = False
    #: Told the instance id whenever one of its jobs may have gained missing tokens (opened, its history
    #: grew or changed epoch, its held prefix was lowered): an engine that defers work until observed
    #: (``EngineCluster.watch_jobs``) must see that before its next iteration starts.
    on_job_active: Callable[[str], None] | None = None
    #: Mark a session's jobs ``imminent`` during its tool gaps (:meth:`on_call_done`); off: never.
    track_imminence: bool = False
    _sessions: dict[str, SessionState] = attrs.field(init=False, factory=dict)
    _jobs: dict[JobKey, ShadowJob] = attrs.field(init=False, factory=dict)
    _by_instance: dict[str, dict[JobKey, ShadowJob]] = attrs.field(init=False, factory=dict)
    #: instance -> sequence -> job: every job of the instance with missing tokens, and maybe some complete ones
    _active: dict[str, dict[int, ShadowJob]] = attrs.field(init=False, factory=dict)
    _next_sequence: int = attrs.field(init=False, default=0)

    # -- router side ---------------------------------------------------------------
    def on_call_arrival(self, call: CallArrival) -> CallPlacement:
        if call.model not in self.models:
            raise ValueError(f"call for session {call.session_id}: unknown model {call.model!r}")
        s = self._session(call)
        if call.compact_to_tokens is not None:
            s.history.compact(call.compact_to_tokens, call.summary_token_ids)
        previous = s.current_model
        if previous is not None:
            self.predictor.observe_transition(s.session_id, s.task, previous, call.model)
        num_context = s.history.num_tokens
        s.history.append(call.num_new_input_tokens, call.new_token_ids)
        self._touch(s)
        is_switch = previous is not None and previous != call.model
        self._close(JobKey(s.session_id, call.model))
        for job in s.jobs.values():  # the gap is over: the call is here
            job.imminent = False
        instance = self._place(s, call.model)
        s.current_model = call.model
        s.num_calls += 1
        self._retarget(s)
        cached = self.cluster.cached_prefix_tokens(instance, s.history)
        oracle = num_context if (self.oracle and is_switch) else 0
        return CallPlacement(
            s.session_id, call.model, instance, is_switch, s.history.num_tokens,
            max(cached, oracle), oracle,
        )

    def placement(self, session_id: str, model: str) -> str:
        """The instance a call of the session on ``model`` would be placed on
        now, by the rule :meth:`on_call_arrival` applies to a call whose new
        input is not counted yet (``num_new_input_tokens`` 0); reads only. A
        backend that registers a call only once its engine accepted it (the
        gateway) sends the call here first."""
        if model not in self.models:
            raise ValueError(f"call for session {session_id}: unknown model {model!r}")
        s = self._sessions.get(session_id)
        if s is None:
            return self._best_instance(None, SessionHistory(session_id), model)
        return self._best_instance(s.sticky.get(model), s.history, model)

    def on_output_tokens(self, session_id: str, num_tokens: int, token_ids: Sequence[int] | None = None) -> None:
        """Streamed output of the session's current call extends every job."""
        s = self._known(session_id)
        s.history.append(num_tokens, token_ids)
        self._touch(s)

    def on_call_done(self, session_id: str) -> None:
        """The session's routed call finished and another will follow (its
        tool gap starts): with ``track_imminence`` its jobs are ``imminent``
        until the next call arrives (jobs opened then start not imminent)."""
        s = self._known(session_id)
        if self.track_imminence:
            for job in s.jobs.values():
                job.imminent = True

    def on_tool_result(self, session_id: str, num_tokens: int, token_ids: Sequence[int] | None = None) -> None:
        """Tokens appended between calls (a tool result known before the next call)."""
        s = self._known(session_id)
        s.history.append(num_tokens, token_ids)
        self._touch(s)

    def on_new_epoch(self, session_id: str, num_tokens: int, token_ids: Sequence[int] | None = None) -> None:
        """The session's context no longer extends its history (an edited
        conversation, a re-tokenised turn): the history starts a new epoch of
        ``num_tokens`` tokens and every job restarts from nothing."""
        s = self._known(session_id)
        s.history.compact(num_tokens, token_ids)
        self._touch(s)

    def on_session_end(self, session_id: str) -> None:
        """Close the session's jobs, drop the session and tell the predictor
        (:meth:`~shadowcore.switch.SwitchPredictor.observe_session_end`); an
        unknown id is a no-op."""
        s = self._sessions.pop(session_id, None)
        if s is None:
            return
        for model in self.models:
            self._close(JobKey(session_id, model))
        self.predictor.observe_session_end(session_id, s.task)

    # -- reading sessions -----------------------------------------------------------
    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    def session_ids(self) -> Iterator[str]:
        return iter(self._sessions)

    def session(self, session_id: str) -> SessionInfo | None:
        """The session as it stands now, or ``None`` when the manager has none by that id."""
        s = self._sessions.get(session_id)
        if s is None:
            return None
        return SessionInfo(s.session_id, s.task, s.current_model, MappingProxyType(dict(s.sticky)), s.num_calls,
                           s.history)

    def history(self, session_id: str) -> SessionHistory:
        """The session's live history (read only); ``KeyError`` naming the id when unknown."""
        return self._known(session_id).history

    # -- engine side ----------------------------------------------------------------
    def pending_jobs(self, instance_id: str) -> list[ShadowJob]:
        """Jobs on the instance with tokens missing, highest switch probability first."""
        active = self._active.get(instance_id)
        if not active:
            return []
        jobs, complete = [], []
        for sequence, j in active.items():
            if j.num_missing_tokens > 0:
                jobs.append(j)
            elif not j.num_inflight_tokens:
                complete.append(sequence)
        for sequence in complete:
            del active[sequence]
        if len(jobs) > 1:
            jobs.sort(key=_priority)
        return jobs

    def num_active_jobs(self, instance_id: str) -> int:
        """Jobs ``pending_jobs`` looks at on the instance (its per-call work): at
        least the pending ones, at most the instance's open jobs."""
        return len(self._active.get(instance_id, ()))

    def job(self, key: JobKey) -> ShadowJob | None:
        return self._jobs.get(key)

    def jobs(self) -> Iterator[ShadowJob]:
        return iter(self._jobs.values())

    # -- internals ------------------------------------------------------------------
    def _known(self, session_id: str) -> SessionState:
        s = self._sessions.get(session_id)
        if s is None:
            raise KeyError(f"no session {session_id!r} in the shadow manager")
        return s

    def _session(self, call: CallArrival) -> SessionState:
        s = self._sessions.get(call.session_id)
        if s is None:
            s = SessionState(call.session_id, call.task, SessionHistory(call.session_id))
            self._sessions[call.session_id] = s
        return s

    def _touch(self, s: SessionState) -> None:
        """The session's history grew or changed epoch: its jobs may miss tokens."""
        for job in s.jobs.values():
            self._activate(job)

    def _reopened(self, job: ShadowJob) -> None:
        """A job's held prefix was lowered (a refresh): it may miss tokens."""
        if self._jobs.get(job.key) is job:
            self._activate(job)

    def _activate(self, job: ShadowJob) -> None:
        """The job may miss tokens: ``pending_jobs`` of its instance looks at it (the one writer of ``_active``).
        ``on_job_active`` hears of it first, while ``pending_jobs`` still answers as before: an engine that
        defers work until observed applies what came before with the jobs as they were then."""
        if self.on_job_active is not None:
            self.on_job_active(job.instance_id)
        self._active.setdefault(job.instance_id, {})[job.sequence] = job

    def _place(self, s: SessionState, model: str) -> str:
        s.sticky[model] = self._best_instance(s.sticky.get(model), s.history, model)
        return s.sticky[model]

    def _best_instance(self, sticky: str | None, history: SessionHistory, model: str) -> str:
        """Sticky instance unless another finishes the uncached prefill sooner."""
        candidates = self._candidates(model)
        order = ([sticky] if sticky in candidates else []) + [c for c in candidates if c != sticky]
        return self._fastest(order, lambda inst: history.num_tokens - self.cluster.cached_prefix_tokens(inst, history))

    def _fastest(self, order: list[str], uncached_of: Callable[[str], int]) -> str:
        """The first instance in ``order`` whose estimate for its uncached tokens (``uncached_of``) is the
        smallest (strictly smaller than every earlier one's). A candidate whose
        ``prefill_completion_floor_s`` (:class:`PlacementFloorPort`, where the cluster has it) is not below
        the best estimate so far is not read: it could neither win nor tie, so the answer is the full scan's."""
        best, best_s = None, float("inf")
        floor = getattr(self.cluster, "prefill_completion_floor_s", None)  # PlacementFloorPort
        for inst in order:
            uncached = uncached_of(inst)
            if floor is not None and best is not None and floor(inst, uncached) >= best_s:
                continue  # its estimate is at least the floor: it would not win (nor a tie)
            t = self.cluster.estimated_prefill_completion_s(inst, uncached)
            if t < best_s:  # strict: the earlier instance (the sticky one first) wins ties
                best, best_s = inst, t
        assert best is not None
        return best

    def _shadow_instance(self, s: SessionState, model: str) -> str:
        dedicated = self.shadow_instances.get(model)
        if dedicated is not None:
            return dedicated
        if model not in s.sticky:
            s.sticky[model] = self._least_loaded(model)
        return s.sticky[model]

    def _least_loaded(self, model: str) -> str:
        """The instance of ``model`` whose queued prefill work finishes first (ties: the earlier in cluster
        order). An instance whose floor (its estimate with no work queued) is not below the best estimate so
        far is not read (:meth:`_fastest`): once one with nothing queued is found, the instances after it
        that share its latency model are not read (a deferred one is not brought up to now)."""
        return self._fastest(self._candidates(model), _no_tokens)

    def _candidates(self, model: str) -> list[str]:
        candidates = list(self.cluster.instances(model))
        if not candidates:
            raise ValueError(f"no instance serves model {model!r}")
        return candidates

    def _retarget(self, s: SessionState) -> None:
        assert s.current_model is not None
        p = self.predictor.switch_probability(s.session_id, s.task, s.current_model)
        dist = self.predictor.next_model_distribution(s.session_id, s.task, s.current_model, self.models)
        chosen = {t.model: t for t in self.targeting.choose(rank_targets(p, dist))}
        for model in self.models:
            key = JobKey(s.session_id, model)
            if model == s.current_model or model not in chosen:
                self._close(key)
                continue
            job = self._jobs.get(key)
            if job is None:
                job = self._open(key, s, self._shadow_instance(s, model))
            job.switch_probability = chosen[model].switch_probability

    def _open(self, key: JobKey, s: SessionState, instance_id: str) -> ShadowJob:
        job = ShadowJob(
            key, instance_id, s.history, self.cluster.block_size(instance_id),
            sequence=self._next_sequence, epoch=s.history.epoch, on_held_lowered=self._reopened,
        )
        self._next_sequence += 1
        self._jobs[key] = job
        self._by_instance.setdefault(instance_id, {})[key] = job
        s.jobs[key.target_model] = job
        self._activate(job)
        return job

    def _close(self, key: JobKey) -> None:
        job = self._jobs.pop(key, None)
        if job is not None:
            del self._by_instance[job.instance_id][key]
            self._active[job.instance_id].pop(job.sequence, None)
            s = self._sessions.get(key.session_id)
            if s is not None:
                s.jobs.pop(key.target_model, None)
