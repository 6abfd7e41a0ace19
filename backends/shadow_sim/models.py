"""Model architectures: what the simulator needs to size weights, KV and FLOPs.

A :class:`ModelConfig` holds the architecture numbers of a model's HuggingFace
``config.json``; its derived properties count parameters and bytes. The
catalog :data:`MODELS` holds every model the ShadowPrefill paper serves, and
:func:`get_model` looks one up by canonical name, HuggingFace name or the
short label the paper's figures use.

Invariants:

* A ``ModelConfig`` is immutable and validated on construction; an invalid
  field raises :class:`~shadowcore.errors.ConfigError` naming the field.
* ``num_params >= num_active_params > 0``; they are equal for dense models.
* ``num_params`` counts every stored weight (embedding, untied LM head,
  ``stored_only_params``); ``num_active_params`` counts the weights one token
  touches, both embedding tables included (the convention behind the paper's
  "46.7 (12.9)" for Mixtral-8x7B). Biases and normalisation weights are left
  out of both: they are under 0.1% for every catalog model.
* ``kv_bytes_per_token(d) == 2 * num_kv_layers * num_kv_heads * head_dim * d``
  for softmax-attention models; MLA models (DeepSeek) cache one latent of
  ``mla.latent_dim`` values per layer instead (no factor 2: K and V share it).
* Catalog entries' totals match the paper's Table 3 to within 0.5%.
"""

from __future__ import annotations

import math
import re
from typing import Any

import attrs

from shadowcore._validators import non_empty_str, non_negative_int, positive, positive_int
from shadowcore.errors import ConfigError


