"""The backend contract on vLLM in virtual time: ``check_backend`` passes on
:class:`shadow_vllm.backend.VirtualBackend` (vLLM's real scheduler and KV
cache manager with the shadow scheduler, the fake backend's workload).
The check's own failures on broken backends: tests/test_backend_contract.py."""

from __future__ import annotations

from shadow_vllm.backend import VirtualBackend

from shadowcore.backend import Backend
from shadowcore.testing import check_backend

WORKLOAD = {"instances_per_model": 1, "duration_s": 12.0, "warmup_s": 0.0, "session_rate_per_s": 0.3,
            "calls_per_session": 4, "switch_probability": 0.4, "input_tokens_median": 600,
            "output_tokens_median": 30, "normal_rate_per_s": 0.5, "normal_prompt_median": 400,
            "normal_output_median": 30, "num_blocks": 1024}


def test_vllm_virtual_keeps_the_contract() -> None:
    backend = VirtualBackend()
    assert isinstance(backend, Backend)
    report = check_backend(backend, WORKLOAD)
    assert report.num_shadow_chunks > 0 and report.num_calls > 0 and report.num_batches == report.num_plans
