"""Vidur-format profiling data built offline from aiconfigurator-core's measured kernels.

Vidur's execution-time predictor learns per-operation times from three CSV
files: ``mlp.csv`` (every per-layer op that depends only on the batch's token
count), ``attention.csv`` (prefill and decode attention, KV-cache writes) and,
when ``tp > 1``, ``all_reduce.csv``. Vidur downloads them from a model hub at
run time; here they are *built* from the H100-SXM / H200-SXM kernel timings
that ``aiconfigurator-core`` 0.12.0 ships (vLLM 0.24.0 collection, BF16,
latencies in ms), for any :data:`shadow_sim.models.MODELS` entry, device and
tensor-parallel degree. Nothing is fetched.

Sources, per op (times are per GPU, per layer, in ms, as Vidur expects):

=========================  ====================================================
Vidur column               source
=========================  ====================================================
``attn_pre_proj``          gemm table: QKV projection, ``m = tokens``,
                           ``n = (H/tp + 2 * ceil(G/tp)) * head_dim``, ``k = hidden``
``attn_post_proj``         gemm table: output projection ``n = hidden``, ``k = H/tp * head_dim``
``mlp_up_proj``            gemm table: gate+up ``n = 2 * I/tp`` (``I/tp`` ungated), ``k = hidden``
``mlp_down_proj``          gemm table: ``n = hidden``, ``k = I/tp``
``attn_prefill``           context-attention table (FA3, BF16 KV), see below
``attn_decode``            generation-attention table (FA3, BF16 KV)
``all_reduce``             min(vLLM custom all-reduce (CUDA-graph mode), NCCL) tables
``input_layernorm``,       bandwidth model (below); vLLM fuses the residual add
``post_attention_layernorm``  into both RMSNorms, so ``add`` is 0
``mlp_act``, ``attn_rope``, bandwidth model
``attn_kv_cache_save``
=========================  ====================================================

Interpolation. GEMMs: the table is a full (m, n, k) grid (74 x 22 x 22);
``n`` and ``k`` are interpolated bilinearly (exact for times of the form
``a + b n + c k + d n k``, which both the weight-read and the FLOP bound are),
``m`` piecewise-linearly after a running maximum over ``m`` (a larger GEMM is
never cheaper). Prefill attention of one sequence is interpolated linearly in
the number of causal (query, key) pairs ``s (s + 1) / 2`` and extrapolated
linearly in pairs beyond the longest measured prompt. A chunk of ``q`` new
tokens on ``c`` cached ones costs ``max(T(q) + rho * q * c, D(1, c + q))``:
the measured prompt of ``q`` tokens, plus the cross pairs at the marginal
per-pair cost ``rho`` of the longest measured prompts, but never less than
one decode-style read of the whole KV (small chunks on long contexts are
bandwidth-bound). Decode attention ``D(b, s)`` is interpolated linearly in
``s`` for each measured batch size (extrapolated beyond the longest measured
context at that point's average time per KV token: the memory-bound regime,
where the last segment's slope can imply more than peak bandwidth) and
linearly in ``b`` between measured batch sizes.

Shapes the attention tables lack are scaled from the nearest measured shape
(same head_dim first): prefill prefers the same query-head count and scales
the part above the kernel's floor by ``H / H_ref``; decode prefers the same
KV-head count and scales by ``G / G_ref`` (KV bytes). Sliding-window layers
use the full-attention tables with the window's pair count (prefill) and
``min(context, window)`` (decode); the table's own window rows are not used.

Bandwidth model (ops the tables lack). One kernel moving ``B`` bytes takes
``kernel_floor_s + B / (hbm_bandwidth * hbm_efficiency)`` with the device's
datasheet bandwidth (``DeviceSpec``), ``hbm_efficiency = 0.8`` (the factor the
roofline model and aiconfigurator's element-wise ops use) and a 2 us floor per
kernel launch inside a CUDA graph. Bytes per token at ``a = 2`` bytes per
activation: fused add+RMSNorm ``4 * hidden * a`` (reads input and residual,
writes both), SiLU-and-mul ``3 * I/tp * a`` (GELU ``2 * I/tp * a``), RoPE
``2 * (H/tp + G/tp) * head_dim * a``, KV-cache write ``4 * G/tp * head_dim * a``.

Per-layer averaging. Vidur multiplies one layer's time by ``num_layers``.
Models whose layers differ (sliding-window layers, leading dense layers of an
MoE, linear-attention layers) get the layer-averaged time in every column, so
the product is the exact sum over layers.

MoE. Vidur 0.0.26's predictor has no MoE operation (only ``mlp_up_proj`` /
``mlp_down_proj``), so it cannot consume aiconfigurator's fused-MoE tables.
Expert GEMMs are modelled from the gemm table instead: a batch of ``T``
tokens routed top-``k`` over ``E`` experts touches ``u = E (1 - (1 - k/E)^T)``
experts on average, each running ``m = T k / u`` tokens. vLLM's fused-MoE
kernel runs them all in one launch, so the up/down columns hold one GEMM
``gemm(m, u * width, ...)`` (split into pieces at most 65536 wide, the table's
limit): it has the right FLOPs (``2 T k width hidden``) and reads each touched
expert's weights once, without a launch floor per expert. Shared experts and
the router GEMM are added; the activation column adds the token permute/unpermute traffic
``4 * T * k * hidden * a``. Expert parallelism is not modelled (experts are
TP-sharded). Weights stored in one byte or less (FP8, MXFP4) use the
per-tensor FP8 GEMM timings (the only complete narrow-dtype grid; MXFP4 is
therefore over-costed by up to ~2x in the weight-read bound).

MLA (DeepSeek) uses the generic tables with vLLM's equivalent shapes: prefill
as ``H/tp`` query heads over a 192-wide QK head, decode as MQA over the
576-wide latent; its projections are GEMMs of the MLA shapes. Linear-attention
(Gated DeltaNet) layers of Qwen3-Next are not in the attention tables: their
projections are one GEMM of their per-layer weights and their mixing is
costed by the bandwidth model (state read+write per sequence) plus
``4 * state / tp`` FLOPs per token at 30% of peak. Both are approximations,
flagged in :attr:`VidurProfiles.notes`.

Column conventions follow what ``vidur.execution_time_predictor`` 0.0.26 reads
(``_load_compute_df``, ``_load_attention_df``, ``_load_all_reduce_df``). One
deliberate choice: ``attention.csv``'s ``kv_cache_size`` is the KV length
*after* the step (cached + new), the key Vidur 0.0.26's runtime looks up
(``Batch.num_kv_tokens``); Vidur's own profiler writes the cached length
there, an inconsistency resolved here in favour of the runtime.

Invariants: building is pure and deterministic (same inputs, byte-identical
CSVs, hence the same :attr:`VidurProfiles.content_hash`); every time is finite
and > 0; the projection and MLP GEMM columns never decrease with tokens, and
attention never decreases with context or chunk size (along the batch-size
axis the measured decode kernels are not monotone at tiny contexts; the
runtime tables take care of that).
"""

