"""Iteration latency from Vidur's execution-time predictor, trained offline.

Pipeline, once per (model, device, tp, profile contents, predictor grid):

1. :func:`shadow_sim.vidur_profiles.build_profiles` derives Vidur-format
   ``mlp.csv`` / ``attention.csv`` / ``all_reduce.csv`` from aiconfigurator-core's
   measured H100/H200 kernels (no network).
2. Vidur 0.0.26's random-forest ``SklearnExecutionTimePredictor`` is trained
   on them, with its two hub hooks overridden (``_get_input_files`` returns the
   local CSVs, ``_load_predictions_from_hf`` is skipped), on a trimmed grid
   (:class:`TrainingConfig`: 100 trees, depth 16, 3 folds) under a ``rich``
   progress bar. Its prediction tables (every op at every grid key) are
   exported to ``tables.npz`` in the cache, keyed by a sha256 of the CSV
   *contents* plus the grid and training settings (Vidur's own cache is keyed
   by its config only, so an edited profile would silently reuse stale
   tables; Vidur's working files are deleted after export).
3. At run time :class:`VidurLatencyModel` looks predictions up in flat
   Python lists: a call costs a few microseconds. Construction with a warm
   cache still rebuilds the profiles (pandas + aiconfigurator tables, ~1-2 s)
   to hash them, but never imports Vidur.

Lookup rule (Vidur 0.0.26's ``SklearnExecutionTimePredictor``): per-layer ops
at the batch's token count rounded up to 8; prefill attention per chunk at
``(ceil256(cached + new), ceil32(new))``; decode attention at ``(decodes,
ceil256(mean context))`` times 1.1 for GQA batches of more than one; two TP
all-reduces per layer; everything times ``num_layers``. That sum is Vidur's
``model_time`` and :meth:`VidurLatencyModel.vidur_model_time_s` returns it
unchanged. :meth:`~VidurLatencyModel.predict_s` departs from it in three
documented ways, all needed for the ``LatencyModel`` invariants:

* Monotone envelopes. A random forest is piecewise constant and not monotone;
  every table gets a running maximum along each axis. Vidur's decode rule is
  itself not monotone (adding a short decode lowers the mean context, the
  rounding to 256 can drop a bucket, and the measured kernels read KV faster
  per token with more sequences), so decode attention is tabulated over
  (decodes ``b``, total context ``S``) as the least envelope ``A'`` of
  Vidur's value ``A(b, S) = D(b, ceil256(S / b))`` with ``A'(b + 1, S + x) >=
  A'(b, S) - delta`` for every ``x >= 0``, where ``delta`` is the cost each
  decode adds outside attention (per-decode overhead plus sampling): the total
  never decreases when a decode is added. ``S`` is rounded up to a multiple of
  256 below 65536 and to a 1/256 geometric grid above. The envelope never goes
  below Vidur; on homogeneous decode batches it is up to ~15% above it (a few
  long sequences, which the mean rule cannot tell apart from many short ones
  holding the same KV, are measured slower per KV token).
* A prefill chunk of one token is a prefill (Vidur counts any one-token
  request as a decode).
* Costs outside ``model_time``, added explicitly: KV-cache writes (Vidur
  predicts them but leaves them out), the input embedding gather, the LM
  head (``max(weight read, FLOPs at 60% of peak)`` for one row per sequence),
  final norm + sampling (three passes over FP32 logits per sequence), all
  with the profiles' bandwidth model (``DeviceSpec`` bandwidth x 0.8, 2 us
  per kernel); and CPU overhead, ``iteration_overhead_s`` (1 ms) per
  iteration plus ``decode_seq_overhead_s`` (5 us) per decode, the same
  constants as :class:`~shadow_sim.roofline.RooflineLatencyModel` so the two
  models differ only in GPU time.

Coverage is explicit: a decode batch beyond ``max_decode_batch``, a chunk
beyond ``max_prefill_chunk``, a KV length beyond ``max_kv_tokens`` or a batch
beyond ``max_batch_tokens`` tokens raises
:class:`~shadow_sim.vidur_profiles.ProfileCoverageError` naming the value and
the limit; nothing is clamped.

Agreement with the roofline model (Llama-3.1-8B TP1 and Llama-3.1-70B TP4
on H100-80GB, default knobs), ratio vidur / roofline on the grid of
``tests/sim/test_vidur_latency.py`` (decodes {1, 8, 32, 128} x contexts {512,
4096, 16384, 65536}; prefill chunks {256, 1024, 4096, 8192} x cached {0, 4096,
32768}): median 1.02 (8B) / 1.08 (70B), range 0.69-1.38 / 0.79-1.29. Vidur is
10-38% slower on small, bandwidth-bound batches (measured per-kernel floors:
~12 us per layer of decode attention, element-wise kernels, GEMMs at m = 128
~25% slower than at m = 1, none of which the roofline has) and 10-31% faster
on large prefills (measured GEMMs reach ~77% of peak FLOPs and FA3 ~70%,
against the roofline's fixed 60% / 45%). The test keeps the median within
[0.8, 1.25] and every point within [0.6, 1.6].

Invariants (those of :class:`shadowcore.latency.LatencyModel`): ``predict_s``
is pure and deterministic, returns 0.0 for a batch with no tokens and never
decreases when a decode, a prefill token or context is added.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from shadow_sim.hardware import DeviceSpec, get_device, tensor_parallel_degree
from shadow_sim.models import ModelConfig, get_model
from shadow_sim.vidur_profiles import (
    PROFILE_SCHEMA,
    BandwidthModel,
    ProfileCoverageError,
    ProfileGrid,
    VidurProfiles,
    build_profiles,
    vidur_model_name,
)
from shadowcore._validators import fraction_open_closed, non_negative, positive, positive_int
from shadowcore.errors import ConfigError
from shadowcore.latency import BatchShape, PrefillChunk, chunked_prefill_s

TABLE_SCHEMA = 1
"""Bumped whenever the exported tables' layout or meaning changes."""

