"""Iterations per wall-second: our simulator vs Vidur's own simulator, same workload.

Usage (from the project root; the first run for a model/device/TP trains and
caches the Vidur tables, ~30-50 s on 2 cores)::

    python benchmarks/sim_vs_vidur.py [--requests 2000] [--start 0]
        [--trace ../shared/traces/azure-llm-2023/AzureLLMInferenceTrace_conv.csv]
        [--model Llama-3.1-8B] [--device H100-80GB] [--tp 1]
        [--vidur-predictor tables|trained] [--vidur-native] [--repeat 1]
        [--ours-latency full|vidur-model-time] [--profile [N]]

One model, one replica, no shadow work. A window of ``--requests`` rows of the
Azure LLM conversation trace (read at run time, never copied: ``--trace``)
is replayed through both simulators: arrival = TIMESTAMP minus the window's
first TIMESTAMP, prompt = ContextTokens (capped at ``--prompt-cap``, 8192),
output = GeneratedTokens (capped at ``--output-cap``, 1024).

* Ours: one :class:`~shadowcore.engine.instance.EngineInstance` built by
  :class:`shadow_sim.simulator.SimRun` (KV pool sized from HBM, token budget
  2048, 256 sequences, block 16) under the ``no-shadow`` policy, the requests
  injected as NORMAL traffic by :class:`TraceRun` (a :class:`SimRun` that
  replays a list instead of drawing Poisson traffic), latency from
  :class:`shadow_sim.vidur_latency.VidurLatencyModel` for the same model/TP.
  Iterations: ``EngineInstance.num_iterations_run``; wall time: the event loop
  (``EventLoop.run``) only.
* Vidur 0.0.26: ``SimulationConfig`` built in code, one replica (PP 1, TP
  ``--tp``), the ``sarathi`` replica scheduler with chunk size 2048 and
  ``batch_size_cap`` 256, a ``trace_replay`` request generator over a
  temporary CSV in the format it reads (``Date, Time, PromptTokenCount,
  CompletionTokenCount``; scale factors 1, ``max_tokens`` = prompt cap +
  output cap so nothing is clipped), the same number of KV blocks as ours
  (``CacheConfig.num_blocks``, watermark 0), plots, chrome trace, json trace
  and wandb off. Its execution-time predictor never touches the hub: with
  ``--vidur-predictor tables`` (default) it is Vidur's own
  ``RandomForrestExecutionTimePredictor`` class (its Python lookup path,
  unchanged) whose prediction dictionaries are filled from the cached tables
  that :mod:`shadow_sim.vidur_latency` exported from Vidur's trained predictor
  (the nine per-token ops are folded into ``attn_pre_proj``, the rest zero:
  ``model_time`` is identical, only Vidur's per-op breakdown is lost); with
  ``trained`` it is the predictor :func:`shadow_sim.vidur_latency.prepare_tables`
  trains on the offline profiles (~30-50 s, every op separate).
  Iterations: the number of ``Batch`` objects created (Vidur's entity id
  counter, no per-event hook); wall time: ``Simulator.run()`` minus its final
  ``_write_output()`` (reported separately). Vidur is run twice, with its
  default metrics (request/batch/utilisation series, the shipped
  configuration) and with ``write_metrics=False`` (its fastest configuration);
  the ratio is printed against both.

Sanity comparison (mean TTFT = first token minus arrival, mean end-to-end =
last token minus arrival) and why the numbers differ:

* Iteration time. Vidur 0.0.26 times an iteration as ``model_time`` only (its
  CPU-overhead model is gone from this version). Our ``predict_s`` adds what
  ``model_time`` leaves out: 1 ms CPU overhead per iteration + 5 us per
  decode, KV-cache writes, embedding, LM head and sampling, and takes
  monotone envelopes of Vidur's tables. That is ~1.5-2.5 ms more on a ~5-15 ms
  iteration, so at defaults our mean TTFT is ~11% and our mean end-to-end
  latency ~26% higher, and we run ~20% fewer (longer, fuller) iterations over
  the same trace (42.6k vs 53.5k). Compare "simulated s / wall-second" too.
* ``--ours-latency vidur-model-time`` makes our engine use Vidur's exact rule
  (:meth:`VidurLatencyModel.vidur_model_time_s`). The two simulators then
  agree: at defaults 53,552 vs 53,539 iterations, mean TTFT ratio 1.003, mean
  end-to-end ratio 1.000 (its lookup goes through numpy, so our rate in that
  mode is not representative). ``--vidur-predictor trained`` gives exactly the
  same Vidur numbers as ``tables``.
* Scheduling. Both run decodes first, then in-flight prefill chunks, then FCFS
  admissions; a prefill chunk gets 2048 minus the tokens already in the batch;
  at most 256 sequences. Differences that do not bind here: admission
  reserves ``ceil(prompt/16)`` blocks in Vidur, ``ceil((prompt+1)/16)`` in
  ours; Vidur's watermark (set to 0 here); preemption victims (ours: most
  recently admitted; Vidur: the latest-arrived running request). On this
  trace on one H100 the KV pool (26,674 blocks) never fills: no preemptions.
* Events. Ours ends an iteration and starts the next at the same instant;
  Vidur goes through batch-stage-end / batch-end / replica-schedule events at
  the same simulated time, so neither loses simulated time between
  iterations.

Timing noise: the wall clock counts time the process waits for a CPU; on a
shared machine compare the CPU-second rates too (both are printed, and the
runs are interleaved so load hits both sides alike). Measured numbers and
where the time goes: ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import csv
import gc
import io
import itertools
import logging
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import attrs

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # Vidur must never reach the hub
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")

ROOT = Path(__file__).resolve().parents[1]
#: ``$SHADOWPREFILL_TRACES`` (as the tests read it) or ``../shared/traces`` beside the checkout
DEFAULT_TRACE = (Path(os.environ.get("SHADOWPREFILL_TRACES") or ROOT.parent / "shared" / "traces")
                 / "azure-llm-2023" / "AzureLLMInferenceTrace_conv.csv")
TRACE_DATE = "2023-11-16"  # any constant: Vidur's trace_replay keeps the rows of one Date

Request = tuple[float, int, int]  # (arrival_s, prompt tokens, output tokens)
TARGET_X = 30.0  # issue 17: ours at least 30x Vidur's iteration rate with its metrics off


# ----------------------------------------------------------------------- trace
def _parse_ts(text: str) -> tuple[datetime, float]:
    """'2023-11-16 18:17:03.9799600' -> (whole seconds, fraction); 7 digits defeat fromisoformat."""
    whole, _, frac = text.strip().partition(".")
    return datetime.strptime(whole, "%Y-%m-%d %H:%M:%S"), float("0." + frac) if frac else 0.0


def load_trace(path: Path, num: int, start: int, prompt_cap: int, output_cap: int) -> tuple[list[Request], dict]:
    """Rows ``[start, start + num)`` of an Azure LLM trace CSV as requests."""
    if not path.is_file():
        sys.exit(f"trace not found: {path} (pass --trace)")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or ())
        if missing:
            sys.exit(f"{path}: missing columns {sorted(missing)}")
        rows = list(itertools.islice(reader, start, start + num))
    if not rows:
        sys.exit(f"{path}: no rows in [{start}, {start + num})")
    t0, f0 = _parse_ts(rows[0]["TIMESTAMP"])
    out: list[Request] = []
    capped_p = capped_o = 0
    for row in rows:
        t, frac = _parse_ts(row["TIMESTAMP"])
        arrival = (t - t0).total_seconds() + (frac - f0)
        p, o = int(row["ContextTokens"]), int(row["GeneratedTokens"])
        capped_p += p > prompt_cap
        capped_o += o > output_cap
        out.append((max(0.0, arrival), max(1, min(p, prompt_cap)), max(1, min(o, output_cap))))
    out.sort(key=lambda r: r[0])  # the trace is sorted; be safe
    info = {"capped_prompts": capped_p, "capped_outputs": capped_o}
    return out, info


# ------------------------------------------------------------------------ ours
def _our_classes() -> tuple[type, type]:
    from shadow_sim.models import get_model
    from shadow_sim.simulator import SimRun, SimScenario

    from shadowcore.engine._fastpath import InlineEventLoop

    @attrs.frozen
    class OneModelScenario(SimScenario):
        """A :class:`SimScenario` with one model (the benchmark has no agent sessions)."""

        def __attrs_post_init__(self) -> None:
            for name in self.models:
                get_model(name)

    @attrs.define(eq=False)
    class TimedLoop(InlineEventLoop):
        """The event loop, timed (wall and CPU) and optionally profiled around ``run``."""

        wall_s: float = 0.0
        cpu_s: float = 0.0
        profiler: Any = None

        def run(self, *args: Any, **kwargs: Any) -> None:
            gc.collect()
            if self.profiler is not None:
                self.profiler.enable()
            wall, cpu = time.perf_counter(), time.process_time()
            super().run(*args, **kwargs)
            self.wall_s += time.perf_counter() - wall
            self.cpu_s += time.process_time() - cpu
            if self.profiler is not None:
                self.profiler.disable()

    @attrs.define(eq=False)
    class TraceRun(SimRun):
        """A :class:`SimRun` whose normal traffic is ``trace`` on its one serving
        instance (no sessions: pass ``sessions=()``), keeping each request's
        TTFT and end-to-end latency (:attr:`records`, read after the run from
        the requests it built: a hook on ``_normal_done`` would turn off the
        per-instance feed, ``ScenarioRun.feeds_normal``, and so the deferred
        instance every other run's normal traffic gets). ``latency_model``,
        when given, replaces the instance's own latency model (the
        ``vidur-model-time`` check)."""

        trace: tuple = ()
        latency_model: Any = None
        _built: list = attrs.field(init=False, factory=list)
        loop: InlineEventLoop = attrs.field(init=False, factory=TimedLoop)

        @property
        def records(self) -> list[tuple[float, float]]:
            """(TTFT, end-to-end) of each finished request, in arrival order."""
            return [(r.first_token_s - r.arrival_s, r.finish_s - r.arrival_s) for r in self._built
                    if not r.rejected and r.finish_s is not None]

        def build_instance(self, instance_id: str, model: str, kv_policy: Any, *args: Any, **kwargs: Any) -> Any:
            import shadow_sim.simulator as simmod

            if hasattr(simmod, "build_latency"):  # older simulator.py: its Vidur path called the bare constructor
                from shadow_sim.latency import latency_model

                saved = simmod.build_latency
                simmod.build_latency = lambda kind, config, device, tp: latency_model(config, device, tp, kind=kind)
                try:
                    inst = super().build_instance(instance_id, model, kv_policy, *args, **kwargs)
                finally:
                    simmod.build_latency = saved
            else:
                inst = super().build_instance(instance_id, model, kv_policy, *args, **kwargs)
            if self.latency_model is not None:
                inst.latency = self.latency_model  # before the hook is attached, which reads it
            return inst

        def normal_traffic(self) -> tuple:
            from shadowcore.engine.workload import normal_requests

            (inst,) = self.cluster.by_id
            return normal_requests([(inst, self.trace)])

        def normal_arrivals(self) -> list:  # the same, for simulators before the Workload value
            (inst,) = self.cluster.by_id.values()
            return [(inst, list(self.trace))]

        def _normal_request(self, *args: Any, **kwargs: Any) -> Any:
            req = super()._normal_request(*args, **kwargs)
            self._built.append(req)
            return req

    return OneModelScenario, TraceRun


class VidurModelTime:
    """Our engine timed by Vidur's exact ``model_time`` rule (sanity mode)."""

    def __init__(self, model: Any) -> None:
        self._m = model

    def predict_s(self, batch: Any) -> float:
        return self._m.vidur_model_time_s(batch)


