"""The vLLM backend: shadow prefill inside real vLLM v1 engines.

Public names (stable; other modules and helpers import them):

* :mod:`shadow_vllm.scheduler` -- ``ShadowSchedulerMixin``, ``ShadowScheduler``
  (vLLM's synchronous ``Scheduler``) and ``AsyncShadowScheduler``
  (``AsyncScheduler``), loaded with ``--scheduler-cls
  shadow_vllm.scheduler.ShadowScheduler``; ``CONFIG_KEY`` (the
  ``additional_config`` key they read).
* :mod:`shadow_vllm.engine_config` -- ``EngineShadowConfig`` (the JSON the
  scheduler reads) and ``engine_args`` (the ``scheduler_cls`` /
  ``additional_config`` keyword arguments for ``LLM`` or ``EngineArgs``).
* :mod:`shadow_vllm.pd` -- P/D engines: ``PrefillShadowScheduler`` /
  ``AsyncPrefillShadowScheduler`` (the policy's prefill controller on a
  ``kv_producer`` engine) and ``DecodeShadowScheduler`` /
  ``AsyncDecodeShadowScheduler`` (push offers pulled through the core's push
  policy on a ``kv_consumer`` engine); ``engine_args(..., pd={"role": ...})``
  and ``vllm-serve --pd-role`` name them.
* :mod:`shadow_vllm.kvpool` -- ``ShadowKVBridge``, the core's KV classes in
  vLLM's block pool.
* :mod:`shadow_vllm.tinymodel` -- ``build_tiny_model`` (offline test model).
* :mod:`shadow_vllm.serve` -- ``shadowprefill vllm-serve``.
* :mod:`shadow_vllm.virtual` -- virtual-time mode (P/D: :mod:`shadow_vllm.virtual.pd`,
  ``PDVirtualRun`` with ``NixlConnector``'s scheduler side and a fake link;
  :mod:`shadow_vllm.virtual.pd_compare`, the same workload on the simulator's
  ``PDRun``); :mod:`shadow_vllm.backend`
  -- ``VirtualBackend`` (the backend contract, :mod:`shadowcore.backend`, on
  vLLM in virtual time) and ``virtual_submitter`` (the request-level baseline,
  :mod:`shadow_gateway.request_level`, on virtual engines).
* :mod:`shadow_vllm.vllm_internals` -- the one list of vLLM internals the
  backend touches, and its checks.

Importing this package does not import vLLM; its modules do.
"""