ENV_CACHE = "SHADOWPREFILL_CACHE"
"""Environment variable: the shadowprefill cache root (tables go to ``<root>/vidur``)."""

_DENSE_S = 65536  # total decode context: every 256 up to here, geometric above
_GEO_STEPS_PER_DOUBLING = 178  # ~ln(2)/ln(1 + 1/256): 0.39% steps


def default_cache_dir() -> Path:
    """``$SHADOWPREFILL_CACHE/vidur`` if set, else ``~/.cache/shadowprefill/vidur``."""
    root = os.environ.get(ENV_CACHE)
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "shadowprefill"
    return base / "vidur"


@attrs.frozen
class TrainingConfig:
    """Vidur random-forest settings (one grid point: GridSearchCV fits each fold once)."""

    num_estimators: int = attrs.field(default=100, validator=positive_int)
    max_depth: int = attrs.field(default=16, validator=positive_int)
    min_samples_split: int = attrs.field(default=2, validator=positive_int)
    k_fold_cv_splits: int = attrs.field(default=3, validator=positive_int)
    num_threads: int = attrs.field(default=-1)


#: Seed of the random forests: the same profiles always train the same tables.
TRAINING_RANDOM_STATE = 0


def _vidur_version() -> str:
    from importlib.metadata import version

    return version("vidur")