def run_ours(requests: Sequence[Request], args: argparse.Namespace, latency: Any = None,
             profiler: cProfile.Profile | None = None) -> dict:
    """``latency`` None: the instance's latency model is the one SimRun builds (VidurLatencyModel)."""
    from shadowcore.config import ShadowConfig

    OneModelScenario, TraceRun = _our_classes()
    sc = OneModelScenario(
        models=(args.model,), device=args.device, latency="vidur", tp=(args.tp,), instances_per_model=1,
        duration_s=max(1.0, requests[-1][0] + 1.0), warmup_s=0.0, normal_rate_per_s=0.0,
        token_budget=args.chunk, max_num_seqs=args.max_seqs, block_size=args.block_size,
    )
    setup = time.perf_counter()
    run = TraceRun(sc, ShadowConfig.from_dict({"policy": "no-shadow"}), sessions=(), trace=tuple(requests),
                   latency_model=latency)
    setup = time.perf_counter() - setup
    run.loop.profiler = profiler
    run.run()
    (inst,) = run.cluster.by_id.values()
    ttft = [r[0] for r in run.records]
    e2e = [r[1] for r in run.records]
    return {
        "finished": len(run.records),
        "rejected": len(requests) - len(run.records),
        "sim_s": run.loop.now_s,
        "iterations": inst.num_iterations_run,
        "wall_s": run.loop.wall_s,
        "cpu_s": run.loop.cpu_s,
        "setup_s": setup,
        "ttft_s": statistics.fmean(ttft) if ttft else float("nan"),
        "e2e_s": statistics.fmean(e2e) if e2e else float("nan"),
        "preemptions": inst.num_preemptions,
        "kv_blocks": inst.kv.num_blocks,
        "latency": type(inst.latency).__name__,
    }


