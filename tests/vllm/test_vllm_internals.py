"""The one list of vLLM internals the backend touches (shadow_vllm.vllm_internals):
it holds on the installed vLLM, and a missing piece is one clear error naming it."""

from __future__ import annotations

import types

import pytest
from shadow_vllm import virtual, vllm_internals


def test_installed_vllm_has_every_internal_the_backend_uses() -> None:
    vllm_internals.check()
    vllm_internals.check_scheduler(virtual.build_scheduler(config=virtual.VirtualEngineConfig(num_blocks=64)))


def test_a_missing_internal_is_named() -> None:
    with pytest.raises(ImportError, match=r"Scheduler\._no_such_method .*vllm_internals\.py"):
        vllm_internals.check({vllm_internals.Scheduler: ("schedule", "_no_such_method")})
    scheduler = virtual.build_scheduler(config=virtual.VirtualEngineConfig(num_blocks=64))
    stripped = types.SimpleNamespace(**{k: v for k, v in vars(scheduler).items() if k != "deferred_waiting"})
    with pytest.raises(ImportError, match=r"Scheduler\.deferred_waiting"):
        vllm_internals.check_scheduler(stripped)
