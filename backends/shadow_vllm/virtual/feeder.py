"""The router side's shadow jobs as tagged shadow requests to virtual
engines (:class:`TaggedShadowFeeder`), as a gateway sends them.

Invariants: at most one live request per job; a job whose block-aligned
target, epoch, switch probability or imminence (``ShadowJob.imminent``, which
changes only where the manager tracks it) changed is sent again (the newer request
supersedes the older one); a job the router side closed, or that moved
instance, has its request aborted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from shadowcore.wire import ShadowTag, TagKind

if TYPE_CHECKING:
    from shadow_vllm.virtual.replay import VirtualScenarioRun


@attrs.define(eq=False)
class TaggedShadowFeeder:
    """The router side's jobs as tagged shadow requests (``shadowcore.wire``),
    as a gateway sends them to engines that run the shadow scheduler, but
    streamed: a job whose block-aligned target grew is sent again (the newer
    request supersedes the older one in the engine), and a job the router
    side closed (its session's call arrived on that model, or the session
    ended) has its request aborted. The prompt is the whole session history,
    so vLLM's ``num_tokens - 1`` prefix-hit limit never hides a full block."""

    #: Start an idle engine's iteration when a shadow arrives. False (default)
    #: mirrors the simulator, where a job that grows does not wake an idle
    #: instance: it is planned at the instance's next kick (a routed call's
    #: arrival or end anywhere, as ``kick_all`` does).
    wake: bool = False
    #: job key -> (instance, request id, target tokens, epoch, switch probability, imminent) of its live request
    submitted: dict[Any, tuple[str, str, int, int, float, bool]] = attrs.Factory(dict)
    num_submitted: int = 0
    num_aborted: int = 0

    def __call__(self, run: VirtualScenarioRun) -> None:
        live = {job.key: job for job in run.runtime.manager.jobs()}
        for key, (instance, rid, *_) in list(self.submitted.items()):
            job = live.get(key)
            if job is None or job.instance_id != instance:
                run.cluster.by_id[instance].abort([rid])
                del self.submitted[key]
                self.num_aborted += 1
        for key, job in live.items():
            state = (job.num_target_tokens, job.history.epoch, job.switch_probability, job.imminent)
            prev = self.submitted.get(key)
            if state[0] == 0 or (prev is not None and prev[2:] == state):
                continue
            tag = ShadowTag(TagKind.SHADOW, key.session_id, key.target_model, state[1], state[2], state[3])
            rid = f"shadow:{key.session_id}:{key.target_model}:{self.num_submitted}"
            self.num_submitted += 1
            self.submitted[key] = (job.instance_id, rid, *state)
            run.cluster.by_id[job.instance_id].add_request(rid, list(job.history.token_ids), 1,
                                                           extra_args=tag.to_extra_args(), kick=self.wake)