@attrs.frozen
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V3/R1) dimensions.

    The KV cache holds ``latent_dim = kv_lora_rank + qk_rope_head_dim`` values
    per token per layer, shared by all heads (so tensor parallelism cannot
    split it: every rank keeps the whole latent).
    """

    q_lora_rank: int = attrs.field(validator=non_negative_int)
    kv_lora_rank: int = attrs.field(validator=positive_int)
    qk_nope_head_dim: int = attrs.field(validator=positive_int)
    qk_rope_head_dim: int = attrs.field(validator=positive_int)
    v_head_dim: int = attrs.field(validator=positive_int)

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def params_per_layer(self, hidden: int, heads: int) -> int:
        """Q (optionally low-rank), KV down/up projections and the output projection."""
        qk_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.q_lora_rank:
            q = hidden * self.q_lora_rank + self.q_lora_rank * heads * qk_dim
        else:
            q = hidden * heads * qk_dim
        kv_down = hidden * self.latent_dim
        kv_up = self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv_down + kv_up + heads * self.v_head_dim * hidden


@attrs.frozen
class ParamBreakdown:
    """Where a model's parameters sit; all counts are whole-model totals.

    ``dense_ffn`` includes dense FFN layers, shared experts, routers and
    ``extra_dense_params``: everything besides attention that every token
    multiplies by. ``lm_head`` is 0 when tied to the embedding.
    """

    attention: int
    dense_ffn: int
    routed_experts: int
    active_routed_experts: int
    embedding: int
    lm_head: int
    stored_only: int

    @property
    def body_dense(self) -> int:
        """Per-token GEMM weights outside the routed experts and the LM head."""
        return self.attention + self.dense_ffn


def _opt_positive_int(_inst: Any, attribute: Any, value: Any) -> None:
    if value is not None:
        positive_int(_inst, attribute, value)


def _opt_positive(_inst: Any, attribute: Any, value: Any) -> None:
    if value is not None:
        positive(_inst, attribute, value)


def _check(ok: bool, field: str, value: object, problem: str) -> None:
    if not ok:
        raise ConfigError(field, value, problem)


@attrs.frozen
class ModelConfig:
    """Architecture of one served model (HuggingFace ``config.json`` numbers).

    ``intermediate_size`` is the FFN width of a dense layer or of one routed
    expert. MoE models (``num_experts > 1``) may have ``num_shared_experts``
    always-on experts of the same width and ``num_dense_layers`` leading dense
    layers of width ``dense_intermediate_size``. ``num_kv_layers`` (default:
    all) are the softmax-attention layers that hold a KV cache; the others are
    linear-attention layers whose weights are in ``extra_dense_params`` and
    whose per-sequence state is ``recurrent_state_bytes``. ``sliding_window``
    applies to ``sliding_window_layers`` of the KV layers (it shortens what
    attention reads; KV memory is still sized for the full context).
    ``weight_dtype_bytes``/``expert_dtype_bytes`` give the serving checkpoint's
    storage width (gpt-oss keeps MXFP4 experts, DeepSeek-R1 FP8 weights).

    Invariants: validated on construction; ``num_active_experts <=
    num_experts``; ``num_heads % num_kv_heads == 0``; ``sliding_window`` is set
    iff ``sliding_window_layers > 0``.
    """

    name: str = attrs.field(validator=non_empty_str)
    num_layers: int = attrs.field(validator=positive_int)
    hidden_size: int = attrs.field(validator=positive_int)
    num_heads: int = attrs.field(validator=positive_int)
    num_kv_heads: int = attrs.field(validator=positive_int)
    head_dim: int = attrs.field(validator=positive_int)
    intermediate_size: int = attrs.field(validator=positive_int)
    vocab_size: int = attrs.field(validator=positive_int)
    max_context_tokens: int = attrs.field(validator=positive_int)
    num_experts: int = attrs.field(default=1, validator=positive_int)
    num_active_experts: int = attrs.field(default=1, validator=positive_int)
    num_shared_experts: int = attrs.field(default=0, validator=non_negative_int)
    num_dense_layers: int = attrs.field(default=0, validator=non_negative_int)
    dense_intermediate_size: int = attrs.field(default=0, validator=non_negative_int)
    gated_mlp: bool = True
    tie_embeddings: bool = False
    num_kv_layers: int | None = attrs.field(default=None, validator=_opt_positive_int)
    sliding_window: int | None = attrs.field(default=None, validator=_opt_positive_int)
    sliding_window_layers: int = attrs.field(default=0, validator=non_negative_int)
    mla: MLAConfig | None = None
    extra_dense_params: int = attrs.field(default=0, validator=non_negative_int)
    stored_only_params: int = attrs.field(default=0, validator=non_negative_int)
    weight_dtype_bytes: float = attrs.field(default=2.0, validator=positive)
    expert_dtype_bytes: float | None = attrs.field(default=None, validator=_opt_positive)
    recurrent_state_bytes: int = attrs.field(default=0, validator=non_negative_int)

    def __attrs_post_init__(self) -> None:
        _check(
            self.num_heads % self.num_kv_heads == 0,
            "num_kv_heads",
            self.num_kv_heads,
            f"must divide num_heads ({self.num_heads})",
        )
        _check(
            self.num_active_experts <= self.num_experts,
            "num_active_experts",
            self.num_active_experts,
            f"must be <= num_experts ({self.num_experts})",
        )
        _check(
            self.is_moe or (self.num_dense_layers == 0 and self.num_shared_experts == 0),
            "num_dense_layers",
            self.num_dense_layers,
            "dense models take no MoE options",
        )
        _check(
            self.num_dense_layers < self.num_layers,
            "num_dense_layers",
            self.num_dense_layers,
            f"must be < num_layers ({self.num_layers})",
        )
        _check(
            self.num_dense_layers == 0 or self.dense_intermediate_size > 0,
            "dense_intermediate_size",
            self.dense_intermediate_size,
            "must be > 0 when num_dense_layers > 0",
        )
        _check(
            self.kv_layers <= self.num_layers,
            "num_kv_layers",
            self.num_kv_layers,
            f"must be <= num_layers ({self.num_layers})",
        )
        _check(
            self.sliding_window_layers <= self.kv_layers,
            "sliding_window_layers",
            self.sliding_window_layers,
            f"must be <= num_kv_layers ({self.kv_layers})",
        )
        _check(
            (self.sliding_window is None) == (self.sliding_window_layers == 0),
            "sliding_window",
            self.sliding_window,
            "set it exactly when sliding_window_layers > 0",
        )

    # ----------------------------------------------------------------- shape
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    @property
    def kv_layers(self) -> int:
        """Layers that hold a KV cache (softmax or MLA attention)."""
        return self.num_layers if self.num_kv_layers is None else self.num_kv_layers

    @property
    def moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers if self.is_moe else 0

    @property
    def expert_bytes_per_param(self) -> float:
        return self.weight_dtype_bytes if self.expert_dtype_bytes is None else self.expert_dtype_bytes

    # ---------------------------------------------------------------- params
    def _mlp(self, width: int) -> int:
        return (3 if self.gated_mlp else 2) * self.hidden_size * width

    def _attention_params(self) -> int:
        if self.mla is not None:
            per_layer = self.mla.params_per_layer(self.hidden_size, self.num_heads)
        else:
            qo = 2 * self.num_heads * self.head_dim
            kv = 2 * self.num_kv_heads * self.head_dim
            per_layer = self.hidden_size * (qo + kv)
        return self.kv_layers * per_layer

    def _dense_ffn_params(self) -> int:
        if not self.is_moe:
            return self.num_layers * self._mlp(self.intermediate_size) + self.extra_dense_params
        shared = self.moe_layers * self.num_shared_experts * self._mlp(self.intermediate_size)
        router = self.moe_layers * self.hidden_size * self.num_experts
        dense = self.num_dense_layers * self._mlp(self.dense_intermediate_size)
        return dense + shared + router + self.extra_dense_params

    @property
    def param_breakdown(self) -> ParamBreakdown:
        """Whole-model parameter counts by role (see :class:`ParamBreakdown`)."""
        per_expert = self._mlp(self.intermediate_size) * self.moe_layers
        embedding = self.vocab_size * self.hidden_size
        return ParamBreakdown(
            attention=self._attention_params(),
            dense_ffn=self._dense_ffn_params(),
            routed_experts=per_expert * self.num_experts if self.is_moe else 0,
            active_routed_experts=per_expert * self.num_active_experts if self.is_moe else 0,
            embedding=embedding,
            lm_head=0 if self.tie_embeddings else embedding,
            stored_only=self.stored_only_params,
        )

    @property
    def num_params(self) -> int:
        """Every stored parameter."""
        p = self.param_breakdown
        return p.body_dense + p.routed_experts + p.embedding + p.lm_head + p.stored_only

    @property
    def num_active_params(self) -> int:
        """Parameters one token touches, embedding tables included."""
        p = self.param_breakdown
        return p.body_dense + p.active_routed_experts + p.embedding + p.lm_head

    def weight_bytes(self, dtype_bytes: float = 2) -> int:
        """Bytes of all weights stored uniformly at ``dtype_bytes`` per parameter."""
        return math.ceil(self.num_params * dtype_bytes)

    @property
    def serving_weight_bytes(self) -> int:
        """Bytes of the weights as served (native checkpoint widths; MXFP4/FP8 aware)."""
        p = self.param_breakdown
        others = p.body_dense + p.embedding + p.lm_head + p.stored_only
        return math.ceil(others * self.weight_dtype_bytes + p.routed_experts * self.expert_bytes_per_param)

    # -------------------------------------------------------------- attention
    def kv_bytes_per_token_per_layer(self, dtype_bytes: float = 2) -> float:
        if self.mla is not None:
            return self.mla.latent_dim * dtype_bytes
        return 2 * self.num_kv_heads * self.head_dim * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: float = 2) -> int:
        """KV-cache bytes one token occupies over all KV layers."""
        return math.ceil(self.kv_layers * self.kv_bytes_per_token_per_layer(dtype_bytes))

    @property
    def kv_shard_limit(self) -> int:
        """Most ranks the KV cache splits over; more TP ranks replicate it."""
        return 1 if self.mla is not None else self.num_kv_heads

    @property
    def prefill_attention_flops_per_pair(self) -> int:
        """FLOPs of QK^T and PV for one (query, key) pair in one layer."""
        if self.mla is not None:
            m = self.mla
            return 2 * self.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
        return 4 * self.num_heads * self.head_dim

    @property
    def decode_attention_flops_per_pair(self) -> int:
        """As :attr:`prefill_attention_flops_per_pair`, with MLA's absorbed decode form."""
        if self.mla is not None:
            return 2 * self.num_heads * (self.mla.latent_dim + self.mla.kv_lora_rank)
        return self.prefill_attention_flops_per_pair