def cache_key(profiles: VidurProfiles, training: TrainingConfig) -> str:
    """sha256 of the profile CSV contents, the coverage grid, the training settings and versions."""
    payload = {
        "profiles": profiles.content_hash,
        "grid": attrs.asdict(profiles.grid),
        "kv_limit": profiles.grid.kv_limit(profiles.model),
        "training": attrs.asdict(training),
        "model": profiles.model.name,
        "device": profiles.device.name,
        "tp": profiles.tp,
        "num_layers": profiles.model.num_layers,
        "vidur": _vidur_version(),
        "table_schema": TABLE_SCHEMA,
        "profile_schema": PROFILE_SCHEMA,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def table_dir(cache_dir: Path, profiles: VidurProfiles, training: TrainingConfig) -> Path:
    key = cache_key(profiles, training)
    slug = f"{profiles.model.name}_{profiles.device.name}_tp{profiles.tp}_{key[:16]}"
    return Path(cache_dir) / slug


# ------------------------------------------------------------ Vidur driving
_VIDUR_MODEL_CLASSES: dict[str, type] = {}


def _register_vidur_model(model: ModelConfig) -> str:
    """Register a Vidur model-config subclass for ``model``; return its name."""
    import dataclasses

    from vidur.config.model_config import Llama2ModelConfig

    name = vidur_model_name(model)
    if name in _VIDUR_MODEL_CLASSES:
        return name
    kv = model.num_heads if model.mla is not None else model.num_kv_heads
    values = {
        "num_layers": model.num_layers,
        "num_q_heads": model.num_heads,
        "num_kv_heads": kv,
        "embedding_dim": model.hidden_size,
        "mlp_hidden_dim": model.intermediate_size,
        "max_model_len": model.max_context_tokens,
        "use_gated_mlp": model.gated_mlp,
        "vocab_size": model.vocab_size,
    }
    fields = [(k, type(v), dataclasses.field(default=v)) for k, v in values.items()]
    cls = dataclasses.make_dataclass(
        "ShadowPrefill_" + "".join(c if c.isalnum() else "_" for c in model.name),
        fields,
        bases=(Llama2ModelConfig,),
        namespace={"get_name": staticmethod(lambda: name)},
    )
    _VIDUR_MODEL_CLASSES[name] = cls
    return name


@contextlib.contextmanager
def _quiet_vidur() -> Iterator[None]:
    lg = logging.getLogger("vidur")
    old = lg.level
    lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        lg.setLevel(old)


class _HubDisabled(RuntimeError):
    pass


def _offline_predictor_class() -> type:
    from vidur.execution_time_predictor.random_forrest_execution_time_predictor import (
        RandomForrestExecutionTimePredictor,
    )

    class OfflineRandomForestPredictor(RandomForrestExecutionTimePredictor):
        """Vidur's random-forest predictor reading local CSVs; the hub is never touched."""

        def __init__(self, *, files: dict[str, Path], general_limit: int, on_step: Any, **kwargs: Any) -> None:
            self._shadow_files = files
            self._shadow_general_limit = general_limit
            self._shadow_on_step = on_step
            super().__init__(**kwargs)

        def _get_input_files(self) -> tuple[str, str, str, str]:
            f = self._shadow_files
            missing = str(Path(f["mlp.csv"]).parent / "send_recv.csv")  # read only when PP > 1
            return (str(f["mlp.csv"]), str(f["attention.csv"]), str(f.get("all_reduce.csv", missing)), missing)

        def _load_predictions_from_hf(self) -> Any:
            raise _HubDisabled("offline: predictions are trained from local profiles")

        def _upload_predictions_to_hf(self) -> None:  # pragma: no cover - never configured
            raise _HubDisabled("offline")

        def _store_model_prediction_cache(self, *args: Any, **kwargs: Any) -> None:
            """Skip Vidur's csv.xz prediction cache: the tables are exported to npz instead."""

        def _get_estimator(self) -> Any:
            # Vidur's own builds RandomForestRegressor() unseeded: two trainings on the
            # same profiles then differ (~0.5% on average, up to 9% in a cell).
            from sklearn.ensemble import RandomForestRegressor

            return RandomForestRegressor(random_state=TRAINING_RANDOM_STATE)

        def _train_model(self, model_name: str, *args: Any, **kwargs: Any) -> Any:
            self._shadow_on_step(f"train {model_name}")
            return super()._train_model(model_name, *args, **kwargs)

        def _get_model_prediction(self, model_name: str, *args: Any, **kwargs: Any) -> Any:
            self._shadow_on_step(f"predict {model_name}")
            return super()._get_model_prediction(model_name, *args, **kwargs)

        def _predict_for_general_models(self, models: Any) -> Any:
            # Per-batch ops only need the token counts one batch can hold, not
            # prediction_max_tokens_per_request of them.
            saved = self._max_tokens
            self._max_tokens = self._shadow_general_limit
            try:
                return super()._predict_for_general_models(models)
            finally:
                self._max_tokens = saved

    return OfflineRandomForestPredictor


def train_vidur_predictor(
    profiles: VidurProfiles,
    files: dict[str, Path],
    work_dir: Path,
    training: TrainingConfig,
    progress: bool = True,
) -> Any:
    """Train Vidur's predictor on the local profile ``files``; return the predictor."""
    from vidur.config import CacheConfig, RandomForrestExecutionTimePredictorConfig, ReplicaConfig

    model, grid, tp = profiles.model, profiles.grid, profiles.tp
    name = _register_vidur_model(model)
    tag = f"shadowprefill-offline/{profiles.content_hash[:16]}"
    predictor_config = RandomForrestExecutionTimePredictorConfig(
        model_profiling_dataset=tag,
        network_profiling_dataset=tag,
        cache_dir=str(work_dir),
        kv_cache_prediction_granularity=256,
        prediction_max_prefill_chunk_size=grid.max_prefill_chunk,
        prediction_max_batch_size=grid.max_decode_batch,
        prediction_max_tokens_per_request=grid.kv_limit(model),
        nccl_cpu_launch_overhead_ms=0.0,  # measured CUDA-graph all-reduce latencies include the launch
        nccl_cpu_skew_overhead_per_device_ms=0.0,
        k_fold_cv_splits=training.k_fold_cv_splits,
        num_training_job_threads=training.num_threads,
        num_estimators=[training.num_estimators],
        max_depth=[training.max_depth],
        min_samples_split=[training.min_samples_split],
    )
    try:
        replica = ReplicaConfig(
            model_name=name,
            num_pipeline_stages=1,
            tensor_parallel_size=tp,
            device="h100",  # Vidur has no H200 SKU; the label only names the profile set
            network_device="h100_dgx",
        )
    except AssertionError as exc:
        raise ConfigError("tensor_parallel", tp, f"Vidur rejects {model.name} at this degree") from exc
    steps = 2 * (12 + (tp > 1))  # train + predict: 9 per-token ops, kv save, prefill, decode, all-reduce
    cls = _offline_predictor_class()
    title = f"Vidur predictor {model.name} {profiles.device.name} tp{tp}"
    with _progress(progress, title, steps) as step, _quiet_vidur():
        return cls(
            files=files,
            general_limit=grid.max_batch_tokens,
            on_step=step,
            predictor_config=predictor_config,
            replica_config=replica,
            cache_config=CacheConfig(),
        )


@contextlib.contextmanager
def _progress(enabled: bool, title: str, total: int) -> Iterator[Any]:
    if not enabled:
        yield lambda _desc: None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn()
    ) as bar:
        task = bar.add_task(title, total=total)
        started = [False]

        def step(desc: str) -> None:
            if started[0]:
                bar.advance(task)
            started[0] = True
            bar.update(task, description=f"{title}: {desc}")

        yield step
        bar.update(task, completed=total, description=f"{title}: done")


