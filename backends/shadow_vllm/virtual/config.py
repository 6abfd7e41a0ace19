"""Building a vLLM v1 scheduler without a model: the limits of one virtual
instance (:class:`VirtualEngineConfig`), a weightless model config, the KV
cache config with one ``FullAttentionSpec`` group, vLLM's host tier
(``OffloadingConnector``, scheduler side) when asked for, and vLLM's own
request block hasher.

Invariants: the scheduler, its KV cache manager and its connector are built as
vLLM's engine core builds them, minus the model; vLLM is imported only when a
function here is called.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from shadowcore._validators import positive_int
from shadowcore.errors import ConfigError


@attrs.frozen
class VirtualEngineConfig:
    """The vLLM limits of one virtual instance (``max_num_batched_tokens`` is
    the token budget of an iteration, ``num_blocks`` the KV pool)."""

    block_size: int = attrs.field(default=16, validator=positive_int)
    num_blocks: int = attrs.field(default=4096, validator=positive_int)
    max_num_batched_tokens: int = attrs.field(default=2048, validator=positive_int)
    max_num_seqs: int = attrs.field(default=256, validator=positive_int)
    max_model_len: int = attrs.field(default=32768, validator=positive_int)
    scheduling_policy: str = attrs.field(default="fcfs", validator=attrs.validators.in_(("fcfs", "priority")))
    vocab_size: int = attrs.field(default=1024, validator=positive_int)
    #: ``VllmConfig.additional_config`` (the shadow scheduler reads its policy here).
    additional_config: Mapping[str, Any] = attrs.field(factory=dict, converter=dict, hash=False)
    #: Host tier: vLLM's native CPU KV offloading (``OffloadingConnector``, as ``--kv-offloading-size``
    #: sets it up) with this many bytes of host memory; None: no connector.
    kv_offloading_bytes: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(positive_int))
    #: Tokens per offloaded chunk (the connector's ``block_size`` key; a multiple of ``block_size``);
    #: None: one device block.
    kv_offloading_block_size: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(positive_int))
    #: Bandwidth of the fake transfer worker, each direction (bytes/s); None: transfers are instant.
    kv_transfer_bytes_per_s: float | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.gt(0)))

    def __attrs_post_init__(self) -> None:
        chunk = self.kv_offloading_block_size
        if chunk is not None and chunk % self.block_size:
            raise ConfigError("kv_offloading_block_size", chunk, f"must be a multiple of block_size {self.block_size}")
        if self.kv_offloading_bytes is None and (chunk is not None or self.kv_transfer_bytes_per_s is not None):
            raise ConfigError("kv_offloading_bytes", None, "the host tier's other settings need its size")


def write_model_config(directory: str, vocab_size: int = 1024, max_position_embeddings: int = 32768) -> str:
    """A 2-layer Llama ``config.json`` in ``directory`` (no weights, no tokenizer):
    enough for vLLM's ``ModelConfig`` with ``skip_tokenizer_init=True``."""
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "vocab_size": vocab_size, "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
        "tie_word_embeddings": False,
    }
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return directory


_MODEL_DIRS: dict[tuple[int, int], str] = {}


def _model_dir(vocab_size: int, max_model_len: int) -> str:
    key = (vocab_size, max_model_len)
    if key not in _MODEL_DIRS:  # one config per process and shape (ModelConfig only reads it)
        directory = tempfile.mkdtemp(prefix="shadow-virtual-")
        atexit.register(shutil.rmtree, directory, True)
        _MODEL_DIRS[key] = write_model_config(directory, *key)
    return _MODEL_DIRS[key]


def build_scheduler(scheduler_cls: type | None = None, config: VirtualEngineConfig | None = None,
                    kv_transfer_config: Any = None) -> Any:
    """A vLLM scheduler of ``scheduler_cls`` (default: stock ``Scheduler``)
    with a real KV cache manager of ``config.num_blocks`` blocks, built as
    vLLM's engine core builds it, minus the model. ``kv_transfer_config``
    (a vLLM ``KVTransferConfig``, e.g. P/D's ``NixlConnector``) replaces the
    host tier's."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig

    from shadow_vllm.vllm_internals import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        Scheduler,
        StructuredOutputManager,
    )

    config = config or VirtualEngineConfig()
    cls = scheduler_cls or Scheduler
    model = ModelConfig(
        model=_model_dir(config.vocab_size, config.max_model_len), skip_tokenizer_init=True,
        max_model_len=config.max_model_len, dtype="float32",
    )
    sched = SchedulerConfig(
        max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
        max_model_len=config.max_model_len, enable_chunked_prefill=True, policy=config.scheduling_policy,
        is_encoder_decoder=False, async_scheduling=_is_async(cls),
    )
    cache = CacheConfig(block_size=config.block_size, enable_prefix_caching=True)
    vllm_config = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache,
                             kv_transfer_config=kv_transfer_config or _offloading_config(config),
                             additional_config=dict(config.additional_config))
    vllm_config.cache_config.num_gpu_blocks = config.num_blocks
    spec = FullAttentionSpec(block_size=config.block_size, num_kv_heads=2, head_size=32, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(config.num_blocks, [], [KVCacheGroupSpec(["model.layers.0.self_attn"], spec)])
    return cls(
        vllm_config=vllm_config, kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config), block_size=config.block_size,
        log_stats=True,
    )


def _offloading_config(config: VirtualEngineConfig) -> Any:
    """The ``KVTransferConfig`` that ``--kv-offloading-size`` builds (native backend), or None.
    The scheduler creates the connector's scheduler side only (role SCHEDULER); no worker side."""
    if config.kv_offloading_bytes is None:
        return None
    from vllm.config import KVTransferConfig

    extra: dict[str, Any] = {"cpu_bytes_to_use": config.kv_offloading_bytes}
    if config.kv_offloading_block_size is not None:
        extra["block_size"] = config.kv_offloading_block_size
    return KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra)


def _is_async(cls: type) -> bool:
    from shadow_vllm.vllm_internals import AsyncScheduler

    return issubclass(cls, AsyncScheduler)


def block_hasher(block_size: int) -> Callable:
    """vLLM's request block hasher (the engine core's, with its hash seed)."""
    from vllm.config import CacheConfig
    from vllm.utils.hashing import get_hash_fn_by_name

    from shadow_vllm.vllm_internals import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name(CacheConfig().prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(block_size, hash_fn)


def check_scheduler_cls(value: Any, field: str = "scheduler_cls") -> type:
    """``value`` as a vLLM scheduler class: a class, or ``package.module.Class``."""
    if isinstance(value, str):
        import importlib

        module, _, name = value.rpartition(".")
        try:
            value = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as e:
            raise ConfigError(field, value, f"cannot import: {e}") from None
    if not isinstance(value, type) or not hasattr(value, "schedule"):
        raise ConfigError(field, value, "is not a vLLM scheduler class")
    return value