# --------------------------------------------------------------------- catalog
def _qwen3_next_80b() -> ModelConfig:
    # Qwen3-Next: 48 layers, every 4th is gated softmax attention (12 KV layers),
    # the other 36 are Gated DeltaNet layers. DeltaNet projections per layer:
    # in_proj_qkvz 2048x12288 + in_proj_ba 2048x64 + conv1d 8192x4 + out_proj
    # 4096x2048 + A_log/dt_bias/norm 192 = 33,718,464; the softmax layers' output
    # gate doubles q_proj (+2048x4096 each); shared-expert gates 2048 per layer.
    deltanet = 36 * 33_718_464
    gates = 12 * 2048 * 4096 + 48 * 2048
    # One multi-token-prediction layer (attention + MoE + fc) is stored but
    # unused in plain decoding; the paper's 81.3B total includes it.
    mtp = 1_650_462_720
    # DeltaNet state per sequence: 36 layers x (32 heads x 128 x 128 SSM state +
    # 8192 x 3 conv state) in bf16.
    state = 36 * (32 * 128 * 128 + 8192 * 3) * 2
    return ModelConfig(
        "Qwen3-Next-80B-A3B",
        48,
        2048,
        16,
        2,
        256,
        512,
        151936,
        262144,
        num_experts=512,
        num_active_experts=10,
        num_shared_experts=1,
        num_kv_layers=12,
        extra_dense_params=deltanet + gates,
        stored_only_params=mtp,
        recurrent_state_bytes=state,
    )


