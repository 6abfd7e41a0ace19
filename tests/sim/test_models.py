"""Catalog facts for shadow_sim.models: architecture numbers, parameter and KV
counts against the paper (Table 3, §3.3) and public model cards, and lookup."""

from __future__ import annotations

import attrs
import pytest
from shadow_sim.models import MODELS, ModelConfig, get_model

from shadowcore.errors import ConfigError

# Table 3 "Params (B)" column: total parameters, rounded to 0.1 B.
TABLE3_TOTAL_B = {
    "gpt-oss-20b": 20.9,
    "gpt-oss-120b": 116.8,
    "Llama-3.3-70B": 70.6,
    "Qwen2.5-7B": 7.6,
    "Qwen3-Next-80B-A3B": 81.3,
    "Llama-3.1-8B": 8.0,
    "Llama-3.1-70B": 70.6,
    "Mistral-Nemo-12B": 12.2,
    "Mistral-7B": 7.2,
    "Mixtral-8x22B": 140.6,
    "Gemma-2-27B": 27.2,
    "Gemma-2-9B": 9.2,
    "Granite-34B-code": 33.7,
    "Mixtral-8x7B": 46.7,
    "Gemma-7B": 8.5,
}


@pytest.mark.parametrize(("name", "billions"), sorted(TABLE3_TOTAL_B.items()))
def test_total_params_round_to_table3(name: str, billions: float) -> None:
    assert round(MODELS[name].num_params / 1e9, 1) == billions


def test_gemma_7b_stores_458_kb_of_kv_per_token() -> None:
    # §3.3: "Gemma-7B uses full multi-head attention and stores 458 KB of KV per token".
    assert MODELS["Gemma-7B"].kv_bytes_per_token() == 458_752
    assert MODELS["Gemma-7B"].kv_bytes_per_token(dtype_bytes=1) == 229_376


@pytest.mark.parametrize("name", sorted(n for n, m in MODELS.items() if m.mla is None))
def test_kv_bytes_follow_the_gqa_formula(name: str) -> None:
    m = MODELS[name]
    expected = 2 * m.kv_layers * m.num_kv_heads * m.head_dim * 2
    assert m.kv_bytes_per_token() == expected


def test_llama_parameter_counts() -> None:
    assert MODELS["Llama-3.1-8B"].num_params == pytest.approx(8.03e9, rel=0.002)
    assert MODELS["Llama-3.1-70B"].num_params == pytest.approx(70.55e9, rel=0.002)
    assert MODELS["Llama-3.3-70B"].num_params == MODELS["Llama-3.1-70B"].num_params


def test_mixtral_total_and_active_params() -> None:
    m = MODELS["Mixtral-8x7B"]
    assert m.num_params == pytest.approx(46.7e9, rel=0.002)
    assert m.num_active_params == pytest.approx(12.9e9, rel=0.005)
    assert MODELS["Mixtral-8x22B"].num_active_params == pytest.approx(39.1e9, rel=0.005)


@pytest.mark.parametrize(("name", "active_b"), [("gpt-oss-20b", 3.6), ("gpt-oss-120b", 5.1)])
def test_gpt_oss_active_params_match_model_card_without_input_embedding(name: str, active_b: float) -> None:
    # OpenAI's card (and Table 3) count the unembedding but not the embedding table.
    m = MODELS[name]
    assert round((m.num_active_params - m.param_breakdown.embedding) / 1e9, 1) == active_b


def test_gpt_oss_serving_bytes_use_mxfp4_experts() -> None:
    m = MODELS["gpt-oss-120b"]
    assert 60e9 < m.serving_weight_bytes < 70e9  # the ~65 GB checkpoint
    assert m.weight_bytes() == 2 * m.num_params  # uniform bf16 sizing is still available


def test_deepseek_r1_is_671b_moe_with_mla_latent_cache() -> None:
    m = MODELS["DeepSeek-R1"]
    assert m.num_params == pytest.approx(671e9, rel=0.005)
    assert m.num_active_params == pytest.approx(37e9, rel=0.03)
    assert m.kv_bytes_per_token() == 61 * (512 + 64) * 2
    assert m.kv_shard_limit == 1