# ----------------------------------------------------------------------- vidur
_GENERAL_OPS = (
    "attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj", "mlp_act", "attn_rope",
    "input_layernorm", "post_attention_layernorm", "add",
)


def predictions_from_tables(tables: dict, grid: Any, kv_limit: int, tp: int) -> dict[str, dict]:
    """Vidur's ``_predictions`` dictionaries (ms per layer) rebuilt from our exported tables.

    ``per_layer_ms`` is the sum of the nine per-token ops (plus both TP
    all-reduces when TP > 1) at every token count; it goes into
    ``attn_pre_proj`` and the other ops get 0, so Vidur's ``model_time`` sums
    to exactly what its trained predictor gives.
    """
    per_layer, kv_save = tables["per_layer_ms"], tables["kv_save_ms"]
    limit = len(per_layer) - 1
    n = range(1, limit + 1)
    zeros = {(i,): 0.0 for i in n}
    p: dict[str, dict] = {op: zeros for op in _GENERAL_OPS}
    p["attn_pre_proj"] = {(i,): float(per_layer[i]) for i in n}
    p["attn_kv_cache_save"] = {(i,): float(kv_save[i]) for i in n}
    if tp > 1:
        p["all_reduce"] = zeros  # folded into per_layer_ms by export_predictions
    pre, dec = tables["prefill_ms"], tables["decode_ms"]
    p["attn_prefill"] = {
        (kv, q): float(pre[kv // 256, q // 32 - 1])
        for kv in range(0, kv_limit + 1, 256)
        for q in range(32, grid.max_prefill_chunk + 1, 32)
    }
    p["attn_decode"] = {
        (b, kv): float(dec[b - 1, kv // 256])
        for b in range(1, grid.max_decode_batch + 1)
        for kv in range(0, kv_limit + 1, 256)
    }
    return p


def _table_predictor_class() -> type:
    from vidur.execution_time_predictor.base_execution_time_predictor import BaseExecutionTimePredictor
    from vidur.execution_time_predictor.random_forrest_execution_time_predictor import (
        RandomForrestExecutionTimePredictor,
    )

    class TablePredictor(RandomForrestExecutionTimePredictor):
        """Vidur's random-forest predictor with its prediction tables given, not trained.

        Everything after ``SklearnExecutionTimePredictor.__init__`` (lookups,
        the native predictor) is Vidur's unchanged code.
        """

        def __init__(self, *, predictions: dict, predictor_config: Any, replica_config: Any, cache_config: Any) -> None:
            BaseExecutionTimePredictor.__init__(
                self, predictor_config=predictor_config, replica_config=replica_config, cache_config=cache_config
            )
            m = self._model_config
            self._attention_decode_batching_overhead_fraction = (
                self._config.attention_decode_batching_overhead_fraction if m.num_q_heads > m.num_kv_heads else 0
            )
            self._max_tokens = self._config.prediction_max_tokens_per_request
            self._is_multi_node = False
            self._predictions = predictions
            if self._config.use_native_execution_time_predictor:
                self._native_execution_time_predictor = self._init_native_execution_time_predictor()

    return TablePredictor


@contextlib.contextmanager
def _vidur_quiet(level: int = logging.WARNING) -> Iterator[None]:
    lg = logging.getLogger("vidur")
    old = lg.level
    lg.setLevel(level)
    try:
        yield
    finally:
        lg.setLevel(old)


@contextlib.contextmanager
def _injected_predictor(predictor: Any) -> Iterator[None]:
    """Vidur's global scheduler builds its predictor through the registry: hand it ours."""
    from vidur.execution_time_predictor import ExecutionTimePredictorRegistry
    from vidur.types import ExecutionTimePredictorType

    key = ExecutionTimePredictorType.RANDOM_FORREST
    reg = ExecutionTimePredictorRegistry._registry
    saved = reg[key]
    reg[key] = lambda **_kw: predictor
    try:
        yield
    finally:
        reg[key] = saved


def vidur_configs(args: argparse.Namespace, latency: Any, work: Path) -> tuple[Any, Any, Any, str]:
    """(predictor config, replica config, cache config, model name) for Vidur."""
    from shadow_sim.vidur_latency import _register_vidur_model
    from vidur.config import CacheConfig, RandomForrestExecutionTimePredictorConfig, ReplicaConfig

    name = _register_vidur_model(latency.model)
    grid = latency.grid
    frac = float(latency.tables["decode_overhead_fraction"])
    predictor_config = RandomForrestExecutionTimePredictorConfig(
        model_profiling_dataset="shadowprefill-offline",
        network_profiling_dataset="shadowprefill-offline",
        cache_dir=str(work / "vidur_cache"),
        kv_cache_prediction_granularity=256,
        prediction_max_prefill_chunk_size=grid.max_prefill_chunk,
        prediction_max_batch_size=grid.max_decode_batch,
        prediction_max_tokens_per_request=grid.kv_limit(latency.model),
        attention_decode_batching_overhead_fraction=frac if frac else 0.1,
        nccl_cpu_launch_overhead_ms=0.0,
        nccl_cpu_skew_overhead_per_device_ms=0.0,
        use_native_execution_time_predictor=args.vidur_native,
    )
    replica = ReplicaConfig(
        model_name=name, num_pipeline_stages=1, tensor_parallel_size=args.tp, device="h100",
        network_device="h100_dgx",
    )
    cache = CacheConfig(block_size=args.block_size, num_blocks=None, watermark_blocks_fraction=0.0)
    return predictor_config, replica, cache, name


def build_vidur_predictor(args: argparse.Namespace, latency: Any, work: Path) -> Any:
    predictor_config, replica, cache, _ = vidur_configs(args, latency, work)
    if args.vidur_predictor == "tables":
        preds = predictions_from_tables(latency.tables, latency.grid, latency.grid.kv_limit(latency.model), args.tp)
        return _table_predictor_class()(
            predictions=preds, predictor_config=predictor_config, replica_config=replica, cache_config=cache
        )
    # "trained": Vidur's random forest trained on our offline profiles (shadow_sim.vidur_latency)
    from shadow_sim.vidur_latency import prepare_tables
    from shadow_sim.vidur_profiles import build_profiles

    profiles = build_profiles(latency.model, latency.device, args.tp, latency.grid, latency.bandwidth)
    _, predictor = prepare_tables(profiles, progress=False, keep_predictor=True, cache_dir=work / "tables")
    if args.vidur_native:
        predictor._config.use_native_execution_time_predictor = True
        predictor._native_execution_time_predictor = predictor._init_native_execution_time_predictor()
    return predictor


def write_vidur_trace(requests: Sequence[Request], path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Date", "Time", "PromptTokenCount", "CompletionTokenCount"])
        for arrival, prompt, output in requests:
            w.writerow([TRACE_DATE, repr(arrival), prompt, output])


def run_vidur(requests: Sequence[Request], args: argparse.Namespace, latency: Any, predictor: Any,
              num_blocks: int, trace_csv: Path, work: Path, metrics: bool) -> dict:
    from vidur.config import (
        ClusterConfig,
        MetricsConfig,
        RoundRobinGlobalSchedulerConfig,
        SarathiSchedulerConfig,
        SimulationConfig,
        TraceRequestGeneratorConfig,
    )
    from vidur.entities import Batch, Cluster, Replica
    from vidur.simulator import Simulator

    predictor_config, replica, cache, _ = vidur_configs(args, latency, work)
    cache.num_blocks = num_blocks  # the same KV pool as our instance
    config = SimulationConfig(
        seed=0,
        log_level="warning",
        cluster_config=ClusterConfig(
            num_replicas=1,
            replica_config=replica,
            cache_config=cache,
            global_scheduler_config=RoundRobinGlobalSchedulerConfig(),
            replica_scheduler_config=SarathiSchedulerConfig(batch_size_cap=args.max_seqs, chunk_size=args.chunk),
        ),
        request_generator_config=TraceRequestGeneratorConfig(
            trace_file=str(trace_csv), date=TRACE_DATE, prefill_scale_factor=1.0, decode_scale_factor=1.0,
            time_scale_factor=1.0, max_tokens=args.prompt_cap + args.output_cap,
        ),
        execution_time_predictor_config=predictor_config,
        metrics_config=MetricsConfig(
            write_metrics=metrics, write_json_trace=False, enable_chrome_trace=False, store_plots=False,
            wandb_project=None, save_table_to_wandb=False, output_dir=str(work / "vidur_out"),
        ),
    )
    # Vidur numbers replicas from a process-wide counter and its round-robin
    # scheduler assumes they start at 0: reset it so a second Simulator works.
    Replica._id = Cluster._id = -1
    with _vidur_quiet(), _injected_predictor(predictor):
        setup = time.perf_counter()
        sim = Simulator(config)
        setup = time.perf_counter() - setup
    reqs = [event._request for _, event in sim._event_queue]
    if len(reqs) != len(requests):
        raise RuntimeError(f"Vidur loaded {len(reqs)} requests from its trace, expected {len(requests)}")
    write = [0.0, 0.0]  # wall, cpu of _write_output (excluded)
    write_output = sim._write_output

    def timed_write() -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        write_output()
        write[0], write[1] = time.perf_counter() - wall, time.process_time() - cpu

    sim._write_output = timed_write
    first_batch = Batch._id
    gc.collect()
    with _vidur_quiet():
        wall, cpu = time.perf_counter(), time.process_time()
        sim.run()
        run_wall, run_cpu = time.perf_counter() - wall, time.process_time() - cpu
    done = [r for r in reqs if r.completed]
    return {
        "finished": len(done),
        "rejected": len(reqs) - len(done),
        "sim_s": sim._time,
        "iterations": Batch._id - first_batch,
        "wall_s": run_wall - write[0],
        "cpu_s": run_cpu - write[1],
        "run_wall_s": run_wall,
        "write_output_s": write[0],
        "setup_s": setup,
        "ttft_s": statistics.fmean(r.prefill_completed_at - r.arrived_at for r in done) if done else float("nan"),
        "e2e_s": statistics.fmean(r.completed_at - r.arrived_at for r in done) if done else float("nan"),
        "preemptions": sum(r.num_restarts for r in reqs),
        "kv_blocks": cache.num_blocks,
    }


# ------------------------------------------------------------------------ main
def _best(runs: list[dict]) -> dict:
    return min(runs, key=lambda r: r["wall_s"])


def _code_state() -> str:
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, check=False,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=False).stdout.split("\n")
        files = sorted(line[3:] for line in dirty if line.strip())
        return f"{head}" + (f" + uncommitted changes in {', '.join(files)}" if files else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _print_table(cols: list[tuple[str, dict]]) -> None:
    rows = [
        ("requests finished", "finished", "{:d}"),
        ("requests rejected/unfinished", "rejected", "{:d}"),
        ("simulated seconds", "sim_s", "{:.1f}"),
        ("iterations", "iterations", "{:d}"),
        ("wall seconds (loop)", "wall_s", "{:.3f}"),
        ("CPU seconds (loop)", "cpu_s", "{:.3f}"),
        ("iterations / wall-second", "rate", "{:,.0f}"),
        ("iterations / CPU-second", "cpu_rate", "{:,.0f}"),
        ("simulated s / wall-second", "speed", "{:,.1f}"),
        ("mean TTFT (s)", "ttft_s", "{:.4f}"),
        ("mean end-to-end latency (s)", "e2e_s", "{:.3f}"),
        ("preemptions / restarts", "preemptions", "{:d}"),
        ("KV blocks", "kv_blocks", "{:d}"),
    ]
    width = max(len(r[0]) for r in rows) + 2
    colw = max(20, *(len(name) + 2 for name, _ in cols))
    print("".ljust(width) + "".join(name.rjust(colw) for name, _ in cols))
    for label, key, fmt in rows:
        print(label.ljust(width) + "".join(fmt.format(c[key]).rjust(colw) if key in c else "-".rjust(colw)
                                           for _, c in cols))


def compare(requests: Sequence[Request], args: argparse.Namespace, vlm: Any, ours_latency: Any) -> tuple | None:
    """Both simulators on ``requests``, interleaved; print the table and ratios.
    Returns (ours / Vidur -metrics per CPU-second, per wall-second), or None
    without a Vidur -metrics run."""
    modes = {"both": (True, False), "on": (True,), "off": (False,)}[args.vidur_metrics]
    labels = {True: "vidur +metrics", False: "vidur -metrics"}
    ours_runs: list[dict] = []
    vidur_runs: dict[bool, list[dict]] = {m: [] for m in modes}
    failed: dict[bool, str] = {}
    with tempfile.TemporaryDirectory(prefix="sim_vs_vidur-") as tmp:
        work = Path(tmp)
        trace_csv = work / "trace.csv"
        write_vidur_trace(requests, trace_csv)
        t = time.perf_counter()
        try:
            with _vidur_quiet(logging.CRITICAL):
                predictor = build_vidur_predictor(args, vlm, work)
            print(f"setup     Vidur predictor ({args.vidur_predictor}"
                  f"{', native' if args.vidur_native else ''}) ready in {time.perf_counter() - t:.1f} s")
        except Exception as exc:  # noqa: BLE001 - report exactly what fails, keep our numbers
            print(f"VIDUR FAILED building its predictor: {type(exc).__name__}: {exc}")
            predictor = None
            failed = {m: "predictor" for m in modes}
        for _ in range(max(1, args.repeat)):  # interleaved: load from other processes hits both sides alike
            ours_runs.append(run_ours(requests, args, ours_latency))
            for metrics in modes:
                if metrics in failed:
                    continue
                try:
                    vidur_runs[metrics].append(
                        run_vidur(requests, args, vlm, predictor, ours_runs[0]["kv_blocks"], trace_csv, work, metrics)
                    )
                except Exception as exc:  # noqa: BLE001 - Vidur failing is a result to report
                    failed[metrics] = f"{type(exc).__name__}: {exc}"
                    print(f"VIDUR FAILED ({labels[metrics]}): {failed[metrics]}")

    ours = _best(ours_runs)
    print(f"setup     ours: SimRun construction {ours['setup_s']:.2f} s (latency model: {ours['latency']})")
    results: list[tuple[str, dict]] = [("ours no-shadow", ours)]
    for metrics in modes:
        if vidur_runs[metrics]:
            best = _best(vidur_runs[metrics])
            print(f"setup     {labels[metrics]}: Simulator() {best['setup_s']:.2f} s; run() {best['run_wall_s']:.3f} s "
                  f"of which _write_output() {best['write_output_s']:.3f} s (excluded)")
            results.append((labels[metrics], best))
    for _, r in results:
        r["rate"] = r["iterations"] / r["wall_s"] if r["wall_s"] else float("inf")
        r["cpu_rate"] = r["iterations"] / r["cpu_s"] if r["cpu_s"] else float("inf")
        r["speed"] = r["sim_s"] / r["wall_s"] if r["wall_s"] else float("inf")
    print(f"\nbest of {max(1, args.repeat)} interleaved runs each:")
    _print_table(results)
    print()
    for label, r in results[1:]:
        print(f"ratio ours / {label}: {ours['rate'] / r['rate']:.2f}x iterations per wall-second "
              f"({ours['cpu_rate'] / r['cpu_rate']:.2f}x per CPU-second, "
              f"{ours['speed'] / r['speed']:.2f}x simulated seconds per wall-second); "
              f"mean TTFT ours/vidur {ours['ttft_s'] / r['ttft_s']:.3f}, mean e2e ours/vidur {ours['e2e_s'] / r['e2e_s']:.3f}")
    if args.ours_latency != "full":
        print("note: --ours-latency vidur-model-time looks latencies up through numpy; our rate is not representative")

    off = next((r for label, r in results[1:] if label == labels[False]), None)
    if off is None:
        return None
    return ours["cpu_rate"] / off["cpu_rate"], ours["rate"] / off["rate"]


def at_rate(requests: Sequence[Request], rate_per_s: float) -> list[Request]:
    """The same requests with arrivals scaled so that they come at ``rate_per_s`` on average."""
    span = requests[-1][0]
    k = (len(requests) / rate_per_s) / span if span > 0 else 0.0
    return [(t * k, p, o) for t, p, o in requests]


def _capacity_per_s(args: argparse.Namespace) -> float:
    """The shipped calibrated capacity of ``--model`` on ``--device`` (TP ``--tp``,
    Vidur latency, Azure conversation lengths): what the scale benchmark's rho is of."""
    from shadow_sim.experiments.calibrate import shipped

    for entry in shipped().values():
        if ((entry["model"], entry["device"], entry["tp"], entry["latency"], entry["lengths"])
                == (args.model, args.device, args.tp, "vidur", "azure-conv")):
            return float(entry["capacity_per_s"])
    sys.exit(f"--rho: no shipped capacity for {args.model} on {args.device} TP{args.tp} (pass --rho '')")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000, help="trace rows to replay (default 2000)")
    ap.add_argument("--start", type=int, default=0, help="first trace row (default 0)")
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help=f"Azure LLM trace CSV (default {DEFAULT_TRACE})")
    ap.add_argument("--model", default="Llama-3.1-8B", help="catalog model (default Llama-3.1-8B)")
    ap.add_argument("--device", default="H100-80GB", help="catalog device (default H100-80GB)")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallelism (default 1)")
    ap.add_argument("--chunk", type=int, default=2048, help="token budget / Sarathi chunk size (default 2048)")
    ap.add_argument("--max-seqs", type=int, default=256, help="max running sequences (default 256)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prompt-cap", type=int, default=8192)
    ap.add_argument("--output-cap", type=int, default=1024)
    ap.add_argument("--vidur-predictor", choices=("tables", "trained"), default="tables",
                    help="Vidur's predictor filled from our cached tables (default) or trained now (~30-50 s)")
    ap.add_argument("--vidur-native", action="store_true",
                    help="Vidur's C++ execution-time predictor (use_native_execution_time_predictor)")
    ap.add_argument("--vidur-metrics", choices=("both", "on", "off"), default="both",
                    help="run Vidur with its default metrics, with write_metrics=False, or both (default)")
    ap.add_argument("--ours-latency", choices=("full", "vidur-model-time"), default="full",
                    help="our engine's latency: VidurLatencyModel.predict_s (default) or Vidur's exact model_time")
    ap.add_argument("--repeat", type=int, default=2,
                    help="interleaved runs per simulator; the fastest (wall) of each is reported (default 2)")
    ap.add_argument("--rho", default="0.7",
                    help="also at these loads per instance (comma list; rho x the model's shipped capacity, "
                         "arrivals of the same requests rescaled): the scale benchmark's per-instance load "
                         "(default 0.7; '' for the trace's rate only)")
    ap.add_argument("--profile", type=int, nargs="?", const=15, default=0, metavar="N",
                    help="cProfile our run loop once more and print the top N functions by tottime")
    args = ap.parse_args(argv)

    requests, info = load_trace(args.trace, args.requests, args.start, args.prompt_cap, args.output_cap)
    span = requests[-1][0]
    print(f"code      {_code_state()}; python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    print(f"trace     {args.trace} rows [{args.start}, {args.start + len(requests)})")
    print(f"workload  {len(requests)} requests over {span:.1f} s ({len(requests) / max(span, 1e-9):.2f} req/s); "
          f"prompt mean {statistics.fmean(r[1] for r in requests):.0f} (cap {args.prompt_cap}, "
          f"{info['capped_prompts']} capped), output mean {statistics.fmean(r[2] for r in requests):.0f} "
          f"(cap {args.output_cap}, {info['capped_outputs']} capped)")
    print(f"engine    {args.model} on {args.device} TP{args.tp}, one replica, no shadow; chunk/token budget "
          f"{args.chunk}, max {args.max_seqs} seqs, block {args.block_size}")

    from shadow_sim.vidur_latency import VidurLatencyModel

    t = time.perf_counter()
    vlm = VidurLatencyModel.for_model(args.model, args.device, args.tp, progress=sys.stderr.isatty())
    print(f"setup     VidurLatencyModel ready in {time.perf_counter() - t:.1f} s ({vlm.table_path})")
    ours_latency = None if args.ours_latency == "full" else VidurModelTime(vlm)

    workloads = [(f"the trace's rate ({len(requests) / max(span, 1e-9):.2f} req/s)", requests)]
    for rho in (float(x) for x in args.rho.split(",") if x.strip()):
        cap = _capacity_per_s(args)
        label = f"rho {rho:g} per instance ({rho * cap:.2f} req/s = {rho:g} x the shipped capacity {cap:g} req/s)"
        workloads.append((label, at_rate(requests, rho * cap)))
    ratios = []
    for label, reqs in workloads:
        print(f"\n=== workload: {len(reqs)} requests at {label} ===")
        ratios.append((label, compare(reqs, args, vlm, ours_latency)))
    print(f"\ntargets (issue 17): ours >= {TARGET_X:g}x Vidur's iteration rate with its metrics off")
    for label, r in ratios:
        if r is None:
            print(f"  {label}: no Vidur -metrics run")
            continue
        cpu, wall = r
        print(f"  {label}: {cpu:.1f}x per CPU-second, {wall:.1f}x per wall-second "
              f"[target >= {TARGET_X:g}x: {'MET' if cpu >= TARGET_X else 'NOT MET'}]")

    if args.profile:
        prof = cProfile.Profile()
        run_ours(requests, args, ours_latency, profiler=prof)
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("tottime").print_stats(args.profile)
        print(f"\ncProfile of our run loop (top {args.profile} by tottime; profiling inflates the wall time):")
        print(out.getvalue().strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