def _catalog() -> tuple[ModelConfig, ...]:
    mxfp4 = 4.25 / 8  # 4-bit values + one 8-bit scale per 32
    qwen7 = {
        "num_layers": 28,
        "hidden_size": 3584,
        "num_heads": 28,
        "num_kv_heads": 4,
        "head_dim": 128,
        "intermediate_size": 18944,
        "vocab_size": 152064,
        # YaRN-extended (Qwen2.5's documented rope_scaling factor 4 over 32,768): the paper runs
        # Qwen2.5-7B past its native window (Table 5: FusionBench p99 prompt 75K on Q7/L70; Table 1:
        # 58K) and its SWE-bench models "use YaRN with a 131,072-token context limit" (D.3).
        "max_context_tokens": 131072,
    }
    llama70 = {
        "num_layers": 80,
        "hidden_size": 8192,
        "num_heads": 64,
        "num_kv_heads": 8,
        "head_dim": 128,
        "intermediate_size": 28672,
        "vocab_size": 128256,
        "max_context_tokens": 131072,
    }
    oss = {
        "hidden_size": 2880,
        "num_heads": 64,
        "num_kv_heads": 8,
        "head_dim": 64,
        "intermediate_size": 2880,
        "vocab_size": 201088,
        "max_context_tokens": 131072,
        "num_active_experts": 4,
        "sliding_window": 128,
        "expert_dtype_bytes": mxfp4,
    }
    return (
        ModelConfig("Qwen2.5-7B", **qwen7),
        ModelConfig("Qwen2.5-72B", 80, 8192, 64, 8, 128, 29568, 152064, 131072),  # YaRN x4, as Qwen2.5-7B (D.3)
        ModelConfig("Llama-3.1-8B", 32, 4096, 32, 8, 128, 14336, 128256, 131072),
        ModelConfig("Llama-3.1-70B", **llama70),
        ModelConfig("Llama-3.3-70B", **llama70),
        ModelConfig("gpt-oss-20b", num_layers=24, num_experts=32, sliding_window_layers=12, **oss),
        ModelConfig("gpt-oss-120b", num_layers=36, num_experts=128, sliding_window_layers=18, **oss),
        # v0.3: no sliding window (v0.1 had 4096).
        ModelConfig("Mistral-7B", 32, 4096, 32, 8, 128, 14336, 32768, 32768),
        ModelConfig("Mistral-Nemo-12B", 40, 5120, 32, 8, 128, 14336, 131072, 131072),
        ModelConfig("Mixtral-8x7B", 32, 4096, 32, 8, 128, 14336, 32000, 32768, num_experts=8, num_active_experts=2),
        ModelConfig("Mixtral-8x22B", 56, 6144, 48, 8, 128, 16384, 32768, 65536, num_experts=8, num_active_experts=2),
        # Gemma: full multi-head attention, head_dim 256, tied embeddings.
        ModelConfig("Gemma-7B", 28, 3072, 16, 16, 256, 24576, 256000, 8192, tie_embeddings=True),
        # Gemma-2: every other layer uses a 4096-token sliding window.
        ModelConfig(
            "Gemma-2-9B",
            42,
            3584,
            16,
            8,
            256,
            14336,
            256000,
            8192,
            tie_embeddings=True,
            sliding_window=4096,
            sliding_window_layers=21,
        ),
        ModelConfig(
            "Gemma-2-27B",
            46,
            4608,
            32,
            16,
            128,
            36864,
            256000,
            8192,
            tie_embeddings=True,
            sliding_window=4096,
            sliding_window_layers=23,
        ),
        # GPTBigCode: multi-query attention, 2-matrix GELU MLP, tied embeddings
        # and a learned 8192x6144 position table (a lookup, not a GEMM).
        ModelConfig(
            "Granite-34B-code",
            88,
            6144,
            48,
            1,
            128,
            24576,
            49152,
            8192,
            gated_mlp=False,
            tie_embeddings=True,
            stored_only_params=8192 * 6144,
        ),
        # SWE-agent-LM-7B/32B are fine-tunes of Qwen2.5-Coder-7B/32B-Instruct.
        ModelConfig("SWE-agent-LM-7B", **qwen7),
        ModelConfig("SWE-agent-LM-32B", 64, 5120, 40, 8, 128, 27648, 152064, 131072),  # YaRN (D.3)
        # DeepSeek-R1 (V3 architecture): MLA attention, 3 dense + 58 MoE layers,
        # 256 routed experts (8 active) + 1 shared, FP8 weights. The KV cache is
        # the compressed MLA latent, 512 + 64 values per layer per token: an
        # approximation that ignores the FP8 scale metadata. head_dim is the QK
        # head width (128 nope + 64 rope). The 14B multi-token-prediction module
        # is left out, matching the usual 671B total.
        ModelConfig(
            "DeepSeek-R1",
            61,
            7168,
            128,
            128,
            192,
            2048,
            129280,
            163840,
            num_experts=256,
            num_active_experts=8,
            num_shared_experts=1,
            num_dense_layers=3,
            dense_intermediate_size=18432,
            mla=MLAConfig(1536, 512, 128, 64, 128),
            weight_dtype_bytes=1.0,
        ),
        _qwen3_next_80b(),
    )


