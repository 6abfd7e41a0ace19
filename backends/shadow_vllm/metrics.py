"""Shadow counters on vLLM's own ``/metrics`` (Prometheus).

The shadow scheduler runs in vLLM's engine-core process; vLLM's ``/metrics``
is served by its API server process. :class:`EngineMetrics` keeps
``prometheus_client`` counters in the engine-core process and, once per
scheduler step, adds what changed in the scheduler's
:class:`~shadow_vllm.scheduler.ShadowStats` and KV bridge since the last
step. ``shadowprefill vllm-serve`` turns them on
(``SHADOWPREFILL_ENGINE_METRICS=1``) and points ``PROMETHEUS_MULTIPROC_DIR``
at a fresh folder unless it is set: prometheus-client's multiprocess mode,
which vLLM's ``/metrics`` reads (``get_prometheus_registry``), so counters
of the engine-core process appear there beside vLLM's own; with
The API server runs the engine core in a process of its own whatever
``VLLM_ENABLE_V1_MULTIPROCESSING`` says, so the folder is always needed. In
multiprocess mode a gauge
nobody wrote yet has no sample (vLLM's ``vllm:num_requests_waiting`` of an
engine that served nothing): readers take a declared, sample-less gauge as 0
(``shadow_gateway.request_level.parse_num_waiting``).

Counters (label ``instance``: the engine's ``--instance-id``):

* ``shadowprefill_engine_shadow_tokens_planned_total``: tokens the shadow
  plans granted;
* ``..._computed_total``: shadow tokens vLLM scheduled (computed) in a step;
* ``..._evicted_total``: tokens of shadow-class blocks evicted before use;
* ``..._used_total``: tokens of shadow-class blocks a normal or routed
  request hit (promoted: the shadow was used);
* ``shadowprefill_engine_shadow_requests_total{reason}``: shadow requests
  ended, by stop reason (``shadowcore.wire.ShadowEnd`` values, or
  ``bad-tag``).

Invariants: counters only grow, by exactly what the scheduler's own counts
grew (so ``/metrics`` equals ``shadow_stats`` up to the last step); off by
default (tests and virtual-time engines pay nothing); label values are
instance ids and fixed reason words (bounded cardinality).
"""

from __future__ import annotations

import os
from typing import Any

ENV = "SHADOWPREFILL_ENGINE_METRICS"
P = "shadowprefill_engine_shadow_"
_COUNTERS: dict[str, Any] = {}


def _counters() -> dict[str, Any]:
    """One set per process (prometheus-client's default registry refuses a name twice)."""
    if not _COUNTERS:
        from prometheus_client import Counter

        for key, text in (("planned", "Shadow tokens the shadow plans granted"),
                          ("computed", "Shadow tokens vLLM computed"),
                          ("evicted", "Tokens of shadow-class blocks evicted before use"),
                          ("used", "Tokens of shadow-class blocks a normal request hit (the shadow was used)")):
            _COUNTERS[key] = Counter(f"{P}tokens_{key}", text, ["instance"])
        _COUNTERS["requests"] = Counter(f"{P}requests", "Shadow requests ended, by stop reason",
                                        ["instance", "reason"])
    return _COUNTERS


class EngineMetrics:
    """Pushes one scheduler's shadow counts to Prometheus counters."""

    def __init__(self, instance_id: str, block_size: int) -> None:
        c = _counters()
        self.block_size = block_size
        self._tokens = {k: c[k].labels(instance_id) for k in ("planned", "computed", "evicted", "used")}
        self._requests = c["requests"]
        self._instance = instance_id
        self._last = {"planned": 0, "computed": 0, "evicted": 0, "used": 0}
        self._last_ended: dict[str, int] = {}

    @classmethod
    def from_env(cls, instance_id: str, block_size: int) -> EngineMetrics | None:
        """Counters when ``SHADOWPREFILL_ENGINE_METRICS=1`` (``vllm-serve`` sets it), else None."""
        return cls(instance_id, block_size) if os.environ.get(ENV) == "1" else None

    def sync(self, stats: Any, bridge: Any) -> None:
        """Add what grew since the last call (cheap when nothing did)."""
        from shadowcore.kv import KVClass

        now = {"planned": stats.num_planned_tokens, "computed": stats.num_shadow_tokens,
               "evicted": bridge.num_evicted_blocks[KVClass.SHADOW] * self.block_size,
               "used": bridge.num_promoted_blocks * self.block_size}
        last = self._last
        for key, value in now.items():
            if value != last[key]:
                self._tokens[key].inc(value - last[key])
                last[key] = value
        if stats.num_ended != self._last_ended:
            for reason, n in stats.num_ended.items():
                grown = n - self._last_ended.get(reason, 0)
                if grown:
                    self._requests.labels(self._instance, reason).inc(grown)
            self._last_ended = dict(stats.num_ended)


def prepare_env(env: dict[str, str]) -> None:
    """What ``vllm-serve`` sets before it starts vLLM: counters on, and a fresh
    prometheus multiprocess folder unless the user gave one (vLLM's API
    server runs the engine core in a process of its own even with
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    env.setdefault(ENV, "1")
    if "PROMETHEUS_MULTIPROC_DIR" not in env:
        import tempfile

        env["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="shadowprefill-vllm-metrics-")