from __future__ import annotations

import functools
import hashlib
import io
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from shadow_sim.hardware import DeviceSpec, get_device
from shadow_sim.models import ModelConfig, get_model
from shadowcore._validators import fraction_open_closed, non_negative, positive, positive_int
from shadowcore.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

PROFILE_SCHEMA = 1
"""Bumped whenever the builder's output changes for the same inputs."""

AIC_FRAMEWORK = "vllm"
AIC_VERSION = "0.24.0"
NCCL_VERSION = "2.29.2"
_SYSTEMS = {"H100-80GB": "h100_sxm", "H200": "h200_sxm"}
_ATTN_KERNEL = "vllm_flash_attn_fa3"
_VIDUR_BLOCK_SIZE = 16  # CacheConfig.block_size default; attention.csv rows are filtered on it
_KV_GRANULARITY = 256  # Vidur's kv_cache_prediction_granularity default
_CHUNK_GRANULARITY = 32  # Vidur rounds prefill chunks up to a multiple of 32


class ProfileCoverageError(ConfigError):
    """A requested shape lies outside what the kernel tables or the profile grid cover."""


# --------------------------------------------------------------------- knobs
@attrs.frozen
class ProfileGrid:
    """What the profiles (and hence the prediction tables) cover.

    ``max_batch_tokens``: tokens in one iteration (mlp.csv rows, all-reduce
    rows). ``max_prefill_chunk``: new tokens of one prefill chunk.
    ``max_kv_tokens``: KV length of one sequence (None: the model's context
    length, capped at 131072). ``max_decode_batch``: decodes in one iteration.
    ``points_per_octave`` sets the density of the geometric parts of the grid.
    """

    max_batch_tokens: int = attrs.field(default=16384, validator=positive_int)
    max_prefill_chunk: int = attrs.field(default=8192, validator=positive_int)
    max_kv_tokens: int | None = attrs.field(default=None)
    max_decode_batch: int = attrs.field(default=256, validator=positive_int)
    points_per_octave: int = attrs.field(default=12, validator=positive_int)

    def __attrs_post_init__(self) -> None:
        if self.max_prefill_chunk % _CHUNK_GRANULARITY:
            raise ConfigError("max_prefill_chunk", self.max_prefill_chunk, "must be a multiple of 32")
        if self.max_kv_tokens is not None and (self.max_kv_tokens < 1 or self.max_kv_tokens % _KV_GRANULARITY):
            raise ConfigError("max_kv_tokens", self.max_kv_tokens, "must be a positive multiple of 256")
        if self.max_batch_tokens % 8:
            raise ConfigError("max_batch_tokens", self.max_batch_tokens, "must be a multiple of 8")
        if self.max_batch_tokens > 32768:
            raise ConfigError("max_batch_tokens", self.max_batch_tokens, "the gemm table stops at m = 32768")
        if self.max_decode_batch > 2048:
            raise ConfigError("max_decode_batch", self.max_decode_batch, "the decode table stops at 2048")

    def kv_limit(self, model: ModelConfig) -> int:
        if self.max_kv_tokens is not None:
            return self.max_kv_tokens
        return min(131072, -(-model.max_context_tokens // _KV_GRANULARITY) * _KV_GRANULARITY)


@attrs.frozen
class BandwidthModel:
    """Cost of the element-wise ops the kernel tables lack (see module docstring)."""

    hbm_efficiency: float = attrs.field(default=0.8, validator=fraction_open_closed)
    kernel_floor_s: float = attrs.field(default=2e-6, validator=non_negative)
    activation_bytes: float = attrs.field(default=2.0, validator=positive)
    linear_attention_mfu: float = attrs.field(default=0.3, validator=fraction_open_closed)

    def kernel_ms(self, device: DeviceSpec, nbytes: np.ndarray | float) -> np.ndarray:
        bw = device.hbm_bandwidth_bytes_per_s * self.hbm_efficiency
        return (self.kernel_floor_s + np.asarray(nbytes, dtype=float) / bw) * 1e3


# ----------------------------------------------------------- kernel tables
def aiconfigurator_data_dir(device: DeviceSpec | str) -> Path:
    """Folder of aiconfigurator-core's measured tables for ``device``."""
    name = device if isinstance(device, str) else device.name
    name = get_device(name).name
    try:
        import aiconfigurator_core
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ConfigError("aiconfigurator-core", None, "not installed; pip install 'shadowprefill[sim]'") from exc
    return Path(aiconfigurator_core.__file__).parent / "systems" / "data" / _SYSTEMS[name]


def _pairs(s: np.ndarray | float) -> np.ndarray:
    s = np.asarray(s, dtype=float)
    return s * (s + 1.0) / 2.0


def _window_pairs(c: np.ndarray, q: np.ndarray, w: int) -> np.ndarray:
    """Causal (query, key) pairs of q new tokens after c cached, each query seeing <= w keys."""
    c = np.asarray(c, dtype=float)
    q = np.asarray(q, dtype=float)
    m = np.clip(w - c, 0, None)
    m = np.minimum(m, q)  # queries whose span fits the window
    return m * c + _pairs(m) + (q - m) * w


@attrs.frozen
class _Curve:
    """A non-decreasing piecewise-linear curve, extrapolated on the right.

    ``proportional``: beyond the last point ``y = y_last * x / x_last`` (the
    last point's average rate; used where the regime there is bandwidth-bound
    and the last segment's slope can imply more than peak bandwidth);
    otherwise the last segment's slope continues.
    """

    x: np.ndarray
    y: np.ndarray
    proportional: bool = False

    @classmethod
    def of(cls, x: Any, y: Any, proportional: bool = False) -> _Curve:
        order = np.argsort(x)
        x = np.asarray(x, dtype=float)[order]
        y = np.maximum.accumulate(np.asarray(y, dtype=float)[order])
        return cls(x, y, proportional)

    def __call__(self, v: Any) -> np.ndarray:
        v = np.asarray(v, dtype=float)
        out = np.interp(v, self.x, self.y)
        beyond = v > self.x[-1]
        if self.proportional:
            out = np.where(beyond, self.y[-1] * v / self.x[-1], out)
        elif len(self.x) > 1:
            slope = max((self.y[-1] - self.y[-2]) / (self.x[-1] - self.x[-2]), 0.0)
            out = np.where(beyond, self.y[-1] + slope * (v - self.x[-1]), out)
        return out

    @property
    def floor(self) -> float:
        return float(self.y[0])


class KernelTables:
    """aiconfigurator-core's measured tables for one device, with interpolation."""

    def __init__(self, device: DeviceSpec) -> None:
        import pandas as pd

        self.device = device
        root = aiconfigurator_data_dir(device)
        self.root = root
        gemm = pd.read_parquet(root / "gemm" / AIC_FRAMEWORK / AIC_VERSION / "gemm_perf.parquet")
        self._gemm = {dt: self._gemm_cube(gemm[gemm.gemm_dtype == dt]) for dt in ("bfloat16", "fp8")}
        attn = root / "attention" / AIC_FRAMEWORK / AIC_VERSION
        self._ctx = self._attention_rows(pd.read_parquet(attn / "context_attention_perf.parquet"))
        self._gen = self._attention_rows(pd.read_parquet(attn / "generation_attention_perf.parquet"))
        custom = pd.read_parquet(root / "comm" / AIC_FRAMEWORK / AIC_VERSION / "custom_allreduce_perf.parquet")
        custom = custom[(custom.backend == "vllm_graph") & (custom.allreduce_dtype == "bfloat16")]
        nccl = pd.read_parquet(root / "comm" / "nccl" / NCCL_VERSION / "nccl_perf.parquet")
        nccl = nccl[(nccl.op_name == "all_reduce") & (nccl.nccl_dtype == "half")]
        self._allreduce: dict[int, tuple[_Curve, _Curve]] = {}
        for tp in (2, 4, 8):
            a = custom[custom.num_gpus == tp]
            b = nccl[nccl.num_gpus == tp]
            self._allreduce[tp] = (
                _Curve.of(np.log(a.message_size.to_numpy()), a.latency.to_numpy()),
                _Curve.of(np.log(b.message_size.to_numpy()), b.latency.to_numpy()),
            )

    # -- gemm
    @staticmethod
    def _gemm_cube(df: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        ms, ns, ks = (np.sort(df[c].unique()).astype(float) for c in ("m", "n", "k"))
        cube = np.full((len(ms), len(ns), len(ks)), np.nan)
        mi = np.searchsorted(ms, df.m.to_numpy())
        ni = np.searchsorted(ns, df.n.to_numpy())
        ki = np.searchsorted(ks, df.k.to_numpy())
        cube[mi, ni, ki] = df.latency.to_numpy()
        # The only holes are (m, 65536, 65536); no model shape needs both at the top.
        cube = np.where(np.isnan(cube), np.inf, cube)
        cube = np.maximum.accumulate(cube, axis=0)  # never cheaper with more rows
        return ms, ns, ks, cube

    def gemm_ms(self, m: Any, n: float, k: float, dtype: str = "bfloat16") -> np.ndarray:
        """Latency (ms) of an ``m x k`` by ``k x n`` GEMM; ``m`` may be an array of floats >= 1."""
        ms, ns, ks, cube = self._gemm[dtype]
        m = np.asarray(m, dtype=float)
        if np.any(m > ms[-1]) or n > ns[-1] or k > ks[-1]:
            raise ProfileCoverageError(
                "gemm", (float(np.max(m)), n, k), f"beyond the table ({ms[-1]:.0f}, {ns[-1]:.0f}, {ks[-1]:.0f})"
            )
        n = max(float(n), ns[0])
        k = max(float(k), ks[0])

        def bracket(grid: np.ndarray, v: float) -> tuple[int, int, float]:
            hi = int(np.searchsorted(grid, v))
            if hi == 0:
                return 0, 0, 0.0
            lo = hi - 1
            if grid[hi] == v:
                return hi, hi, 0.0
            return lo, hi, (v - grid[lo]) / (grid[hi] - grid[lo])

        n0, n1, fn = bracket(ns, n)
        k0, k1, fk = bracket(ks, k)
        curve = (
            cube[:, n0, k0] * (1 - fn) * (1 - fk)
            + cube[:, n1, k0] * fn * (1 - fk)
            + cube[:, n0, k1] * (1 - fn) * fk
            + cube[:, n1, k1] * fn * fk
        )
        return np.interp(np.maximum(m, 1.0), ms, np.maximum.accumulate(curve))

    # -- attention
    @staticmethod
    def _attention_rows(df: pd.DataFrame) -> pd.DataFrame:
        return df[
            (df.kernel_source == _ATTN_KERNEL)
            & (df.kv_cache_dtype == "bfloat16")
            & (df.window_size == 0)
            & (df.beam_width == 1)
        ]

    @staticmethod
    def _nearest_shape(df: pd.DataFrame, h: int, g: int, d: int, prefer: str) -> tuple[int, int, int]:
        shapes = df[["num_heads", "num_key_value_heads", "head_dim"]].drop_duplicates().to_numpy()
        if len(shapes) == 0:  # pragma: no cover - the shipped tables are never empty
            raise ProfileCoverageError("attention", (h, g, d), "no measured shapes")

        def rank(s: np.ndarray) -> tuple:
            hs, gs, ds = (int(x) for x in s)
            dh, dg = abs(math.log(h / hs)), abs(math.log(g / gs))
            primary, secondary = (dh, dg) if prefer == "heads" else (dg, dh)
            return (abs(math.log(d / ds)), primary > 0, secondary > 0, primary, secondary, hs, gs)

        best = min(shapes, key=rank)
        return int(best[0]), int(best[1]), int(best[2])

    @staticmethod
    def _scaled(curve_y: np.ndarray, factor: float) -> np.ndarray:
        floor = float(np.min(curve_y))
        return floor + (curve_y - floor) * factor

    @functools.lru_cache(maxsize=64)  # noqa: B019 - instances live as long as the process cache
    def prefill_curve(self, h: int, g: int, d: int) -> tuple[_Curve, float, tuple[int, int, int]]:
        """Batch-1 causal prefill time T(s) (ms) as a curve over pairs, its marginal ms/pair, the shape used."""
        ref = self._nearest_shape(self._ctx, h, g, d, prefer="heads")
        rows = self._ctx[
            (self._ctx.num_heads == ref[0])
            & (self._ctx.num_key_value_heads == ref[1])
            & (self._ctx.head_dim == ref[2])
            & (self._ctx.batch_size == 1)
        ].sort_values("isl")
        s = rows.isl.to_numpy(dtype=float)
        y = np.maximum.accumulate(rows.latency.to_numpy(dtype=float))
        factor = (h / ref[0]) * (d / ref[2])
        y = self._scaled(y, factor)
        pairs = _pairs(s)
        curve = _Curve.of(pairs, y)
        rho = max((curve.y[-1] - curve.y[-2]) / (curve.x[-1] - curve.x[-2]), 0.0)
        return curve, rho, ref

    @functools.lru_cache(maxsize=64)  # noqa: B019
    def decode_surface(self, h: int, g: int, d: int) -> tuple[Callable[[Any, Any], np.ndarray], tuple[int, int, int]]:
        """D(b, s): decode attention time (ms) of b sequences of KV length s."""
        ref = self._nearest_shape(self._gen, h, g, d, prefer="kv_heads")
        rows = self._gen[
            (self._gen.num_heads == ref[0]) & (self._gen.num_key_value_heads == ref[1]) & (self._gen.head_dim == ref[2])
        ]
        factor = (g / ref[1]) * (d / ref[2])
        bs = np.sort(rows.batch_size.unique()).astype(float)
        curves = []
        for b in bs:
            r = rows[rows.batch_size == b].sort_values("step")
            y = self._scaled(np.maximum.accumulate(r.latency.to_numpy(dtype=float)), factor)
            curves.append(_Curve.of(r.step.to_numpy(dtype=float) + 1.0, y, proportional=True))  # step cached + 1 new

        def surface(b: Any, s: Any) -> np.ndarray:
            b = np.asarray(b, dtype=float)
            s = np.maximum(np.asarray(s, dtype=float), 1.0)
            if np.any(b > bs[-1]):
                raise ProfileCoverageError("decode batch", float(np.max(b)), f"the decode table stops at {bs[-1]:.0f}")
            b, s = np.broadcast_arrays(b, s)
            out = np.empty(b.shape)
            hi = np.clip(np.searchsorted(bs, b), 0, len(bs) - 1)
            lo = np.clip(hi - 1, 0, None)
            for i in np.unique(hi):
                sel = hi == i
                j = lo[sel][0]
                yh = curves[i](s[sel])
                if i == j or bs[i] == bs[j]:
                    out[sel] = yh
                    continue
                yl = curves[j](s[sel])
                f = (b[sel] - bs[j]) / (bs[i] - bs[j])
                out[sel] = np.where(b[sel] >= bs[i], yh, yl + f * (yh - yl))
            # Linear-in-b blending of two non-decreasing curves stays non-decreasing in s;
            # along b, enforce it on the evaluated points.
            return out

        return surface, ref

    # -- all-reduce
    def allreduce_ms(self, tp: int, elements: Any) -> np.ndarray:
        """Latency (ms) of a BF16 all-reduce of ``elements`` values over ``tp`` GPUs (vLLM's faster path)."""
        if tp not in self._allreduce:
            raise ProfileCoverageError("tensor_parallel", tp, "all-reduce is measured for 2, 4 and 8 GPUs")
        x = np.log(np.maximum(np.asarray(elements, dtype=float), 1.0))
        custom, nccl = self._allreduce[tp]
        return np.minimum(custom(x), nccl(x))


@functools.lru_cache(maxsize=4)
def kernel_tables(device_name: str) -> KernelTables:
    """Cached :class:`KernelTables` per device name."""
    return KernelTables(get_device(device_name))


# ------------------------------------------------------------------ grids
def _geometric(lo: int, hi: int, per_octave: int, multiple: int = 1) -> list[int]:
    """Integers from lo to hi (both included), ~per_octave per doubling, rounded to ``multiple``."""
    out = {lo, hi}
    if hi > lo:
        n = max(1, math.ceil(math.log2(hi / lo) * per_octave))
        for v in np.geomspace(lo, hi, n + 1):
            out.add(round(float(v) / multiple) * multiple)
    return sorted(v for v in out if lo <= v <= hi)


def token_grid(grid: ProfileGrid) -> list[int]:
    """num_tokens rows of mlp.csv / all_reduce.csv: 1..256 all, then geometric, multiples of 8."""
    dense = list(range(1, min(256, grid.max_batch_tokens) + 1))
    tail = _geometric(256, grid.max_batch_tokens, grid.points_per_octave * 2, multiple=8)
    return sorted(set(dense) | set(tail))


def kv_grid(limit: int, per_octave: int) -> list[int]:
    """kv_cache_size rows: every 256 up to 4096, then geometric multiples of 256."""
    dense = list(range(0, min(4096, limit) + 1, _KV_GRANULARITY))
    tail = _geometric(4096, limit, per_octave, multiple=_KV_GRANULARITY) if limit > 4096 else []
    return sorted(set(dense) | set(tail))


def chunk_grid(grid: ProfileGrid) -> list[int]:
    """prefill_chunk_size rows: every 32 up to 512, then geometric multiples of 32."""
    dense = list(range(32, min(512, grid.max_prefill_chunk) + 1, 32))
    tail = (
        _geometric(512, grid.max_prefill_chunk, grid.points_per_octave, multiple=32)
        if grid.max_prefill_chunk > 512
        else []
    )
    return sorted(set(dense) | set(tail))


def decode_batch_grid(grid: ProfileGrid) -> list[int]:
    dense = list(range(1, min(32, grid.max_decode_batch) + 1))
    tail = _geometric(32, grid.max_decode_batch, grid.points_per_octave) if grid.max_decode_batch > 32 else []
    return sorted(set(dense) | set(tail))


# ----------------------------------------------------------- per-model shapes
@attrs.frozen
class _Shapes:
    """Per-GPU shapes of one model at one TP degree."""

    tp: int
    h: int
    heads: int  # query heads per GPU
    kv_heads: int  # KV heads per GPU (>= 1; replicated below one per GPU)
    head_dim: int
    ctx_shape: tuple[int, int, int]  # (heads, kv_heads, head_dim) for prefill tables
    gen_shape: tuple[int, int, int]
    kv_bytes_token_layer: float  # per GPU
    full_layers: int
    window_layers: int
    linear_layers: int
    window: int


def _shapes(model: ModelConfig, tp: int, a: float) -> _Shapes:
    if model.num_heads % tp:
        raise ConfigError("tensor_parallel", tp, f"must divide {model.name}'s {model.num_heads} query heads")
    heads = model.num_heads // tp
    if model.mla is not None:
        m = model.mla
        ctx = (heads, 1, m.qk_nope_head_dim + m.qk_rope_head_dim)
        gen = (heads, 1, m.latent_dim)
        kv_heads = 1
        kv_bytes = m.latent_dim * a
        head_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
    else:
        kv_heads = max(1, math.ceil(model.num_kv_heads / tp))
        ctx = gen = (heads, kv_heads, model.head_dim)
        kv_bytes = 2 * kv_heads * model.head_dim * a
        head_dim = model.head_dim
    win = model.sliding_window_layers
    return _Shapes(
        tp=tp,
        h=model.hidden_size,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        ctx_shape=ctx,
        gen_shape=gen,
        kv_bytes_token_layer=kv_bytes,
        full_layers=model.kv_layers - win,
        window_layers=win,
        linear_layers=model.num_layers - model.kv_layers,
        window=model.sliding_window or 0,
    )


# ------------------------------------------------------------------ result
@attrs.frozen
class VidurProfiles:
    """The three Vidur profile tables for one (model, device, tp), as CSV text."""

    model: ModelConfig
    device: DeviceSpec
    tp: int
    grid: ProfileGrid
    csv: dict[str, str] = attrs.field(eq=False, repr=False)
    notes: tuple[str, ...] = ()

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(sorted(self.csv))

    @functools.cached_property
    def content_hash(self) -> str:
        """sha256 over the CSV file names and bytes (the cache key's data part)."""
        return hash_profile_texts(self.csv)

    @classmethod
    def from_dir(
        cls,
        directory: str | Path,
        model: str | ModelConfig,
        device: str | DeviceSpec = "H100-80GB",
        tp: int = 1,
        grid: ProfileGrid | None = None,
    ) -> VidurProfiles:
        """Profiles read from ``directory`` (e.g. hand-edited or measured ones); hashed by content."""
        d = Path(directory)
        names = ["mlp.csv", "attention.csv"] + (["all_reduce.csv"] if tp > 1 else [])
        missing = [n for n in names if not (d / n).is_file()]
        if missing:
            raise ConfigError("profile_dir", str(d), f"missing {', '.join(missing)}")
        model = get_model(model) if isinstance(model, str) else model
        device = get_device(device) if isinstance(device, str) else device
        csv = {n: (d / n).read_text() for n in names}
        return cls(model, device, tp, grid or ProfileGrid(), csv, (f"profiles read from {d}",))

    def write(self, directory: str | Path) -> dict[str, Path]:
        """Write the CSVs into ``directory``; return name -> path."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        out = {}
        for name, text in self.csv.items():
            p = d / name
            p.write_text(text)
            out[name] = p
        return out


def hash_profile_texts(texts: dict[str, str]) -> str:
    h = hashlib.sha256()
    for name in sorted(texts):
        h.update(name.encode())
        h.update(b"\0")
        h.update(texts[name].encode())
        h.update(b"\0")
    return h.hexdigest()


def hash_profile_dir(directory: str | Path, names: tuple[str, ...]) -> str:
    d = Path(directory)
    return hash_profile_texts({n: (d / n).read_text() for n in names})


def _to_csv(df: pd.DataFrame) -> str:
    buf = io.StringIO()
    df.to_csv(buf, index=False, float_format="%.9g", lineterminator="\n")
    return buf.getvalue()


def vidur_model_name(model: ModelConfig) -> str:
    """The name the Vidur model-config subclass for ``model`` is registered under."""
    return f"shadowprefill/{model.name}"


# ------------------------------------------------------------------ builder
def build_profiles(
    model: str | ModelConfig,
    device: str | DeviceSpec = "H100-80GB",
    tp: int = 1,
    grid: ProfileGrid | None = None,
    bandwidth: BandwidthModel | None = None,
) -> VidurProfiles:
    """Build Vidur's ``mlp.csv``, ``attention.csv`` (and ``all_reduce.csv`` if tp > 1).

    Pure in its arguments, so a process builds each configuration once
    (``_BUILT``: every engine instance of a run asks for its model's tables,
    whose cache key hashes these CSV texts; rendering them is most of the
    cost of building a run)."""
    model = get_model(model) if isinstance(model, str) else model
    device = get_device(device) if isinstance(device, str) else device
    grid = grid or ProfileGrid()
    if tp not in (1, 2, 4, 8):
        raise ConfigError("tensor_parallel", tp, "must be 1, 2, 4 or 8 (the all-reduce tables' sizes)")
    bandwidth = bandwidth or BandwidthModel()
    try:
        key = (model, device, tp, grid, bandwidth)
        built = _BUILT.get(key)
    except TypeError:  # an unhashable field somewhere: build it
        return _build_profiles(model, device, tp, grid, bandwidth)
    if built is None:
        built = _BUILT[key] = _build_profiles(model, device, tp, grid, bandwidth)
    return built


#: build_profiles' results in this process, by (model, device, tp, grid, bandwidth); VidurProfiles are frozen.
_BUILT: dict[tuple, VidurProfiles] = {}


def _build_profiles(model: ModelConfig, device: DeviceSpec, tp: int, grid: ProfileGrid,
                    bandwidth: BandwidthModel) -> VidurProfiles:
    b = _ProfileBuilder(model, device, tp, grid, bandwidth)
    mlp = b.mlp_table()
    prefill_rows, decode_rows = b.attention_tables()
    csv = {"mlp.csv": _to_csv(mlp), "attention.csv": _to_csv(_concat(prefill_rows, decode_rows))}
    if tp > 1:
        ar = b.all_reduce_table()
        _check_finite("all_reduce.csv", ar)
        csv["all_reduce.csv"] = _to_csv(ar)
    _check_finite("mlp.csv", mlp)
    _check_finite("attention.csv", prefill_rows.drop(columns=["time_stats.attn_decode.median"]))
    _check_finite("attention.csv", decode_rows.drop(columns=["time_stats.attn_prefill.median"]))
    return VidurProfiles(model, device, tp, grid, csv, tuple(b.notes))


def _concat(*frames: pd.DataFrame) -> pd.DataFrame:
    import pandas as pd

    return pd.concat(frames, ignore_index=True)


class _ProfileBuilder:
    """One model on one device at one TP degree: the per-layer operation times
    Vidur's tables hold, from the kernel tables and the bandwidth model.

    Every time is per layer (totals over the model's layers divided by its
    layer count), in milliseconds, over the token grid ``tokens`` (mlp.csv) or
    the (context, chunk) and (batch, context) grids (attention.csv). ``notes``
    collects every approximation made, in the order it was made.
    """

    def __init__(self, model: ModelConfig, device: DeviceSpec, tp: int, grid: ProfileGrid, bw: BandwidthModel):
        self.model, self.device, self.tp, self.grid, self.bw = model, device, tp, grid, bw
        self.k = kernel_tables(device.name)
        self.a = bw.activation_bytes
        self.sh = _shapes(model, tp, self.a)
        self.notes: list[str] = []
        self.tokens = np.asarray(token_grid(grid), dtype=float)
        self.wdt = "fp8" if model.weight_dtype_bytes <= 1 else "bfloat16"
        self.edt = "fp8" if model.expert_bytes_per_param <= 1 else "bfloat16"
        self.gate = 2 if model.gated_mlp else 1
        self.act_bytes = (3 if model.gated_mlp else 2) * self.a

    # ----- helpers over the token grid
    def g(self, m: Any, n: float, kk: float, dt: str | None = None) -> np.ndarray:
        return self.k.gemm_ms(m, n, kk, dt or self.wdt)

    def ew(self, nbytes_per_token: float) -> np.ndarray:
        return self.bw.kernel_ms(self.device, self.tokens * nbytes_per_token)

    # ----- mlp.csv
    def attention_projections(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-layer (pre-attention projection, post projection, rope)."""
        model, sh, T, g = self.model, self.sh, self.tokens, self.g
        attn_layers = sh.full_layers + sh.window_layers
        if model.mla is not None:
            m = model.mla
            qk = m.qk_nope_head_dim + m.qk_rope_head_dim
            q_proj = (
                g(T, m.q_lora_rank, sh.h) + g(T, sh.heads * qk, m.q_lora_rank)
                if m.q_lora_rank
                else g(T, sh.heads * qk, sh.h)
            )
            pre_attn = (
                q_proj + g(T, m.latent_dim, sh.h)
                + g(T, sh.heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
            )
            post_attn = g(T, sh.h, sh.heads * m.v_head_dim)
            rope = self.ew(2 * (sh.heads + 1) * m.qk_rope_head_dim * self.a)
            self.notes.append("MLA attention costed with equivalent MHA (prefill) / MQA-over-latent (decode) FA3 shapes")
        else:
            pre_attn = g(T, (sh.heads + 2 * sh.kv_heads) * sh.head_dim, sh.h)
            post_attn = g(T, sh.h, sh.heads * sh.head_dim)
            rope = self.ew(2 * (sh.heads + sh.kv_heads) * sh.head_dim * self.a)
        pre, post, rope = pre_attn * attn_layers, post_attn * attn_layers, rope * attn_layers
        if sh.linear_layers:
            per_layer = model.extra_dense_params / sh.linear_layers
            pre = pre + g(T, per_layer / sh.h / self.tp, sh.h) * sh.linear_layers
            self.notes.append("linear-attention layers: projections as one GEMM, mixing by the bandwidth/FLOP model")
        L = model.num_layers
        return pre / L, post / L, rope / L

    def dense_mlp(self, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(up, down, activation) of one dense MLP of ``width`` (whole layer)."""
        T, tp = self.tokens, self.tp
        return (self.g(T, self.gate * width / tp, self.sh.h), self.g(T, self.sh.h, width / tp),
                self.ew(self.act_bytes * width / tp))

    def grouped_experts(self, touched: np.ndarray, per_expert: np.ndarray, n: float, kdim: float) -> np.ndarray:
        """One fused launch over the touched experts: m = rows per expert, n =
        touched x expert width (<= 65536-wide pieces, the table's limit)."""
        out = np.empty_like(self.tokens)
        for i, (u, m_e) in enumerate(zip(touched, per_expert, strict=True)):
            pieces = math.ceil(u * n / 65536)
            out[i] = pieces * self.g(m_e, u * n / pieces, kdim, self.edt).item()
        return np.maximum.accumulate(out)  # T ascending: more tokens never cheaper

    def moe_mlp(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-layer (up, down, activation) of a MoE model (dense layers included)."""
        model, sh, T, tp, a = self.model, self.sh, self.tokens, self.tp, self.a
        E, kk_, I = model.num_experts, model.num_active_experts, model.intermediate_size
        touched = E * (1.0 - (1.0 - kk_ / E) ** T)
        per_expert = T * kk_ / touched
        up_m = self.grouped_experts(touched, per_expert, self.gate * I / tp, sh.h) + self.g(T, E, sh.h, "bfloat16")
        down_m = self.grouped_experts(touched, per_expert, sh.h, I / tp)
        act_m = (self.bw.kernel_ms(self.device, T * kk_ * self.act_bytes * I / tp)
                 + self.bw.kernel_ms(self.device, T * kk_ * 4 * sh.h * a))
        if model.num_shared_experts:
            su, sd, sa = self.dense_mlp(model.num_shared_experts * I)
            up_m, down_m, act_m = up_m + su, down_m + sd, act_m + sa
        up, down, act = up_m * model.moe_layers, down_m * model.moe_layers, act_m * model.moe_layers
        if model.num_dense_layers:
            du, dd, da = self.dense_mlp(model.dense_intermediate_size)
            up = up + du * model.num_dense_layers
            down = down + dd * model.num_dense_layers
            act = act + da * model.num_dense_layers
        self.notes.append(
            "MoE: Vidur 0.0.26 has no MoE op; expert GEMMs from the gemm table with the expected touched experts"
        )
        if model.expert_bytes_per_param < 1:
            self.notes.append("sub-byte experts (MXFP4) costed with per-tensor FP8 GEMM timings")
        L = model.num_layers
        return up / L, down / L, act / L

    def mlp_table(self) -> pd.DataFrame:
        import pandas as pd

        model = self.model
        pre, post, rope = self.attention_projections()
        up, down, act = self.moe_mlp() if model.is_moe else self.dense_mlp(model.intermediate_size)
        norm = self.ew(4 * self.sh.h * self.a)
        return pd.DataFrame(
            {
                "n_head": model.num_heads,
                "n_kv_head": _vidur_kv_heads(model),
                "n_embd": model.hidden_size,
                "n_expanded_embd": model.intermediate_size,
                "use_gated_mlp": model.gated_mlp,
                "vocab_size": model.vocab_size,
                "num_tensor_parallel_workers": self.tp,
                "num_tokens": self.tokens.astype(int),
                "time_stats.attn_pre_proj.median": pre,
                "time_stats.attn_post_proj.median": post,
                "time_stats.mlp_up_proj.median": up,
                "time_stats.mlp_down_proj.median": down,
                "time_stats.mlp_act.median": act,
                "time_stats.input_layernorm.median": norm,
                "time_stats.post_attention_layernorm.median": norm,
                "time_stats.attn_rope.median": rope,
                "time_stats.add.median": 0.0,
            }
        )

    # ----- attention.csv
    def linear_mix(self, tokens: np.ndarray, seqs: np.ndarray) -> np.ndarray:
        """Gated DeltaNet layer mixing: state read+write per sequence, 4 FLOPs per state value per token."""
        state = self.model.recurrent_state_bytes / max(self.sh.linear_layers, 1) / self.tp
        flops = 4 * (state / self.a) * tokens / (self.device.bf16_flops_per_s * self.bw.linear_attention_mfu) * 1e3
        return self.bw.kernel_ms(self.device, 2 * state * seqs) + flops

    def attention_times(
        self, c_p: np.ndarray, q_p: np.ndarray, b_d: np.ndarray, kv_d: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Per-layer prefill times at (context before, chunk) and decode times at (batch, context)."""
        sh = self.sh
        pcurve, rho, ctx_ref = self.k.prefill_curve(*sh.ctx_shape)
        dsurf, gen_ref = self.k.decode_surface(*sh.gen_shape)
        if ctx_ref != sh.ctx_shape or gen_ref != sh.gen_shape:
            self.notes.append(f"attention shape {sh.ctx_shape}/{sh.gen_shape} scaled from measured {ctx_ref}/{gen_ref}")
        t_pre = np.maximum(pcurve(_pairs(q_p)) + rho * q_p * c_p, dsurf(np.ones_like(q_p), c_p + q_p)) * sh.full_layers
        t_dec = dsurf(b_d, kv_d) * sh.full_layers
        if sh.window_layers:
            w = sh.window
            qw = np.minimum(q_p, w)
            extra = np.clip(_window_pairs(c_p, q_p, w) - _pairs(qw), 0, None)
            t_win = np.maximum(pcurve(_pairs(qw)) + rho * extra, dsurf(np.ones_like(q_p), np.minimum(c_p + q_p, w)))
            t_pre = t_pre + t_win * sh.window_layers
            t_dec = t_dec + dsurf(b_d, np.minimum(kv_d, w)) * sh.window_layers
            self.notes.append(f"sliding window {w}: full-attention tables with the window's pairs / context")
        if sh.linear_layers:
            t_pre = t_pre + self.linear_mix(q_p, np.ones_like(q_p)) * sh.linear_layers
            t_dec = t_dec + self.linear_mix(b_d, b_d) * sh.linear_layers
        L = self.model.num_layers
        return t_pre / L, t_dec / L

    def attention_tables(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        """attention.csv's prefill rows and decode rows."""
        import pandas as pd

        model, sh, grid = self.model, self.sh, self.grid
        kvs = np.asarray(kv_grid(grid.kv_limit(model), grid.points_per_octave), dtype=float)
        chunks = np.asarray(chunk_grid(grid), dtype=float)
        kv_p, q_p = np.meshgrid(kvs, chunks, indexing="ij")
        keep = kv_p >= q_p
        kv_p, q_p = kv_p[keep], q_p[keep]
        bsz = np.asarray(decode_batch_grid(grid), dtype=float)
        b_d, kv_d = np.meshgrid(bsz, kvs, indexing="ij")
        b_d, kv_d = b_d.ravel(), kv_d.ravel()
        t_pre, t_dec = self.attention_times(kv_p - q_p, q_p, b_d, kv_d)
        kv_save_bytes = sh.kv_bytes_token_layer * 2 * (sh.full_layers + sh.window_layers) / model.num_layers
        common = {
            "n_embd": model.hidden_size,
            "n_q_head": model.num_heads,
            "n_kv_head": _vidur_kv_heads(model),
            "block_size": _VIDUR_BLOCK_SIZE,
            "num_tensor_parallel_workers": self.tp,
        }
        prefill_rows = pd.DataFrame(
            {
                **common,
                "batch_size": 1,
                "prefill_chunk_size": q_p.astype(int),
                "kv_cache_size": kv_p.astype(int),
                "is_prefill": True,
                "time_stats.attn_prefill.median": t_pre,
                "time_stats.attn_decode.median": np.nan,
                "time_stats.attn_kv_cache_save.median": self.bw.kernel_ms(self.device, q_p * kv_save_bytes),
            }
        )
        decode_rows = pd.DataFrame(
            {
                **common,
                "batch_size": b_d.astype(int),
                "prefill_chunk_size": 0,
                "kv_cache_size": kv_d.astype(int),
                "is_prefill": False,
                "time_stats.attn_prefill.median": np.nan,
                "time_stats.attn_decode.median": t_dec,
                "time_stats.attn_kv_cache_save.median": self.bw.kernel_ms(self.device, b_d * kv_save_bytes),
            }
        )
        return prefill_rows, decode_rows

    # ----- all_reduce.csv
    def all_reduce_table(self) -> pd.DataFrame:
        import pandas as pd

        elements = self.tokens * self.model.hidden_size
        return pd.DataFrame(
            {
                "num_workers": self.tp,
                "devices_per_node": self.tp,
                "collective": "all_reduce",
                "size": (elements * 2).astype(np.int64),  # bytes; Vidur divides by 2 * n_embd
                "time_stats.all_reduce.median": self.k.allreduce_ms(self.tp, elements),
            }
        )


def _check_finite(name: str, df: pd.DataFrame) -> None:
    times = df[[c for c in df.columns if c.startswith("time_stats.")]].to_numpy(dtype=float)
    if not np.all(np.isfinite(times)) or np.any(times < 0):
        raise ProfileCoverageError(name, None, "a profile time is not finite and >= 0")


def _vidur_kv_heads(model: ModelConfig) -> int:
    return model.num_heads if model.mla is not None else model.num_kv_heads


__all__ = [
    "PROFILE_SCHEMA",
    "BandwidthModel",
    "KernelTables",
    "ProfileCoverageError",
    "ProfileGrid",
    "VidurProfiles",
    "aiconfigurator_data_dir",
    "build_profiles",
    "hash_profile_dir",
    "hash_profile_texts",
    "kernel_tables",
    "vidur_model_name",
]
