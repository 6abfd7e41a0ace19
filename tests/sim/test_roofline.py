"""RooflineLatencyModel: LatencyModel invariants (purity, empty batch, monotonicity)
and magnitudes justified from the H100 roofline.

Reference numbers for Llama-3.1-8B on one H100-80GB (989 TFLOPS bf16, 3.35 TB/s):
GEMM weights outside the input embedding are 7.5 B params = 15.0 GB, so a decode
cannot beat 15.0 GB / 3.35 TB/s = 4.5 ms; at 50-100% of peak bandwidth plus ~1 ms
of per-step overhead a batch-1 decode takes 5-15 ms. A 2,048-token chunk needs
2 * 7.0 B * 2048 = 28.6 TFLOP of GEMMs, 29 ms at peak; at the 25-80% MFU range
serving engines reach, it takes 35-120 ms.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shadow_sim.hardware import H100_80GB
from shadow_sim.models import MODELS
from shadow_sim.roofline import RooflineLatencyModel

from shadowcore.errors import ConfigError
from shadowcore.latency import BatchShape, LatencyModel, PrefillChunk

LLAMA8 = RooflineLatencyModel.for_model("Llama-3.1-8B")

# One per code path: dense GQA, sliding window, MoE (both read modes), MQA at
# tp=2, linear-attention state + tp=8, MLA.
MODELS_UNDER_TEST = [
    LLAMA8,
    RooflineLatencyModel.for_model("Gemma-2-9B"),
    RooflineLatencyModel.for_model("gpt-oss-120b"),
    RooflineLatencyModel.for_model("Mixtral-8x7B", moe_weight_reads="expected"),
    RooflineLatencyModel.for_model("Granite-34B"),
    RooflineLatencyModel.for_model("Qwen3-Next-80B-A3B"),
    RooflineLatencyModel.for_model("DeepSeek-R1", "H200", tp=8),
]


def prefill(q: int, c: int = 0) -> BatchShape:
    return BatchShape((PrefillChunk(q, c),))


def decodes(*contexts: int) -> BatchShape:
    return BatchShape((), contexts)


chunks = st.builds(PrefillChunk, st.integers(0, 4096), st.integers(0, 131072))
batches = st.builds(BatchShape, st.lists(chunks, max_size=4), st.lists(st.integers(0, 131072), max_size=80))
roofs = st.sampled_from(MODELS_UNDER_TEST)


def test_implements_the_latency_model_port() -> None:
    assert isinstance(LLAMA8, LatencyModel)


@pytest.mark.parametrize("roof", MODELS_UNDER_TEST, ids=lambda r: r.model.name)
def test_batch_without_tokens_costs_nothing(roof: RooflineLatencyModel) -> None:
    assert roof.predict_s(BatchShape()) == 0.0
    assert roof.predict_s(prefill(0, 5000)) == 0.0
    assert roof.predict_s(decodes(1)) > 0.0


@settings(max_examples=300, deadline=None)
@given(roofs, batches)
def test_pure_and_positive(roof: RooflineLatencyModel, batch: BatchShape) -> None:
    t = roof.predict_s(batch)
    assert t == roof.predict_s(BatchShape(batch.prefills, batch.decode_context_tokens))
    assert (t == 0.0) == batch.is_empty
    assert t >= 0.0


@settings(max_examples=300, deadline=None)
@given(roofs, batches, st.integers(0, 131072))
def test_adding_a_decode_never_speeds_up(roof: RooflineLatencyModel, batch: BatchShape, ctx: int) -> None:
    bigger = BatchShape(batch.prefills, batch.decode_context_tokens + (ctx,))
    assert roof.predict_s(bigger) >= roof.predict_s(batch)


@settings(max_examples=300, deadline=None)
@given(roofs, batches, st.integers(1, 2048), st.integers(0, 65536), st.data())
def test_more_prefill_tokens_or_context_never_speed_up(
    roof: RooflineLatencyModel,
    batch: BatchShape,
    extra_new: int,
    extra_ctx: int,
    data: st.DataObject,
) -> None:
    base = batch.with_prefills((PrefillChunk(0, 0),)) if not batch.prefills else batch
    i = data.draw(st.integers(0, len(base.prefills) - 1))
    old = base.prefills[i]
    for new in (
        PrefillChunk(old.num_new_tokens + extra_new, old.num_context_tokens),
        PrefillChunk(old.num_new_tokens, old.num_context_tokens + extra_ctx),
    ):
        grown = base.prefills[:i] + (new,) + base.prefills[i + 1 :]
        assert roof.predict_s(BatchShape(grown, base.decode_context_tokens)) >= roof.predict_s(base)


@settings(max_examples=300, deadline=None)
@given(roofs, st.lists(st.integers(0, 131072), min_size=1, max_size=80), st.integers(1, 65536), st.data())
def test_longer_decode_context_never_speeds_up(
    roof: RooflineLatencyModel, ctxs: list[int], extra: int, data: st.DataObject
) -> None:
    i = data.draw(st.integers(0, len(ctxs) - 1))
    grown = ctxs[:i] + [ctxs[i] + extra] + ctxs[i + 1 :]
    assert roof.predict_s(decodes(*grown)) >= roof.predict_s(decodes(*ctxs))


def test_llama8b_batch1_decode_is_memory_bound_and_plausible() -> None:
    t = LLAMA8.batch1_decode_s(1024)
    weights = MODELS["Llama-3.1-8B"].num_params - 128256 * 4096  # minus input embedding
    assert t > weights * 2 / H100_80GB.hbm_bandwidth_bytes_per_s  # 4.5 ms floor
    assert 0.005 <= t <= 0.015


def test_llama8b_2048_token_chunk_is_compute_bound_and_plausible() -> None:
    t = LLAMA8.predict_s(prefill(2048))
    assert t > 2 * 6.98e9 * 2048 / H100_80GB.bf16_flops_per_s  # 29 ms floor
    assert 0.035 <= t <= 0.120
    # Compute-bound: twice the tokens cost about twice the time.
    assert 1.8 <= LLAMA8.predict_s(prefill(4096)) / t <= 2.3


def test_small_decode_batches_ride_on_the_weight_read() -> None:
    one, many = LLAMA8.predict_s(decodes(512)), LLAMA8.predict_s(decodes(*[512] * 32))
    assert many < 1.3 * one


def test_attention_grows_with_cached_context() -> None:
    assert LLAMA8.predict_s(prefill(2048, 60000)) > 2 * LLAMA8.predict_s(prefill(2048))
    assert LLAMA8.batch1_decode_s(100_000) > LLAMA8.batch1_decode_s(1_000) + 0.004


def test_helpers_are_built_from_predict_s() -> None:
    assert LLAMA8.batch1_decode_s(777) == LLAMA8.predict_s(decodes(777))
    assert LLAMA8.isolated_prefill_s(0) == 0.0
    assert LLAMA8.isolated_prefill_s(4096) == pytest.approx(
        LLAMA8.predict_s(prefill(2048)) + LLAMA8.predict_s(prefill(2048, 2048))
    )
    assert LLAMA8.isolated_prefill_s(3000, chunk_tokens=None) == LLAMA8.predict_s(prefill(3000))
    with pytest.raises(ConfigError):
        LLAMA8.isolated_prefill_s(10, chunk_tokens=0)


def test_higher_tp_shortens_prefill_but_all_reduces_cost_something() -> None:
    tp4 = RooflineLatencyModel.for_model("L3.1-70B")
    tp8 = attrs.evolve(tp4, tp=8)
    assert tp4.tp == 4
    assert tp8.predict_s(prefill(2048)) < tp4.predict_s(prefill(2048))
    assert tp8.predict_s(prefill(2048)) > tp4.predict_s(prefill(2048)) / 2


def test_kv_reads_split_only_over_kv_heads() -> None:
    def per_context_token(roof: RooflineLatencyModel) -> float:
        return (roof.batch1_decode_s(65536) - roof.batch1_decode_s(0)) / 65536

    granite = RooflineLatencyModel.for_model("Granite-34B", tp=1)  # multi-query: 1 KV head
    llama70 = RooflineLatencyModel.for_model("L3.1-70B", tp=1)
    assert per_context_token(attrs.evolve(granite, tp=2)) == pytest.approx(per_context_token(granite))
    assert per_context_token(attrs.evolve(llama70, tp=2)) == pytest.approx(per_context_token(llama70) / 2)


def test_sliding_window_caps_attention_reads() -> None:
    gemma2 = RooflineLatencyModel.for_model("G2-9B")
    m = gemma2.model
    no_window = attrs.evolve(gemma2, model=attrs.evolve(m, sliding_window=None, sliding_window_layers=0))
    assert gemma2.batch1_decode_s(4096) == pytest.approx(no_window.batch1_decode_s(4096))
    assert gemma2.batch1_decode_s(100_000) < no_window.batch1_decode_s(100_000)
    assert gemma2.predict_s(prefill(2048, 60000)) < no_window.predict_s(prefill(2048, 60000))


def test_moe_expected_reads_touch_fewer_experts_on_small_batches() -> None:
    total = RooflineLatencyModel.for_model("Mx-8x7B")
    expected = attrs.evolve(total, moe_weight_reads="expected")
    assert expected.batch1_decode_s(512) < 0.6 * total.batch1_decode_s(512)
    assert expected.predict_s(prefill(2048)) == pytest.approx(total.predict_s(prefill(2048)))


@pytest.mark.parametrize(
    ("knob", "value"),
    [
        ("tp", 0),
        ("gemm_mfu", 1.5),
        ("hbm_efficiency", 0.0),
        ("iteration_overhead_s", -1.0),
        ("moe_weight_reads", "some"),
    ],
)
def test_invalid_knobs_raise_config_error(knob: str, value: object) -> None:
    with pytest.raises(ConfigError) as err:
        RooflineLatencyModel(MODELS["Llama-3.1-8B"], H100_80GB, **{knob: value})
    assert err.value.field == knob


@given(st.integers(0, 300), st.integers(0, 300), st.integers(1, 300))
def test_window_pair_count_matches_brute_force(c: int, q: int, w: int) -> None:
    from shadow_sim.roofline import _causal_pairs, _window_pairs

    assert _causal_pairs(c, q) == sum(c + i for i in range(1, q + 1))
    assert _window_pairs(c, q, w) == sum(min(c + i, w) for i in range(1, q + 1))
