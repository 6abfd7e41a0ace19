"""Device specs and the half-of-HBM tensor-parallel rule (Appendix B, Table 4)."""

from __future__ import annotations

import pytest
from shadow_sim.hardware import H100_80GB, H200, DeviceSpec, get_device, tensor_parallel_degree
from shadow_sim.models import MODELS, get_model

from shadowcore.errors import ConfigError

# Appendix B "Deployments" and Table 4 (H100-80GB).
PAPER_TP = {
    "Qwen2.5-7B": 1,
    "Llama-3.1-8B": 1,
    "Mistral-7B": 1,
    "Mistral-Nemo-12B": 1,
    "Gemma-7B": 1,
    "Gemma-2-9B": 1,
    "gpt-oss-20b": 1,
    "SWE-agent-LM-7B": 1,
    "Gemma-2-27B": 2,
    "gpt-oss-120b": 2,
    "Granite-34B-code": 2,
    "SWE-agent-LM-32B": 2,
    "Llama-3.1-70B": 4,
    "Llama-3.3-70B": 4,
    "Mixtral-8x7B": 4,
    "Qwen2.5-72B": 4,
    "Mixtral-8x22B": 8,
    "Qwen3-Next-80B-A3B": 8,
}


@pytest.mark.parametrize(("name", "tp"), sorted(PAPER_TP.items()))
def test_tp_degree_matches_paper_on_h100(name: str, tp: int) -> None:
    assert tensor_parallel_degree(MODELS[name], H100_80GB) == tp


def test_larger_hbm_needs_no_more_gpus() -> None:
    for m in MODELS.values():
        if m.name in PAPER_TP:
            assert tensor_parallel_degree(m, H200) <= PAPER_TP[m.name]
    assert tensor_parallel_degree(get_model("L3.1-70B"), H200) == 4  # 141 GB / 2 > 70.5 GB


def test_weight_fraction_is_a_knob() -> None:
    assert tensor_parallel_degree(get_model("L3.1-70B"), H100_80GB, max_weight_fraction=1.0) == 2


def test_model_that_never_fits_raises() -> None:
    with pytest.raises(ConfigError) as err:
        tensor_parallel_degree(MODELS["DeepSeek-R1"], H100_80GB)
    assert "DeepSeek-R1" in str(err.value)


def test_device_lookup() -> None:
    assert get_device("h100") is H100_80GB
    assert get_device("H200") is H200
    with pytest.raises(ConfigError, match="B200"):
        get_device("B200")


def test_device_spec_validates() -> None:
    with pytest.raises(ConfigError) as err:
        DeviceSpec("x", 1e9, 1e12, 1e15, 1e11, idle_power_w=500, busy_power_w=400)
    assert err.value.field == "busy_power_w"
    with pytest.raises(ConfigError):
        DeviceSpec("x", 0, 1e12, 1e15, 1e11, 50, 400)
