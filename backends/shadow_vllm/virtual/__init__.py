"""Virtual-time mode: vLLM's real scheduler and KV cache manager, driven one
iteration at a time with fake model outputs on a virtual clock. No model runs.

* :mod:`~shadow_vllm.virtual.clock` -- the virtual clock, event classes, fake sampler;
* :mod:`~shadow_vllm.virtual.config` -- building any vLLM v1 scheduler class from limits alone;
* :mod:`~shadow_vllm.virtual.offload` -- the host tier's worker side, fake only in its data movement;
* :mod:`~shadow_vllm.virtual.engine` -- one scheduler on the virtual timeline;
* :mod:`~shadow_vllm.virtual.cluster` -- engines by model, the router side's cluster port;
* :mod:`~shadow_vllm.virtual.replay` -- a workload through them with the core's session driver;
* :mod:`~shadow_vllm.virtual.feeder` -- router-side jobs as tagged shadow requests.

The sim-vs-vLLM agreement harness is engine-neutral: :mod:`shadowcore.testing.agreement`.
"""

from shadow_vllm.virtual.clock import ARRIVAL, STEP_END, WAKE, VirtualClock, hashed_token
from shadow_vllm.virtual.cluster import VirtualCluster
from shadow_vllm.virtual.config import (
    VirtualEngineConfig,
    block_hasher,
    build_scheduler,
    check_scheduler_cls,
    write_model_config,
)
from shadow_vllm.virtual.engine import (
    LatencyScale,
    ScheduledRequest,
    StepRecord,
    VirtualEngine,
    VirtualRequest,
    batch_shape,
)
from shadow_vllm.virtual.feeder import TaggedShadowFeeder
from shadow_vllm.virtual.offload import OffloadTransferWorker
from shadow_vllm.virtual.replay import VirtualScenarioRun, session_tokens

__all__ = [
    "ARRIVAL", "STEP_END", "WAKE", "LatencyScale", "OffloadTransferWorker", "ScheduledRequest", "StepRecord",
    "TaggedShadowFeeder", "VirtualClock", "VirtualCluster", "VirtualEngine", "VirtualEngineConfig",
    "VirtualRequest", "VirtualScenarioRun", "batch_shape", "block_hasher", "build_scheduler",
    "check_scheduler_cls", "hashed_token", "session_tokens", "write_model_config",
]
