"""Analytic roofline latency model of one engine iteration (paper, Appendix B).

An iteration runs prefill chunks (``q`` new tokens on ``c`` cached ones) and
decodes on one model instance of ``tp`` GPUs. Per GPU, its time is the sum of

* GEMMs, per weight group, ``max(compute, weight reads)``: compute is
  ``2 * active params * tokens / (flops * gemm_mfu)``, reads are weight bytes
  over ``bandwidth * hbm_efficiency``. Groups: attention/dense FFN weights
  (every token), routed experts (active params for compute; total params for
  reads, or the expected experts a batch touches with
  ``moe_weight_reads="expected"``), and the LM head (one row per sequence);
* prefill attention: compute over ``q * c + q * (q + 1) / 2`` (query, key)
  pairs plus a read of the chunk's ``c + q`` KV entries (a sliding window caps
  both on its layers);
* decode attention: per sequence, ``max(KV reads, compute)`` over its context
  plus ``decode_seq_overhead_s``;
* linear-attention state (Qwen3-Next): a read and a write per sequence;
* for ``tp > 1``, two all-reduces per layer of the tokens' activations
  (``allreduce_latency_s`` plus a ring transfer over NVLink);
* ``iteration_overhead_s``, once.

Weight, attention and state work divide by ``tp``; KV reads divide by at most
the number of KV heads (MQA/MLA caches are replicated across ranks).

Invariants (those of :class:`shadowcore.latency.LatencyModel`):
``predict_s`` is pure and deterministic, returns 0.0 for a batch with no
tokens, and never decreases when a decode, a prefill token or context is
added. All per-model arithmetic is precomputed at construction, so a call
costs a few microseconds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from shadow_sim.hardware import DeviceSpec, get_device, tensor_parallel_degree
from shadow_sim.models import ModelConfig, get_model
from shadowcore._validators import fraction_open_closed, non_negative, positive, positive_int
from shadowcore.errors import ConfigError
from shadowcore.latency import BatchShape, PrefillChunk, chunked_prefill_s

_MOE_READ_MODES = ("total", "expected")


def _moe_mode(_inst: Any, attribute: Any, value: Any) -> None:
    if value not in _MOE_READ_MODES:
        raise ConfigError(attribute.name, value, f"must be one of {_MOE_READ_MODES}")


@attrs.frozen
class _Coefficients:
    """Seconds per unit of work, precomputed for one (model, device, tp, knobs)."""

    dense_s_per_token: float
    dense_read_s: float
    expert_s_per_token: float
    expert_read_s: float
    expert_miss: float | None  # P(a token skips a given expert); None: read all
    head_s_per_seq: float
    head_read_s: float
    pair_s_full: float
    pair_s_window: float
    kv_read_s_full: float
    kv_read_s_window: float
    decode_s_per_ctx_full: float
    decode_s_per_ctx_window: float
    window: int
    per_decode_s: float
    per_seq_state_s: float
    allreduce_fixed_s: float
    allreduce_s_per_token: float


def _coefficients(m: RooflineLatencyModel) -> _Coefficients:
    model, dev, tp = m.model, m.device, m.tp
    flops = tp * dev.bf16_flops_per_s * m.gemm_mfu
    attn_flops = tp * dev.bf16_flops_per_s * m.attention_mfu
    bw = dev.hbm_bandwidth_bytes_per_s * m.hbm_efficiency
    kv_bw = min(tp, model.kv_shard_limit) * bw
    p = model.param_breakdown
    head = model.vocab_size * model.hidden_size
    win_layers = model.sliding_window_layers
    full_layers = model.kv_layers - win_layers
    kv_layer = model.kv_bytes_per_token_per_layer(m.kv_dtype_bytes)
    pre_pair = model.prefill_attention_flops_per_pair / attn_flops
    dec_pair = model.decode_attention_flops_per_pair / attn_flops
    ar_count = 2 * model.num_layers if tp > 1 else 0
    ring = 2 * (tp - 1) / tp * model.hidden_size * m.activation_bytes
    return _Coefficients(
        dense_s_per_token=2 * p.body_dense / flops,
        dense_read_s=p.body_dense * model.weight_dtype_bytes / (tp * bw),
        expert_s_per_token=2 * p.active_routed_experts / flops,
        expert_read_s=p.routed_experts * model.expert_bytes_per_param / (tp * bw),
        expert_miss=(1 - model.num_active_experts / model.num_experts if m.moe_weight_reads == "expected" else None),
        head_s_per_seq=2 * head / flops,
        head_read_s=head * model.weight_dtype_bytes / (tp * bw),
        pair_s_full=pre_pair * full_layers,
        pair_s_window=pre_pair * win_layers,
        kv_read_s_full=kv_layer * full_layers / kv_bw,
        kv_read_s_window=kv_layer * win_layers / kv_bw,
        decode_s_per_ctx_full=max(kv_layer / kv_bw, dec_pair) * full_layers,
        decode_s_per_ctx_window=max(kv_layer / kv_bw, dec_pair) * win_layers,
        window=model.sliding_window or 0,
        per_decode_s=m.decode_seq_overhead_s,
        per_seq_state_s=2 * model.recurrent_state_bytes / (tp * bw),
        allreduce_fixed_s=ar_count * m.allreduce_latency_s,
        allreduce_s_per_token=ar_count * ring / (dev.nvlink_bandwidth_bytes_per_s * m.nvlink_efficiency),
    )


def _causal_pairs(c: int, q: int) -> int:
    """(query, key) pairs of ``q`` new tokens after ``c`` cached ones."""
    return q * c + q * (q + 1) // 2


def _window_pairs(c: int, q: int, w: int) -> int:
    """As :func:`_causal_pairs`, each query seeing at most ``w`` keys."""
    m = min(max(w - c, 0), q)  # queries whose whole causal span fits the window
    return _causal_pairs(c, m) + (q - m) * w


@attrs.frozen
class RooflineLatencyModel:
    """Roofline iteration time of ``model`` on ``tp`` ``device`` GPUs.

    Efficiency knobs scale the datasheet peaks: ``gemm_mfu`` and
    ``attention_mfu`` (fractions of BF16 FLOPs), ``hbm_efficiency`` and
    ``nvlink_efficiency`` (fractions of bandwidth). Defaults are typical of
    vLLM on H100 (GEMMs ~600 of 989 TFLOPS, FlashAttention ~450, ~2.7 of
    3.35 TB/s streamed), not fitted to profiles. Instances are immutable; see
    the module docstring for the formula and invariants.
    """

    model: ModelConfig
    device: DeviceSpec
    tp: int = attrs.field(default=1, validator=positive_int)
    gemm_mfu: float = attrs.field(default=0.6, validator=fraction_open_closed)
    attention_mfu: float = attrs.field(default=0.45, validator=fraction_open_closed)
    hbm_efficiency: float = attrs.field(default=0.8, validator=fraction_open_closed)
    nvlink_efficiency: float = attrs.field(default=0.7, validator=fraction_open_closed)
    allreduce_latency_s: float = attrs.field(default=10e-6, validator=non_negative)
    iteration_overhead_s: float = attrs.field(default=1e-3, validator=non_negative)
    decode_seq_overhead_s: float = attrs.field(default=5e-6, validator=non_negative)
    activation_bytes: float = attrs.field(default=2, validator=positive)
    kv_dtype_bytes: float = attrs.field(default=2, validator=positive)
    moe_weight_reads: str = attrs.field(default="total", validator=_moe_mode)
    _k: _Coefficients = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_k", _coefficients(self))

    @classmethod
    def for_model(
        cls, model: str | ModelConfig, device: str | DeviceSpec = "H100-80GB", tp: int | None = None, **knobs: Any
    ) -> RooflineLatencyModel:
        """Build from names; ``tp=None`` uses the paper's half-of-HBM rule."""
        model = get_model(model) if isinstance(model, str) else model
        device = get_device(device) if isinstance(device, str) else device
        tp = tensor_parallel_degree(model, device) if tp is None else tp
        return cls(model, device, tp, **knobs)

    # ------------------------------------------------------------- Protocol
    def predict_s(self, batch: BatchShape) -> float:
        """Seconds one iteration running ``batch`` takes; 0.0 with no tokens."""
        decodes = batch.decode_context_tokens
        return self._batch_s(batch.prefills, len(decodes), self._decode_attention_s(decodes) if decodes else 0.0)

    def predict_batch_s(
        self, prefills: tuple[PrefillChunk, ...], num_decodes: int, total_context: int, max_context: int
    ) -> float | None:
        """:meth:`predict_s` from the decode aggregates: the very code
        :meth:`predict_s` runs (bit-identical); ``None`` for a sliding-window
        model, whose cost needs every context."""
        if self._k.window:
            return None
        attention = total_context * self._k.decode_s_per_ctx_full if num_decodes else 0.0
        return self._batch_s(prefills, num_decodes, attention)

    def _batch_s(self, prefills: Iterable[PrefillChunk], nd: int, attention: float) -> float:
        k = self._k
        tokens = seqs = nd
        for chunk in prefills:
            q = chunk.num_new_tokens
            if q:
                tokens += q
                seqs += 1
                attention += self._prefill_attention_s(chunk.num_context_tokens, q)
        if not tokens:
            return 0.0
        return (
            self.iteration_overhead_s
            + self._gemm_s(tokens, seqs)
            + attention
            + nd * k.per_decode_s
            + seqs * k.per_seq_state_s
            + k.allreduce_fixed_s
            + tokens * k.allreduce_s_per_token
        )

    def predict_decodes_s(self, num_decodes: int, total_context: int, max_context: int) -> float | None:
        """:meth:`predict_s` of a decode-only batch from its aggregates, the
        same float operations in the same order (so bit-identical); ``None``
        for a sliding-window model, whose cost needs every context."""
        k = self._k
        if k.window or num_decodes <= 0:
            return None
        return (
            self.iteration_overhead_s
            + self._gemm_s(num_decodes, num_decodes)
            + total_context * k.decode_s_per_ctx_full
            + num_decodes * k.per_decode_s
            + num_decodes * k.per_seq_state_s
            + k.allreduce_fixed_s
            + num_decodes * k.allreduce_s_per_token
        )

    # -------------------------------------------------------------- helpers
    def isolated_prefill_s(self, num_tokens: int, chunk_tokens: int | None = 2048) -> float:
        """Time to prefill ``num_tokens`` alone, in chunks of ``chunk_tokens`` (None: one)."""
        if chunk_tokens is not None and chunk_tokens < 1:
            raise ConfigError("chunk_tokens", chunk_tokens, "must be >= 1 or None")
        return chunked_prefill_s(self, num_tokens, chunk_tokens or max(1, num_tokens))

    def batch1_decode_s(self, context_tokens: int) -> float:
        """One decode iteration of a single sequence over ``context_tokens``."""
        return self.predict_s(BatchShape((), (context_tokens,)))

    # ------------------------------------------------------------ internals
    def _gemm_s(self, tokens: int, seqs: int) -> float:
        k = self._k
        t = max(tokens * k.dense_s_per_token, k.dense_read_s)
        t += max(seqs * k.head_s_per_seq, k.head_read_s)
        if k.expert_read_s:
            touched = 1.0 if k.expert_miss is None else 1.0 - k.expert_miss**tokens
            t += max(tokens * k.expert_s_per_token, touched * k.expert_read_s)
        return t

    def _prefill_attention_s(self, c: int, q: int) -> float:
        k = self._k
        t = _causal_pairs(c, q) * k.pair_s_full + (c + q) * k.kv_read_s_full
        if k.window:
            t += _window_pairs(c, q, k.window) * k.pair_s_window + min(c + q, k.window) * k.kv_read_s_window
        return t

    def _decode_attention_s(self, contexts: Iterable[int]) -> float:
        k = self._k
        t = sum(contexts) * k.decode_s_per_ctx_full
        if k.window:
            w = k.window
            capped = sum(c if c < w else w for c in contexts)  # noqa: FURB136 (2x faster than min)
            t += capped * k.decode_s_per_ctx_window
        return t


__all__ = ["RooflineLatencyModel"]