def test_dense_models_activate_every_gemm_parameter() -> None:
    for m in MODELS.values():
        if not m.is_moe and m.stored_only_params == 0:
            assert m.num_active_params == m.num_params, m.name
        assert 0 < m.num_active_params <= m.num_params, m.name


def test_swe_agent_models_share_qwen_coder_architecture() -> None:
    assert attrs.evolve(MODELS["SWE-agent-LM-7B"], name="Qwen2.5-7B") == MODELS["Qwen2.5-7B"]
    assert round(MODELS["SWE-agent-LM-32B"].num_params / 1e9, 1) == 32.8


FIGURE_LABELS = {
    "Q2.5-7B": "Qwen2.5-7B",
    "L3.1-8B": "Llama-3.1-8B",
    "L3.1-70B": "Llama-3.1-70B",
    "L3.3-70B": "Llama-3.3-70B",
    "OSS-20B": "gpt-oss-20b",
    "OSS-120B": "gpt-oss-120b",
    "M-7B": "Mistral-7B",
    "Nemo-12B": "Mistral-Nemo-12B",
    "Mx-8x7B": "Mixtral-8x7B",
    "Mx-8x22B": "Mixtral-8x22B",
    "G-7B": "Gemma-7B",
    "G2-9B": "Gemma-2-9B",
    "Granite-34B": "Granite-34B-code",
    "S7": "SWE-agent-LM-7B",
    "S32": "SWE-agent-LM-32B",
    "Q72": "Qwen2.5-72B",
    "G2-27B": "Gemma-2-27B",
    "Q3N-80B": "Qwen3-Next-80B-A3B",
}


@pytest.mark.parametrize(("label", "name"), sorted(FIGURE_LABELS.items()))
def test_figure_labels_resolve(label: str, name: str) -> None:
    assert get_model(label).name == name
    assert get_model(label.lower()).name == name


@pytest.mark.parametrize(
    ("hf_name", "name"),
    [
        ("meta-llama/Llama-3.1-8B-Instruct", "Llama-3.1-8B"),
        ("mistralai/Mistral-7B-Instruct-v0.3", "Mistral-7B"),
        ("mistralai/Mistral-Nemo-Instruct-2407", "Mistral-Nemo-12B"),
        ("mistralai/Mixtral-8x22B-Instruct-v0.1", "Mixtral-8x22B"),
        ("google/gemma-2-9b-it", "Gemma-2-9B"),
        ("ibm-granite/granite-34b-code-instruct", "Granite-34B-code"),
        ("openai/gpt-oss-120b", "gpt-oss-120b"),
        ("QWEN2.5-72B-INSTRUCT", "Qwen2.5-72B"),
        ("deepseek-ai/DeepSeek-R1", "DeepSeek-R1"),
    ],
)
def test_huggingface_names_resolve(hf_name: str, name: str) -> None:
    assert get_model(hf_name) is MODELS[name]


def test_unknown_model_error_names_it_and_lists_known() -> None:
    with pytest.raises(ConfigError) as err:
        get_model("Llama-9-1T")
    assert "Llama-9-1T" in str(err.value)
    assert "Mixtral-8x7B" in str(err.value)
    assert err.value.field == "model"


def _llama8b(**changes: object) -> ModelConfig:
    return attrs.evolve(MODELS["Llama-3.1-8B"], **changes)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"num_kv_heads": 5}, "num_kv_heads"),
        ({"num_layers": 0}, "num_layers"),
        ({"num_active_experts": 2}, "num_active_experts"),
        ({"sliding_window": 4096}, "sliding_window"),
        ({"sliding_window_layers": 4}, "sliding_window"),
        ({"num_kv_layers": 33}, "num_kv_layers"),
        ({"weight_dtype_bytes": 0}, "weight_dtype_bytes"),
    ],
)
def test_invalid_configs_raise_config_error_naming_the_field(changes: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        _llama8b(**changes)
    assert err.value.field == field
