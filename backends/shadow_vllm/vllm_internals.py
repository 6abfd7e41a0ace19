"""The vLLM internals this backend touches: the one list.

vLLM v1 has no plugin interface for a scheduler or its block pool, so the
backend subclasses ``Scheduler`` / ``AsyncScheduler`` and hooks
``BlockPool`` / ``FreeKVCacheBlockQueue``, calling and overriding pieces that
are not public. Every such name lives here, so that a vLLM upgrade is checked
in one place:

* the ``vllm.v1`` (and connector) names the backend imports are imported here
  and nowhere else (:mod:`shadow_vllm.scheduler` at import time; the
  virtual-time mode and the fake transfer worker lazily, through
  :func:`offloading`);
* :data:`METHODS` lists the methods the backend calls or overrides, by class;
  :data:`SCHEDULER_ATTRIBUTES` the scheduler's instance attributes it reads or
  changes; :data:`BLOCK_ATTRIBUTES` what it reads of pool, queue and blocks.

:func:`check` verifies :data:`METHODS` against the installed vLLM and
:func:`check_scheduler` the instance attributes of a built scheduler, each
raising one ``ImportError`` that names every missing piece and the vLLM
version (run when :mod:`shadow_vllm.scheduler` is imported and when a shadow
scheduler is built; ``tests/vllm/test_vllm_internals.py``).

Tested against vLLM 0.32 (CPU build).
"""

from __future__ import annotations

from typing import Any

import vllm
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import (
    FreeKVCacheBlockQueue,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreEventType, EngineCoreOutput, EngineCoreOutputs
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

#: Methods the backend calls or overrides (private ones included), by class.
METHODS: dict[type, tuple[str, ...]] = {
    Scheduler: (
        "schedule", "update_from_output", "add_request", "get_num_unfinished_requests",
        "_free_request", "_free_request_blocks", "_update_request_with_output", "_build_kv_connector_meta",
        "_preempt_request", "_update_after_schedule", "_make_cached_request_data", "_get_new_block_ids_to_zero",
        "_update_waiting_for_remote_kv", "finish_requests", "_free_blocks",
    ),
    KVCacheManager: ("get_blocks", "get_computed_blocks", "allocate_slots", "prefix_cache_lookup_enabled"),
    BlockPool: ("get_new_blocks", "touch", "_maybe_evict_cached_block", "reset_prefix_cache", "get_num_free_blocks"),
    FreeKVCacheBlockQueue: ("popleft", "popleft_n", "remove", "append", "append_n", "prepend_n",
                            "get_all_free_blocks"),
}
#: Instance attributes of a scheduler the backend reads or changes.
SCHEDULER_ATTRIBUTES = (
    "waiting", "running", "requests", "kv_holding_waiting", "deferred_waiting", "connector", "kv_cache_manager",
    "finished_recving_kv_req_ids", "failed_recving_kv_req_ids",
    "max_num_running_reqs", "max_num_scheduled_tokens", "cache_config", "scheduler_config", "block_size",
)
#: What the KV bridge reads of the pool (``num_gpu_blocks``, ``blocks``, ``free_block_queue``), the queue
#: (``num_free_blocks``, ``fake_free_list_head`` / ``_tail``) and a block (``block_id``, ``block_hash``,
#: ``ref_cnt``, ``next_free_block``); checked on a built scheduler's pool.
BLOCK_ATTRIBUTES = {
    "pool": ("num_gpu_blocks", "blocks", "free_block_queue"),
    "queue": ("num_free_blocks", "fake_free_list_head", "fake_free_list_tail"),
    "block": ("block_id", "block_hash", "ref_cnt", "next_free_block"),
}


def _raise(missing: list[str]) -> None:
    if missing:
        raise ImportError(f"shadow_vllm needs vLLM internals that vLLM {vllm.__version__} lacks: "
                          f"{', '.join(missing)} (the list: shadow_vllm/vllm_internals.py)")


def check(methods: dict[type, tuple[str, ...]] = METHODS) -> None:
    """Every method of ``methods`` exists on its class in the installed vLLM."""
    _raise([f"{cls.__name__}.{name}" for cls, names in methods.items() for name in names if not hasattr(cls, name)])


def check_scheduler(scheduler: Any) -> None:
    """A built scheduler has the instance attributes the backend uses (its pool and queue too)."""
    missing = [f"Scheduler.{n}" for n in SCHEDULER_ATTRIBUTES if not hasattr(scheduler, n)]
    pool = getattr(getattr(scheduler, "kv_cache_manager", None), "block_pool", None)
    if pool is None:
        missing.append("KVCacheManager.block_pool")
    else:
        queue = getattr(pool, "free_block_queue", None)
        block = pool.blocks[0] if getattr(pool, "blocks", None) else None
        for kind, obj in (("pool", pool), ("queue", queue), ("block", block)):
            missing += [f"{kind}.{n}" for n in BLOCK_ATTRIBUTES[kind] if not hasattr(obj, n)]
    _raise(missing)


#: KV connectors whose worker tells the producer after each read that the handle's blocks may go
#: (``NixlConnector``: P frees a finished request's blocks once D read them), by class name.
RELEASE_ON_READ_CONNECTORS = ("NixlConnector", "NixlPullConnector")


def releases_on_read(connector: Any) -> bool:
    """Whether one read of a P/D handle through ``connector`` spends it (see
    :data:`RELEASE_ON_READ_CONNECTORS`; the MRO is read, so subclasses count)."""
    return any(cls.__name__ in RELEASE_ON_READ_CONNECTORS for cls in type(connector).__mro__)


def offloading() -> tuple[type, type]:
    """vLLM's ``OffloadingConnector`` and ``OffloadingWorkerMetadata`` (imported on first use: the
    connector package is large and only the host tier's virtual-time mode needs it)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    return OffloadingConnector, OffloadingWorkerMetadata


__all__ = [
    "BLOCK_ATTRIBUTES",
    "EMPTY_MODEL_RUNNER_OUTPUT",
    "METHODS",
    "SCHEDULER_ATTRIBUTES",
    "AsyncScheduler",
    "BlockPool",
    "EngineCoreEventType",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "FreeKVCacheBlockQueue",
    "FullAttentionSpec",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheManager",
    "KVConnectorOutput",
    "ModelRunnerOutput",
    "NewRequestData",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerOutput",
    "StructuredOutputManager",
    "check",
    "check_scheduler",
    "get_request_block_hasher",
    "init_none_hash",
    "offloading",
    "releases_on_read",
]
