"""Vidur-format profiles built from aiconfigurator-core's measured kernels.

No training here (that is test_vidur_latency.py): every catalog model is
profiled at its default TP, and the CSVs are checked for the columns Vidur
0.0.26's predictor reads, finiteness, monotonicity and physical magnitudes.

Magnitudes for Llama-3.1-8B on one H100-SXM (3.35 TB/s, 989 TFLOPS): the
gate+up projection of one token reads 4096 x 28672 x 2 B = 235 MB, >= 70 us at
peak bandwidth; decode attention of one 65536-token sequence reads 65536 x 8
KV heads x 128 x 2 (K, V) x 2 B = 268 MB per layer, >= 80 us; a 16384-token
causal prefill of 32 heads is 4 x 32 x 128 x 16384^2 / 2 = 2.2 TFLOP, >= 2.2 ms.
"""

from __future__ import annotations

import io

import numpy as np
import pytest

pytest.importorskip("aiconfigurator_core")
pd = pytest.importorskip("pandas")

from shadow_sim.hardware import H100_80GB, H200, tensor_parallel_degree
from shadow_sim.models import MODELS
from shadow_sim.vidur_profiles import (
    BandwidthModel,
    ProfileCoverageError,
    ProfileGrid,
    build_profiles,
    kernel_tables,
)

from shadowcore.errors import ConfigError

MLP_COLUMNS = {
    "n_head",
    "n_kv_head",
    "n_embd",
    "n_expanded_embd",
    "use_gated_mlp",
    "vocab_size",
    "num_tensor_parallel_workers",
    "num_tokens",
    *(
        f"time_stats.{op}.median"
        for op in (
            "attn_pre_proj",
            "attn_post_proj",
            "mlp_up_proj",
            "mlp_down_proj",
            "mlp_act",
            "input_layernorm",
            "post_attention_layernorm",
            "attn_rope",
            "add",
        )
    ),
}
ATTENTION_COLUMNS = {
    "n_embd",
    "n_q_head",
    "n_kv_head",
    "block_size",
    "num_tensor_parallel_workers",
    "batch_size",
    "prefill_chunk_size",
    "kv_cache_size",
    "time_stats.attn_prefill.median",
    "time_stats.attn_decode.median",
    "time_stats.attn_kv_cache_save.median",
}
ALL_REDUCE_COLUMNS = {"num_workers", "devices_per_node", "collective", "size", "time_stats.all_reduce.median"}


def _tp(name: str) -> int:
    try:
        return tensor_parallel_degree(MODELS[name], H100_80GB)
    except ConfigError:
        return 8  # DeepSeek-R1 exceeds the half-of-HBM rule even at TP8


def frames(profiles):
    return {n: pd.read_csv(io.StringIO(t)) for n, t in profiles.csv.items()}


@pytest.mark.parametrize("name", sorted(MODELS), ids=str)
def test_every_catalog_model_profiles(name: str) -> None:
    tp = _tp(name)
    p = build_profiles(name, "H100-80GB", tp)
    f = frames(p)
    assert set(f) == ({"mlp.csv", "attention.csv", "all_reduce.csv"} if tp > 1 else {"mlp.csv", "attention.csv"})
    assert MLP_COLUMNS <= set(f["mlp.csv"].columns)
    assert ATTENTION_COLUMNS <= set(f["attention.csv"].columns)
    if tp > 1:
        assert ALL_REDUCE_COLUMNS <= set(f["all_reduce.csv"].columns)
        assert (f["all_reduce.csv"]["time_stats.all_reduce.median"] > 0).all()
    mlp = f["mlp.csv"].sort_values("num_tokens")
    for col in ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj"):
        v = mlp[f"time_stats.{col}.median"].to_numpy()
        assert np.all(np.isfinite(v)) and np.all(v > 0)
        assert np.all(np.diff(v) >= -1e-12), col
    att = f["attention.csv"]
    pre = att[att.prefill_chunk_size > 0]
    dec = att[att.prefill_chunk_size == 0]
    assert (pre["time_stats.attn_prefill.median"] > 0).all()
    assert (dec["time_stats.attn_decode.median"] > 0).all()
    assert (pre.kv_cache_size >= pre.prefill_chunk_size).all()  # kv_cache_size counts the chunk
    table = dec.pivot_table(index="batch_size", columns="kv_cache_size", values="time_stats.attn_decode.median")
    assert np.all(np.diff(table.to_numpy(), axis=1) >= -1e-12)  # more context, never faster


