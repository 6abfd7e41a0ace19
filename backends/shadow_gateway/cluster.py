"""The gateway's view of its instances: health, load, and what each holds.

:class:`GatewayCluster` implements the core's
:class:`~shadowcore.manager.ClusterPort` from what the gateway itself saw: a
routed call that completed on an instance left its prompt and output cached
there (whole blocks); a shadow request that completed left its prompt cached.
The gateway cannot see evictions, so "cached" here is an *expectation*; the
engine's own prefix cache decides, and a routed call never depends on it.

Invariants:

* A known prefix is a reference to a session's token list and a length, never
  a copy; comparing it with a history costs nothing while the history is the
  same list (same epoch) and a prefix comparison otherwise. Histories are
  append-only lists (a new epoch is a new list), so once a history diverged
  from a known prefix at position p, or matched all of it (p = its length),
  the answer stays p however the history grows: it is remembered until the
  known prefix is replaced.
* Cached counts are whole blocks and never exceed the history.
* An unhealthy instance is never placed while a healthy one serves the model
  (its estimated completion is pushed beyond any healthy one's), and gets no
  shadow work.
* An ejected instance (outlier: a routed call that timed out or got no first
  byte within ``upstream.first_byte_bound_s``) is treated as unhealthy for
  placement and shadow work until its ejection ends, whatever ``/health``
  says; a passing health check does not end an ejection.
* P/D models: the core sees only their prefill instances
  (:meth:`GatewayCluster.instances`), so the manager's sticky instance of a
  session is its sticky P and shadow jobs go there; the sticky D of a
  (session, model) is kept here (:meth:`GatewayCluster.decode_for`), chosen
  once among the available D instances and kept while it stays available.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Sequence

import attrs

from shadow_gateway.config import GatewayConfig, InstanceConfig, InstanceRole, ModelConfig, SchedulerKind
from shadowcore.job import SessionHistory, token_array

UNHEALTHY_PENALTY_S = 1e9


def _ids(x: Sequence[int], n: int) -> array:
    """The first ``n`` ids as a history keeps them (histories are arrays; JSON gives lists)."""
    return token_array(x[:n])


def common_prefix(a: Sequence[int], a_len: int, b: Sequence[int], b_len: int) -> int:
    """Length of the common prefix of ``a[:a_len]`` and ``b[:b_len]`` (lists or arrays alike)."""
    n = min(a_len, b_len)
    if a is b:
        return n
    a, b = _ids(a, n), _ids(b, n)
    lo, hi = 0, n  # galloping would be faster; slices compare at C speed
    if a == b:
        return n
    while lo < hi:  # binary search on prefix equality
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@attrs.define(eq=False)
class KnownPrefix:
    """Tokens of one session expected cached on one instance, by source."""

    routed_ids: Sequence[int] | None = None
    routed_len: int = 0
    shadow_ids: Sequence[int] | None = None
    shadow_len: int = 0
    #: (known list, its length, other list, final common prefix) per source.
    _settled: dict[str, tuple[object, int, object, int]] = attrs.field(factory=dict, repr=False)

    def matched(self, ids: Sequence[int] | None, length: int) -> tuple[int, int]:
        """(tokens matched via routed calls, via shadows)."""
        if ids is None:
            return 0, 0
        return (self._match("routed", self.routed_ids, self.routed_len, ids, length),
                self._match("shadow", self.shadow_ids, self.shadow_len, ids, length))

    def _match(self, source: str, known: list[int] | None, known_len: int, ids: Sequence[int], length: int) -> int:
        if known is None:
            return 0
        memo = self._settled.get(source)
        if memo is not None and memo[0] is known and memo[1] == known_len and memo[2] is ids:
            return min(memo[3], length)
        p = common_prefix(known, known_len, ids, length)
        if known is not ids and (p < length or p == known_len):  # diverged, or all of the known prefix matched
            self._settled[source] = (known, known_len, ids, p)
        return p


@attrs.define(eq=False)
class InstanceState:
    config: InstanceConfig
    model: ModelConfig
    is_shadow_only: bool = False
    healthy: bool = True
    num_failures: int = 0
    num_routed_inflight: int = 0
    num_inflight_uncached_tokens: int = 0
    #: D instances: routed calls whose KV is on its way from P (sent, no output token back yet).
    num_transfers_inflight: int = 0
    shadow_blocked_until_s: float = 0.0
    ejected_until_s: float = 0.0  # time.monotonic() before which the instance is ejected (an outlier)
    known: dict[str, KnownPrefix] = attrs.Factory(dict)

    @property
    def ejected(self) -> bool:
        return self.ejected_until_s > 0.0 and time.monotonic() < self.ejected_until_s

    @property
    def available(self) -> bool:
        """Healthy and not ejected: may get new placements and shadow work."""
        return self.healthy and not self.ejected

    @property
    def id(self) -> str:
        return self.config.id

    @property
    def url(self) -> str:
        return self.config.url

    @property
    def scheduler(self) -> SchedulerKind:
        return self.config.scheduler

    @property
    def role(self) -> InstanceRole:
        return self.config.role


@attrs.define(eq=False)
class GatewayCluster:
    """ClusterPort for the ShadowManager, plus the gateway's instance state."""

    config: GatewayConfig
    unhealthy_after: int = 2
    by_id: dict[str, InstanceState] = attrs.field(init=False, factory=dict)
    _by_model: dict[str, list[str]] = attrs.field(init=False, factory=dict)
    _decode_by_model: dict[str, list[str]] = attrs.field(init=False, factory=dict)
    #: (session, model) -> the session's sticky D instance of a P/D model.
    _sticky_decode: dict[tuple[str, str], str] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        self.unhealthy_after = self.config.health.unhealthy_after
        for m in self.config.models:
            self._by_model[m.name] = [i.id for i in m.prefill_instances]
            self._decode_by_model[m.name] = [i.id for i in m.decode_instances]
            for inst in m.instances:
                self.by_id[inst.id] = InstanceState(inst, m)
            if m.shadow_instance is not None:
                self.by_id[m.shadow_instance.id] = InstanceState(m.shadow_instance, m, is_shadow_only=True)

    def shadow_instances(self) -> dict[str, str]:
        return {m.name: m.shadow_instance.id for m in self.config.models if m.shadow_instance is not None}

    # -- ClusterPort ------------------------------------------------------------------
    def instances(self, model: str) -> Sequence[str]:
        return self._by_model.get(model, [])

    def block_size(self, instance_id: str) -> int:
        return self.by_id[instance_id].model.block_size

    def cached_prefix_tokens(self, instance_id: str, history: SessionHistory) -> int:
        inst = self.by_id[instance_id]
        known = inst.known.get(history.session_id)
        if known is None or history.token_ids is None:
            return 0
        r, s = known.matched(history.token_ids, history.num_tokens)
        n = max(r, s)
        return n - n % inst.model.block_size

    def estimated_prefill_completion_s(self, instance_id: str, num_uncached_tokens: int) -> float:
        inst = self.by_id[instance_id]
        t = (inst.num_inflight_uncached_tokens + num_uncached_tokens) / inst.model.prefill_tokens_per_s
        return t + (0.0 if inst.available else UNHEALTHY_PENALTY_S)

    # -- gateway bookkeeping ---------------------------------------------------------
    def healthy_instances(self, model: str) -> list[InstanceState]:
        """Instances of the model that may take new work (healthy and not ejected)."""
        return [self.by_id[i] for i in self.instances(model) if self.by_id[i].available]

    def decode_instances(self, model: str) -> list[InstanceState]:
        """Every D instance of a P/D model (empty for a colocated model)."""
        return [self.by_id[i] for i in self._decode_by_model.get(model, [])]

    def is_pd(self, model: str) -> bool:
        return bool(self._decode_by_model.get(model))

    def decode_for(self, session_id: str | None, model: str) -> InstanceState:
        """The sticky D instance of (session, model): kept while available,
        else (first call, or it went down) the available D instance with the
        fewest routed calls in flight (the first listed on a tie; any D
        instance when none is available). ``session_id`` None: no stickiness."""
        decode = self.decode_instances(model)
        if not decode:
            raise KeyError(f"model {model!r} has no decode instances")
        key = (session_id, model) if session_id is not None else None
        held = self._sticky_decode.get(key) if key is not None else None
        if held is not None and self.by_id[held].available:
            return self.by_id[held]
        pool = [i for i in decode if i.available] or decode
        chosen = min(pool, key=lambda i: i.num_routed_inflight)
        if key is not None:
            self._sticky_decode[key] = chosen.id
        return chosen

    def eject(self, instance_id: str, for_s: float) -> bool:
        """Take the instance out of placement and shadow work for ``for_s``; True when it was not ejected."""
        inst = self.by_id[instance_id]
        was = inst.ejected
        inst.ejected_until_s = max(inst.ejected_until_s, time.monotonic() + for_s)
        return not was

    def record_routed(self, instance_id: str, session_id: str, ids: Sequence[int], num_tokens: int) -> None:
        inst = self.by_id[instance_id]
        k = inst.known.setdefault(session_id, KnownPrefix())
        k.routed_ids, k.routed_len = ids, num_tokens - num_tokens % inst.model.block_size

    def record_shadow(self, instance_id: str, session_id: str, ids: Sequence[int], num_tokens: int) -> None:
        inst = self.by_id[instance_id]
        k = inst.known.setdefault(session_id, KnownPrefix())
        k.shadow_ids, k.shadow_len = ids, num_tokens - num_tokens % inst.model.block_size

    def forget_session(self, session_id: str) -> None:
        for inst in self.by_id.values():
            inst.known.pop(session_id, None)
        for model in self._decode_by_model:
            self._sticky_decode.pop((session_id, model), None)

    def num_sticky_decode(self) -> int:
        """Sticky D entries kept (0 once every session ended)."""
        return len(self._sticky_decode)

    def mark(self, instance_id: str, ok: bool) -> bool:
        """Record a health observation; True when the instance changed state."""
        inst = self.by_id[instance_id]
        was = inst.healthy
        if ok:
            inst.num_failures = 0
            inst.healthy = True
        else:
            inst.num_failures += 1
            if inst.num_failures >= self.unhealthy_after:
                inst.healthy = False
        return was != inst.healthy