MODELS: dict[str, ModelConfig] = {m.name: m for m in _catalog()}
"""Built-in catalog, keyed by canonical name."""

_SHORT_LABELS: dict[str, str] = {
    "Q2.5-7B": "Qwen2.5-7B",
    "Q7": "Qwen2.5-7B",
    "Q72": "Qwen2.5-72B",
    "L3.1-8B": "Llama-3.1-8B",
    "L8": "Llama-3.1-8B",
    "L3.1-70B": "Llama-3.1-70B",
    "L70": "Llama-3.1-70B",
    "L3.3-70B": "Llama-3.3-70B",
    "OSS-20B": "gpt-oss-20b",
    "OSS-120B": "gpt-oss-120b",
    "M-7B": "Mistral-7B",
    "Nemo-12B": "Mistral-Nemo-12B",
    "Mistral-Nemo": "Mistral-Nemo-12B",
    "Mx-8x7B": "Mixtral-8x7B",
    "Mx-8x22B": "Mixtral-8x22B",
    "G-7B": "Gemma-7B",
    "G2-9B": "Gemma-2-9B",
    "G2-27B": "Gemma-2-27B",
    "Granite-34B": "Granite-34B-code",
    "S7": "SWE-agent-LM-7B",
    "S32": "SWE-agent-LM-32B",
    "Q3N-80B": "Qwen3-Next-80B-A3B",
    "R1": "DeepSeek-R1",
}

_ALIASES: dict[str, str] = {
    **{k.lower(): v for k, v in _SHORT_LABELS.items()},
    **{name.lower(): name for name in MODELS},
}

# Organisation prefix ("meta-llama/") and instruction-tuning suffixes
# ("-Instruct", "-IT", "-Instruct-v0.3", "-Instruct-2407").
_HF_DECORATION = re.compile(r"^[^/]+/|-(instruct|it)(-v\d+(\.\d+)*|-\d{4})?$")


def _normalise(name: str) -> str:
    return _HF_DECORATION.sub("", name.strip().lower())


def get_model(name: str) -> ModelConfig:
    """The catalog entry for ``name`` (canonical, HuggingFace or figure label).

    Matching is case-insensitive. Raises ConfigError naming ``name`` and listing
    the known canonical names when nothing matches.
    """
    if isinstance(name, str):
        canonical = _ALIASES.get(name.strip().lower()) or _ALIASES.get(_normalise(name))
        if canonical is not None:
            return MODELS[canonical]
    known = ", ".join(sorted(MODELS, key=str.lower))
    raise ConfigError("model", name, f"unknown model; known models: {known}")


__all__ = ["MODELS", "MLAConfig", "ModelConfig", "ParamBreakdown", "get_model"]