# ------------------------------------------------------------------ export
def _dict_to_1d(pred: dict, limit: int) -> np.ndarray:
    """{(n,): v} for n = 1..limit -> array indexed by n (index 0 unused, = value at 1)."""
    out = np.full(limit + 1, np.nan)
    for key, v in pred.items():
        n = int(key[0])
        if 1 <= n <= limit:
            out[n] = v
    out[0] = out[1]
    if np.isnan(out).any():
        raise ProfileCoverageError("prediction table", int(np.isnan(out).sum()), "missing token counts")
    return out


def export_predictions(predictor: Any, profiles: VidurProfiles) -> dict[str, np.ndarray]:
    """Raw Vidur prediction tables (ms per layer) as arrays."""
    p = predictor._predictions
    grid, model = profiles.grid, profiles.model
    limit = grid.max_batch_tokens
    kv_limit = grid.kv_limit(model)
    general = [
        "attn_pre_proj",
        "attn_post_proj",
        "mlp_up_proj",
        "mlp_down_proj",
        "mlp_act",
        "attn_rope",
        "input_layernorm",
        "post_attention_layernorm",
        "add",
    ]
    per_layer = sum(_dict_to_1d(p[op], limit) for op in general)
    if profiles.tp > 1:
        cfg = predictor._config
        per_layer = per_layer + 2 * (
            _dict_to_1d(p["all_reduce"], limit)
            + cfg.nccl_cpu_launch_overhead_ms
            + cfg.nccl_cpu_skew_overhead_per_device_ms * profiles.tp**1.25
        )
    n_kv = kv_limit // 256 + 1
    # attn_prefill keys: (kv, chunk) with kv = 0, 256, ..; chunk = 32, 64, ..
    prefill = np.full((n_kv, grid.max_prefill_chunk // 32), np.nan)
    for (kv, q), v in p["attn_prefill"].items():
        prefill[int(kv) // 256, int(q) // 32 - 1] = v
    decode = np.full((grid.max_decode_batch, n_kv), np.nan)
    for (b, kv), v in p["attn_decode"].items():
        decode[int(b) - 1, int(kv) // 256] = v
    for name, arr in (("attn_prefill", prefill), ("attn_decode", decode)):
        if np.isnan(arr).any():
            raise ProfileCoverageError(name, int(np.isnan(arr).sum()), "prediction keys missing from Vidur's table")
    return {
        "per_layer_ms": per_layer,
        "kv_save_ms": _dict_to_1d(p["attn_kv_cache_save"], limit),
        "prefill_ms": prefill,
        "decode_ms": decode,
        "decode_overhead_fraction": np.array(predictor._attention_decode_batching_overhead_fraction),
        "num_layers": np.array(predictor._num_layers_per_pipeline_stage),
    }


def prepare_tables(
    profiles: VidurProfiles,
    training: TrainingConfig | None = None,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    keep_predictor: bool = False,
) -> tuple[Path, Any]:
    """Ensure the cached tables for ``profiles`` exist; return (their folder, predictor or None).

    The predictor is returned only when this call trained it and ``keep_predictor`` is set.
    """
    training = training or TrainingConfig()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = table_dir(root, profiles, training)
    if (target / "tables.npz").exists() and not keep_predictor:
        return target, None
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        started = time.perf_counter()
        files = profiles.write(work / "profiles")
        predictor = train_vidur_predictor(profiles, files, work / "vidur", training, progress)
        arrays = export_predictions(predictor, profiles)
        np.savez_compressed(work / "tables.npz", **arrays)
        meta = {
            "model": profiles.model.name,
            "device": profiles.device.name,
            "tp": profiles.tp,
            "profile_sha256": profiles.content_hash,
            "cache_key": cache_key(profiles, training),
            "grid": attrs.asdict(profiles.grid),
            "kv_limit": profiles.grid.kv_limit(profiles.model),
            "training": attrs.asdict(training),
            "vidur": _vidur_version(),
            "notes": list(profiles.notes),
            "build_seconds": round(time.perf_counter() - started, 2),
        }
        (work / "meta.json").write_text(json.dumps(meta, indent=2))
        shutil.rmtree(work / "vidur", ignore_errors=True)  # Vidur's pickled forests: large, not needed
        if (target / "tables.npz").exists():
            shutil.rmtree(work, ignore_errors=True)
        else:
            try:
                os.replace(work, target)
            except OSError:  # another process won the race
                shutil.rmtree(work, ignore_errors=True)
        return target, (predictor if keep_predictor else None)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


# ------------------------------------------------------------------ runtime
def _s_grid(max_total: int) -> tuple[np.ndarray, list[int]]:
    """Total-decode-context grid: every 256 up to 65536, then +1/256 geometric steps."""
    dense = np.arange(0, _DENSE_S + 1, 256, dtype=np.int64)
    geo: list[int] = []
    v = float(_DENSE_S)
    while not geo or geo[-1] < max_total:
        v *= 1.0 + 1.0 / 256.0
        geo.append(int(-(-int(v) // 256) * 256))
    geo = sorted(set(geo))
    return np.concatenate([dense, np.asarray(geo, dtype=np.int64)]), geo


@attrs.frozen(eq=False)
class VidurLatencyModel:
    """Iteration time from Vidur's trained execution-time predictor (see module docstring).

    Build with :meth:`for_model`; the constructor takes already-exported raw
    tables (``ms`` per layer, as :func:`export_predictions` returns them).
    """

    model: ModelConfig
    device: DeviceSpec
    tp: int
    grid: ProfileGrid
    tables: dict[str, np.ndarray] = attrs.field(repr=False)
    table_path: Path | None = None
    bandwidth: BandwidthModel = attrs.field(factory=BandwidthModel)
    iteration_overhead_s: float = attrs.field(default=1e-3, validator=non_negative)
    decode_seq_overhead_s: float = attrs.field(default=5e-6, validator=non_negative)
    lm_head_mfu: float = attrs.field(default=0.6, validator=fraction_open_closed)
    logits_bytes: float = attrs.field(default=4.0, validator=positive)
    _rt: dict[str, Any] = attrs.field(init=False, repr=False)
    # predict_decodes_s's hot values out of _rt, in one tuple (the same objects: the memo is _rt's)
    _decode_hot: tuple = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        rt = self._runtime()
        object.__setattr__(self, "_rt", rt)
        object.__setattr__(self, "_decode_hot", (rt["bmax"], rt["kv_limit"], rt["decode_cols"], rt["memo_stride"],
                                                 rt["decode_memo"], rt["geo"]))

    # ------------------------------------------------------------- factory
    @classmethod
    def for_model(
        cls,
        model: str | ModelConfig,
        device: str | DeviceSpec = "H100-80GB",
        tp: int | None = None,
        *,
        grid: ProfileGrid | None = None,
        training: TrainingConfig | None = None,
        cache_dir: str | Path | None = None,
        progress: bool = True,
        bandwidth: BandwidthModel | None = None,
        profile_dir: str | Path | None = None,
        **knobs: Any,
    ) -> VidurLatencyModel:
        """Build profiles (or read them from ``profile_dir``), train or load the cached tables.

        The cache key hashes the CSV contents, so editing a profile retrains.
        """
        model = get_model(model) if isinstance(model, str) else model
        device = get_device(device) if isinstance(device, str) else device
        tp = tensor_parallel_degree(model, device) if tp is None else tp
        bandwidth = bandwidth or BandwidthModel()
        if profile_dir is not None:
            profiles = VidurProfiles.from_dir(profile_dir, model, device, tp, grid)
        else:
            profiles = build_profiles(model, device, tp, grid or ProfileGrid(), bandwidth)
        path, _ = prepare_tables(profiles, training, cache_dir, progress)
        with np.load(path / "tables.npz") as z:
            tables = {k: z[k] for k in z.files}
        return cls(model, device, tp, profiles.grid, tables, path, bandwidth, **knobs)

    # ------------------------------------------------------------- tables
    def _runtime(self) -> dict[str, Any]:
        t, grid, model, dev, bw = self.tables, self.grid, self.model, self.device, self.bandwidth
        L = int(t["num_layers"])
        to_s = L * 1e-3
        limit = grid.max_batch_tokens
        kv_limit = grid.kv_limit(model)
        n = np.arange(limit + 1)
        rounded = np.minimum((n + 7) // 8 * 8, limit)
        if limit % 8:  # pragma: no cover - ProfileGrid enforces a multiple of 8
            raise ConfigError("max_batch_tokens", limit, "must be a multiple of 8")
        a = bw.activation_bytes
        embed_s = bw.kernel_ms(dev, n * model.hidden_size * a * 2) * 1e-3
        kv_save_s = to_s * t["kv_save_ms"][n]
        tokens_s = to_s * t["per_layer_ms"][rounded] + kv_save_s + embed_s
        tokens_s[0] = 0.0
        tokens_s = np.maximum.accumulate(tokens_s)

        prefill_s = np.maximum.accumulate(np.maximum.accumulate(t["prefill_ms"] * to_s, axis=0), axis=1)

        # Decode attention over (b, total context S), closed under "fewer sequences, same KV".
        frac = float(t["decode_overhead_fraction"])
        raw = t["decode_ms"] * to_s
        raw = raw * np.where(np.arange(1, raw.shape[0] + 1) > 1, 1.0 + frac, 1.0)[:, None]
        raw = np.maximum.accumulate(raw, axis=1)
        bmax = raw.shape[0]
        s_grid, geo = _s_grid(bmax * kv_limit)
        b = np.arange(1, bmax + 1)[:, None]
        kidx = np.minimum(-(-s_grid[None, :] // (256 * b)), kv_limit // 256)
        head = model.vocab_size * model.hidden_size
        head_read_s = bw.kernel_floor_s + head * model.weight_dtype_bytes / (
            self.tp * dev.hbm_bandwidth_bytes_per_s * bw.hbm_efficiency
        )
        head_row_s = 2 * head / (self.tp * dev.bf16_flops_per_s * self.lm_head_mfu)
        sample_row_s = (model.vocab_size * self.logits_bytes * 3 + model.hidden_size * a * 2) / (
            dev.hbm_bandwidth_bytes_per_s * bw.hbm_efficiency
        )
        # Least envelope with A'(b+1, S + x) >= A'(b, S) - delta: every added decode
        # brings at least delta of its own (per-decode overhead + sampling), so the
        # total never decreases while attention may give back up to delta.
        delta = self.decode_seq_overhead_s + sample_row_s
        dec = np.maximum.accumulate(raw[b - 1, kidx], axis=1)
        for i in range(1, bmax):
            np.maximum(dec[i], dec[i - 1] - delta, out=dec[i])
        return {
            "tokens": tokens_s.tolist(),
            "token_extras": (kv_save_s + embed_s).tolist(),
            "prefill": prefill_s.ravel().tolist(),
            "prefill_cols": prefill_s.shape[1],
            "decode": dec.ravel().tolist(),
            "decode_cols": dec.shape[1],
            "geo": geo,
            "limit": limit,
            "kv_limit": kv_limit,
            "chunk_limit": grid.max_prefill_chunk,
            "bmax": bmax,
            "fixed_s": self.iteration_overhead_s + 2 * bw.kernel_floor_s,  # + sampling & norm launches
            "head_read_s": head_read_s,
            "head_row_s": head_row_s,
            "seq_s": sample_row_s,
            # predict_decodes_s's results by decode-table cell and batch size: a decode-only iteration's time is
            # a function of those two (the same float operations on the same values), so computed once each
            "decode_memo": {},
            "memo_stride": bmax + 1,
        }

    # ------------------------------------------------------------ Protocol
    def predict_s(self, batch: BatchShape) -> float:
        """Seconds one iteration running ``batch`` takes; 0.0 with no tokens."""
        decodes = batch.decode_context_tokens
        if not decodes:
            return self._batch_s(batch.prefills, 0, 0, 0)
        return self._batch_s(batch.prefills, len(decodes), sum(decodes), max(decodes))

    def predict_batch_s(
        self, prefills: tuple[PrefillChunk, ...], num_decodes: int, total_context: int, max_context: int
    ) -> float | None:
        """:meth:`predict_s` from the decode aggregates: the very code
        :meth:`predict_s` runs (bit-identical, same errors)."""
        return self._batch_s(prefills, num_decodes, total_context, max_context)

    def _batch_s(self, prefills: Sequence[PrefillChunk], nd: int, total: int, longest: int) -> float:
        rt = self._rt
        t = 0.0
        if nd:
            if nd > rt["bmax"]:
                raise ProfileCoverageError("decode batch size", nd, f"beyond the tables' max_decode_batch {rt['bmax']}")
            if longest > rt["kv_limit"]:
                raise ProfileCoverageError(
                    "decode context", longest, f"beyond the tables' max_kv_tokens {rt['kv_limit']}"
                )
            j = (total + 255) >> 8 if total <= _DENSE_S else 257 + bisect.bisect_left(rt["geo"], total)
            t = rt["decode"][(nd - 1) * rt["decode_cols"] + j]
        tokens = seqs = nd
        pre = rt["prefill"]
        cols = rt["prefill_cols"]
        for chunk in prefills:
            q = chunk.num_new_tokens
            if q:
                if q > rt["chunk_limit"]:
                    raise ProfileCoverageError(
                        "prefill chunk", q, f"beyond the tables' max_prefill_chunk {rt['chunk_limit']}"
                    )
                kv = chunk.num_context_tokens + q
                if kv > rt["kv_limit"]:
                    raise ProfileCoverageError(
                        "prefill context + chunk", kv, f"beyond the tables' max_kv_tokens {rt['kv_limit']}"
                    )
                t += pre[((kv + 255) >> 8) * cols + ((q + 31) >> 5) - 1]
                tokens += q
                seqs += 1
        if not tokens:
            return 0.0
        if tokens > rt["limit"]:
            raise ProfileCoverageError("batch tokens", tokens, f"beyond the tables' max_batch_tokens {rt['limit']}")
        return self._total_s(t, tokens, seqs, nd)

    def predict_decodes_s(self, num_decodes: int, total_context: int, max_context: int) -> float | None:
        """:meth:`predict_s` of a decode-only batch of ``num_decodes`` sequences
        from its aggregates (total and longest context): the same lookups and
        float operations in the same order, so bit-identical; same errors."""
        bmax, kv_limit, cols, stride, memo, geo = self._decode_hot
        nd = num_decodes
        if nd <= 0:
            return None
        if nd > bmax:
            raise ProfileCoverageError("decode batch size", nd, f"beyond the tables' max_decode_batch {bmax}")
        if max_context > kv_limit:
            raise ProfileCoverageError("decode context", max_context, f"beyond the tables' max_kv_tokens {kv_limit}")
        total = total_context
        j = (total + 255) >> 8 if total <= _DENSE_S else 257 + bisect.bisect_left(geo, total)
        cell = (nd - 1) * cols + j
        key = cell * stride + nd  # nd <= bmax: one key per (cell, nd)
        s = memo.get(key)
        if s is None:
            rt = self._rt
            t = rt["decode"][cell]
            if nd > rt["limit"]:
                raise ProfileCoverageError("batch tokens", nd, f"beyond the tables' max_batch_tokens {rt['limit']}")
            s = memo[key] = self._total_s(t, nd, nd, nd)
        return s

    def predict_decode_span_s(self, num_decodes: int, total_context: int, max_context: int) -> tuple[float, int]:
        """``(d, m)``: ``d = predict_decodes_s(num_decodes, total_context,
        max_context)`` (raising as it does, ``(None, 1)`` where it gives None),
        and ``m >= 1`` steps from this one on, every context one token longer
        at each (``total_context + k * num_decodes``, ``max_context + k`` for
        ``k < m``), give exactly ``d`` and none raises: the rest of the decode
        table's cell (see :meth:`predict_decode_run_s`), up to the context
        limit. ``EngineInstance.run_steady`` looks a step up only where a
        span ends, with nothing computed ahead that a run cut short wastes
        (``tests/sim/test_speed_equivalence_latency.py``)."""
        bmax, kv_limit, cols, stride, memo, geo = self._decode_hot
        nd, total = num_decodes, total_context
        if total <= _DENSE_S:
            j = (total + 255) >> 8
            top = j << 8  # column j holds while the total stays <= top
        else:
            i = bisect.bisect_left(geo, total)
            j, top = 257 + i, geo[i] if i < len(geo) else None  # None: every larger total is in this column too
        # predict_decodes_s's memo, read here (its key); a miss, or a step that raises or gives None, asks it
        d = memo.get(((nd - 1) * cols + j) * stride + nd) if 0 < nd <= bmax and max_context <= kv_limit else None
        if d is None:
            d = self.predict_decodes_s(nd, total, max_context)
            if d is None:
                return d, 1
        m = kv_limit - max_context + 1  # step k raises once max_context + k > kv_limit
        return d, m if top is None else min(m, (top - total) // nd + 1)

    def predict_decode_run_s(self, num_decodes: int, total_context: int, max_context: int,
                             num_steps: int) -> list[float]:
        """``[predict_decodes_s(num_decodes, total_context + k * num_decodes,
        max_context + k) for k in 1..num_steps]`` (a run of steady decode
        iterations, every context one token longer each), stopping before the
        first step that would raise or give None: the same values
        (:func:`shadowcore.latency.decode_run_s` is the rule). An iteration's
        time depends on the decode table's cell of its total context, which
        stays the same over ``256 / num_decodes`` steps (dense columns) or a
        geometric column's width: one lookup per cell, not per step."""
        bmax, kv_limit, _, _, _, geo = self._decode_hot
        nd = num_decodes
        if nd <= 0 or nd > bmax or nd > self._rt["limit"]:
            return []  # every step gives None or raises (the limit: at its memo miss, and nothing is memoised)
        num = min(num_steps, kv_limit - max_context)  # step k raises once max_context + k > kv_limit
        out: list[float] = []
        k = 1
        while k <= num:
            total = total_context + k * nd
            if total <= _DENSE_S:  # column (total + 255) >> 8 holds while total <= its top, 256 * column
                last = min(num, ((((total + 255) >> 8) << 8) - total_context) // nd)
            else:  # column 257 + bisect_left(geo, total) holds while total <= geo[that index]
                i = bisect.bisect_left(geo, total)
                last = min(num, (geo[i] - total_context) // nd) if i < len(geo) else num
            try:  # every step of the cell gives this value, or raises as this one does
                d = self.predict_decodes_s(nd, total, max_context + k)
            except Exception:  # noqa: BLE001 (a look-ahead: the caller meets the error at that step itself)
                return out
            out.extend([d] * (last - k + 1))
            k = last + 1
        return out

    def _total_s(self, attention_s: float, tokens: int, seqs: int, num_decodes: int) -> float:
        """An iteration's time from its attention time: the per-token ops, the
        fixed cost, the LM head, the per-sequence costs (one order of float
        operations for :meth:`predict_s` and :meth:`predict_decodes_s`)."""
        rt = self._rt
        head = seqs * rt["head_row_s"]
        return (
            attention_s
            + rt["tokens"][tokens]
            + rt["fixed_s"]
            + (head if head > rt["head_read_s"] else rt["head_read_s"])  # noqa: FURB136 (faster than max)
            + seqs * rt["seq_s"]
            + num_decodes * self.decode_seq_overhead_s
        )

    def extra_costs_s(self, batch: BatchShape) -> float:
        """The part of :meth:`predict_s` outside Vidur's ``model_time``.

        KV-cache writes, embedding, LM head, final norm + sampling and CPU
        overhead (module docstring); 0.0 for an empty batch.
        """
        rt = self._rt
        nd = batch.num_decodes
        chunks = sum(1 for c in batch.prefills if c.num_new_tokens)
        tokens, seqs = batch.num_tokens, nd + chunks
        if not tokens:
            return 0.0
        if tokens > rt["limit"]:
            raise ProfileCoverageError("batch tokens", tokens, f"beyond the tables' max_batch_tokens {rt['limit']}")
        return (
            rt["token_extras"][tokens]
            + rt["fixed_s"]
            + max(seqs * rt["head_row_s"], rt["head_read_s"])
            + seqs * rt["seq_s"]
            + nd * self.decode_seq_overhead_s
        )

    # ------------------------------------------------------------- Vidur's rule
    def vidur_model_time_s(self, batch: BatchShape) -> float:
        """Vidur 0.0.26's ``ExecutionTime.model_time`` for ``batch``, from the raw tables.

        Follows ``SklearnExecutionTimePredictor`` exactly (one-token chunks count
        as decodes, no monotone envelope, no costs beyond ``model_time``); for
        cross-checks against a live predictor.
        """
        t = self.tables
        q_list = [c.num_new_tokens for c in batch.prefills if c.num_new_tokens] + [1] * batch.num_decodes
        kv_list = [c.num_context_tokens + c.num_new_tokens for c in batch.prefills if c.num_new_tokens] + list(
            batch.decode_context_tokens
        )
        if not q_list:
            return 0.0
        total = sum(q_list)
        per_layer = float(t["per_layer_ms"][(total + 7) // 8 * 8])
        dec = [kv for q, kv in zip(q_list, kv_list, strict=True) if q == 1]
        if dec:
            mean = int(np.mean(dec))
            k = (mean + 255) // 256
            frac = float(t["decode_overhead_fraction"]) if len(dec) > 1 else 0.0
            per_layer += float(t["decode_ms"][len(dec) - 1, k]) * (1 + frac)
        for q, kv in zip(q_list, kv_list, strict=True):
            if q != 1:
                per_layer += float(t["prefill_ms"][(kv + 255) // 256, (q + 31) // 32 - 1])
        return per_layer * int(t["num_layers"]) * 1e-3

    # -------------------------------------------------------------- helpers
    def isolated_prefill_s(self, num_tokens: int, chunk_tokens: int = 2048) -> float:
        """Time to prefill ``num_tokens`` alone, in chunks of ``chunk_tokens``."""
        return chunked_prefill_s(self, num_tokens, chunk_tokens)

    @property
    def meta(self) -> dict[str, Any]:
        if self.table_path is None:
            return {}
        return json.loads((self.table_path / "meta.json").read_text())


__all__ = [
    "ENV_CACHE",
    "TABLE_SCHEMA",
    "TrainingConfig",
    "VidurLatencyModel",
    "cache_key",
    "default_cache_dir",
    "export_predictions",
    "prepare_tables",
    "train_vidur_predictor",
]