def test_build_is_deterministic() -> None:
    a = build_profiles("Llama-3.1-70B", "H100-80GB", 4)
    b = build_profiles("Llama-3.1-70B", "H100-80GB", 4)
    assert a.csv == b.csv and a.content_hash == b.content_hash
    assert build_profiles("Llama-3.1-70B", "H200", 4).content_hash != a.content_hash
    assert build_profiles("Llama-3.1-70B", "H100-80GB", 8).content_hash != a.content_hash


def test_magnitudes_llama8_h100() -> None:
    f = frames(build_profiles("Llama-3.1-8B"))
    mlp = f["mlp.csv"].set_index("num_tokens")
    up1 = mlp.loc[1, "time_stats.mlp_up_proj.median"]
    assert 0.070 <= up1 <= 0.12  # ms: 235 MB at 60-100% of 3.35 TB/s
    att = f["attention.csv"]
    d = att[(att.prefill_chunk_size == 0) & (att.batch_size == 1) & (att.kv_cache_size == 65536)]
    assert 0.080 <= d["time_stats.attn_decode.median"].item() <= 0.2
    p = att[(att.prefill_chunk_size == 8192) & (att.kv_cache_size == 8192)]
    assert 0.55 <= p["time_stats.attn_prefill.median"].item() <= 2.0  # 0.55 TFLOP


def test_h200_decodes_faster_than_h100() -> None:
    def decode_ms(device) -> float:
        att = frames(build_profiles("Llama-3.1-8B", device))["attention.csv"]
        row = att[(att.prefill_chunk_size == 0) & (att.batch_size == 32) & (att.kv_cache_size == 32768)]
        return row["time_stats.attn_decode.median"].item()

    assert decode_ms(H200) < decode_ms(H100_80GB)


def test_gemm_interpolation_hits_measured_points() -> None:
    k = kernel_tables("H100-80GB")
    ms, ns, ks, cube = k._gemm["bfloat16"]
    i, j, l = 40, 10, 12
    assert k.gemm_ms(ms[i], ns[j], ks[l]).item() == pytest.approx(cube[i, j, l])
    between = k.gemm_ms(ms[i], (ns[j] + ns[j + 1]) / 2, ks[l]).item()
    assert min(cube[i, j, l], cube[i, j + 1, l]) <= between <= max(cube[i, j, l], cube[i, j + 1, l])
    with pytest.raises(ProfileCoverageError, match="gemm"):
        k.gemm_ms(40000, 4096, 4096)


def test_all_reduce_grows_with_message_and_degree() -> None:
    k = kernel_tables("H100-80GB")
    sizes = np.array([1e3, 1e5, 1e7, 1e8])
    for tp in (2, 4, 8):
        t = k.allreduce_ms(tp, sizes)
        assert np.all(np.diff(t) > 0)
    with pytest.raises(ProfileCoverageError):
        k.allreduce_ms(3, sizes)


def test_bandwidth_model_is_floor_plus_bytes_over_bandwidth() -> None:
    bw = BandwidthModel(hbm_efficiency=0.5, kernel_floor_s=1e-6)
    assert bw.kernel_ms(H100_80GB, 3.35e9).item() == pytest.approx((1e-6 + 2e-3) * 1e3)  # ms


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_prefill_chunk": 100}, "max_prefill_chunk"),
        ({"max_kv_tokens": 1000}, "max_kv_tokens"),
        ({"max_batch_tokens": 65536}, "max_batch_tokens"),
        ({"max_decode_batch": 4096}, "max_decode_batch"),
    ],
)
def test_grid_rejects_what_the_tables_cannot_cover(kwargs, field) -> None:
    with pytest.raises(ConfigError, match=field):
        ProfileGrid(**kwargs)


def test_tp_must_divide_heads() -> None:
    with pytest.raises(ConfigError, match="tensor_parallel"):
        build_profiles("Qwen2.5-7B", "H100-80GB", 8)  # 28 query heads
