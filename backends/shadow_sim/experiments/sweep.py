"""``shadowprefill sweep`` and the experiment path of ``shadowprefill simulate``.

``sweep`` runs a grid of pairs x policies x seeds x windows: calibration first
(cached), then every run in local worker processes (``--jobs``) or on a Ray
cluster (``--ray [ADDRESS]``; Ray is imported only then). It writes one row per
(pair, seed, window, policy) run to ``runs.parquet`` (pyarrow) or ``runs.csv``,
and the result folder of :mod:`shadow_sim.experiments.output` (per-call
``calls.parquet``, ``summary.json`` with mean and standard error per pair and
policy, ``table.txt``, PNG plots).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from shadow_sim.experiments.calibrate import capacities
from shadow_sim.experiments.distributed import ResultStore, execute_grid
from shadow_sim.experiments.metrics import RunRecord
from shadow_sim.experiments.normal import WINDOWS, CapReport, NormalTraffic
from shadow_sim.experiments.runner import (
    DEFAULT_POLICIES,
    Comparison,
    Task,
    compare,
    format_table,
    run_comparison_records,
    tasks_for,
    with_promise,
)
from shadow_sim.experiments.spec import PAIRS, SIMULATE_DEFAULT, Experiment, get_pair
from shadowcore.cli import HelpFormatter, add_policy_options, describe, load_scenario, policies_from_args
from shadowcore.config import PluginRef, ShadowConfig, parse_ref
from shadowcore.errors import ConfigError, PluginError


def simulate_table(scenario: Mapping[str, Any], configs: Sequence[ShadowConfig], *,
                   jobs: int | None = None, out: Path | None = None, wide: bool = False) -> str | None:
    """The ``simulate`` table for an experiment (its runs' warnings first), or
    None for a plain SimScenario (the caller runs it the plain way). Empty
    ``scenario`` (or only ``duration_s``): the embedded default;
    ``{"experiment": {...}}``: that experiment. ``jobs`` (default: one process
    per run, at most one more than the CPUs; three runs on two cores finish in
    1.5 run-times instead of 2). ``out``: also write the result folder there
    (:mod:`shadow_sim.experiments.output`); ``wide``: every column."""
    data = dict(scenario)
    replay = {k: data.pop(k) for k in ("sessions", "session_router") if k in data}  # simulate --sessions, --router
    if set(data) <= {"duration_s", "latency_profile"}:
        base = dict(SIMULATE_DEFAULT)
        if replay.get("sessions"):  # the file's sessions set the measured window unless --duration does
            base.pop("duration_s")
        ex = Experiment.from_dict({**base, **data, **replay})
    elif "experiment" in data:
        extra = {k: v for k, v in data.items() if k != "experiment"}
        ex = Experiment.from_dict({**data["experiment"], **extra, **replay})
    elif replay:
        sessions = replay.get("sessions")
        raise ConfigError("--sessions", sessions, "replays into an experiment: give no --scenario, or one with "
                          "{\"experiment\": {...}} (a plain scenario draws its own sessions)")
    else:
        return None
    refs = [c.policy for c in configs]
    seeds = sorted({c.seed for c in configs})
    if jobs is None:
        jobs = max(1, min(len(refs) * len(seeds), (os.cpu_count() or 1) + 1))
    c, tasks, records = run_comparison_records(ex, refs, seeds=seeds, jobs=jobs, progress=True)
    caps = ex.normal.cap_report()
    text = "\n".join([f"warning: {n}" for n in c.notices] + [format_table(c, wide=wide)])
    text += f"\n{caps.line()}" if caps is not None else ""
    if out is not None:
        from shadow_sim.experiments.output import write_comparisons

        extra = {"normal_caps": attrs.asdict(caps)} if caps is not None else {}
        paths = write_comparisons(out, tasks, records, {"": c}, extra)
        text += f"\nwrote {', '.join(p.name for p in paths)} to {out}"
    return text


# -- sweep -----------------------------------------------------------------------------


def csv_list(text: str) -> list[str]:
    """A plain comma list (pairs, seeds, windows); policies use :func:`shadowcore.config.parse_refs`."""
    return [x.strip() for x in text.split(",") if x.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shadowprefill sweep", description=describe(main.__doc__) + " " + _DETAIL,
                                formatter_class=HelpFormatter)
    p.add_argument("--pairs", default="Q7/L70", help=f"comma-separated pairs ({', '.join(PAIRS)})")
    add_policy_options(p, DEFAULT_POLICIES)
    p.add_argument("--seeds", default="0", help="comma-separated seeds")
    p.add_argument("--windows", default="peak", help=f"comma-separated windows ({', '.join(WINDOWS)})")
    p.add_argument("--experiment", help="JSON file with Experiment fields (pair/models are set per grid point)")
    p.add_argument("--preset", help="session preset (default: the experiment's, fusionbench)")
    p.add_argument("--duration", type=float, help="measured seconds")
    p.add_argument("--warmup", type=float, help="warm-up seconds")
    p.add_argument("--rho", type=float, help="normal-traffic load relative to capacity")
    p.add_argument("--normal-trace", help="replay this trace file as normal traffic (Azure, BurstGPT, ...)")
    p.add_argument("--max-prompt", type=_cap, help="cap of normal-trace prompts (default 8192; 'none': no cap)")
    p.add_argument("--max-output", type=_cap, help="cap of normal-trace outputs (default 1024; 'none': no cap)")
    p.add_argument("--no-prefix-sharing", action="store_true",
                   help="replay a normal trace's prompts fresh, ignoring its prefix-block hashes (Mooncake hash_ids)")
    p.add_argument("--sessions", help="replay this session-trace file instead of the preset (shadowprefill sessions)")
    p.add_argument("--router", metavar="NAME[:JSON]",
                   help="re-route the --sessions file: markov, accuracy-per-cost or a plugin (default: replay)")
    p.add_argument("--latency", choices=("vidur", "roofline", "auto"), help="latency model")
    p.add_argument("--latency-profile", metavar="NAME|FILE",
                   help="calibrate the latency model: a shipped profile or a JSON file (shadowprefill latency)")
    p.add_argument("--instances", type=int, help="instances per model")
    p.add_argument("--capacity", help="skip calibration: MODEL=REQ_PER_S,... per instance (every model of the grid)")
    p.add_argument("--jobs", type=int, default=2, help="local worker processes")
    p.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
                   help="run on a Ray cluster (ADDRESS: auto = the running cluster, local = start one here, "
                        "or ray://host:port)")
    p.add_argument("--max-retries", type=int, default=3, help="Ray: times a task is retried when its worker dies")
    p.add_argument("--out", default="sweep-out",
                   help="output folder; finished runs are kept in OUT/parts and a rerun skips them")
    p.add_argument("--fresh", action="store_true", help="ignore (delete) finished runs in OUT/parts")
    p.add_argument("--format", choices=("parquet", "csv"), default="parquet", help="format of the per-run rows")
    p.add_argument("--wide", action="store_true", help="print every column (default: the key ones, < 120 chars)")
    return p


def experiment_from_args(args: argparse.Namespace) -> dict[str, Any]:
    data: dict[str, Any] = {}
    if args.experiment:
        data = load_scenario(args.experiment)
    for flag, key in (("preset", "preset"), ("sessions", "sessions"), ("duration", "duration_s"),
                      ("warmup", "warmup_s"), ("latency", "latency"), ("latency_profile", "latency_profile"),
                      ("instances", "instances_per_model")):
        if getattr(args, flag) is not None:
            data[key] = getattr(args, flag)
    if getattr(args, "router", None) is not None:
        data["session_router"] = parse_ref(args.router, "--router").to_dict()
    normal = dict(data.get("normal", {}))
    if args.rho is not None:
        normal["rho"] = args.rho
    if args.normal_trace:
        normal.update(kind="trace", source=args.normal_trace)
    if getattr(args, "no_prefix_sharing", False):
        normal["prefix_sharing"] = False
    for flag, key in (("max_prompt", "max_prompt_tokens"), ("max_output", "max_output_tokens")):
        if getattr(args, flag, None) is not None:
            normal[key] = None if getattr(args, flag) == "none" else getattr(args, flag)
    if normal:
        data["normal"] = normal
    return data


def _cap(text: str) -> int | str:
    if text.strip().lower() == "none":
        return "none"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: an integer number of tokens, or none") from None


def _capacity(text: str | None) -> dict[str, float] | None:
    if text is None:
        return None
    out = {}
    for item in csv_list(text):
        model, sep, rate = item.partition("=")
        try:
            value = float(rate)
        except ValueError:
            value = math.nan
        if not sep or not value > 0:
            raise ConfigError("--capacity", item, "must be MODEL=REQ_PER_S with a rate > 0")
        out[model.strip()] = value
    return out


def rows(comparisons: Mapping[str, Comparison]) -> list[dict[str, Any]]:
    out = []
    for label, c in comparisons.items():
        for seed, window, metrics in c.per_run:
            for policy, m in metrics.items():
                out.append({"pair": label, "seed": seed, "window": window, "policy": policy,
                            **{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in m.items()}})
    return out


def write_rows(table: list[dict[str, Any]], out: Path, fmt: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = out / "runs.parquet"
        pq.write_table(pa.Table.from_pylist(table), path)
        return path
    path = out / "runs.csv"
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(table[0]) if table else [])
        w.writeheader()
        w.writerows(table)
    return path


def run_grid(base: Mapping[str, Any], pairs: Sequence[str], refs: Sequence[PluginRef], seeds: Sequence[int],
             windows: Sequence[str], *, jobs: int = 2, ray_address: str | None = None,
             progress: bool = True, capacity: Mapping[str, float] | None = None,
             store: ResultStore | None = None, max_retries: int = 3) -> dict[str, Comparison]:
    """Calibrate (or take ``capacity``), run every task not already in ``store``
    (locally or on Ray), save each as it finishes, compare."""
    return run_grid_records(base, pairs, refs, seeds, windows, jobs=jobs, ray_address=ray_address,
                            progress=progress, capacity=capacity, store=store, max_retries=max_retries)[0]


def run_grid_records(base: Mapping[str, Any], pairs: Sequence[str], refs: Sequence[PluginRef],
                     seeds: Sequence[int], windows: Sequence[str], *, jobs: int = 2, ray_address: str | None = None,
                     progress: bool = True, capacity: Mapping[str, float] | None = None,
                     store: ResultStore | None = None, max_retries: int = 3,
                     ) -> tuple[dict[str, Comparison], list[Task], list[RunRecord]]:
    """:func:`run_grid`, with the tasks and their records (the per-call data)."""
    tasks: list[Task] = []
    experiments: dict[str, tuple[Experiment, dict[str, float]]] = {}
    for pair in pairs:
        data = {k: v for k, v in base.items() if k not in ("models", "pair")}
        ex = Experiment.from_dict({**data, "models": list(get_pair(pair))})
        if capacity is not None:
            missing = [m for m in ex.models if m not in capacity]
            if missing:
                raise ConfigError("--capacity", dict(capacity), f"no capacity for {', '.join(missing)}")
            caps = {m: capacity[m] for m in ex.models}
        else:
            caps = {m: c.capacity_per_s for m, c in capacities(ex, progress=progress).items()}
        tasks += tasks_for(ex, refs, seeds, windows, caps, pair)
        experiments[pair] = (ex, caps)
    records = execute_grid(tasks, jobs=jobs, progress=progress, store=store, ray_address=ray_address,
                           max_retries=max_retries)
    comparisons = {label: with_promise(c, *experiments[label], windows) for label, c in compare(records, tasks).items()}
    return comparisons, tasks, records


_DETAIL = ("Calibration first (cached), then every run in local worker processes (--jobs) or on a Ray cluster "
           "(--ray). Writes one row per (pair, seed, window, policy) run to runs.parquet or runs.csv, and "
           "the result folder: per-call calls.parquet, summary.json with mean and standard error per pair and "
           "policy, table.txt and PNG plots (shadowprefill plot).")


def main(argv: Sequence[str] | None = None) -> int:
    """Run a grid of pairs x policies x seeds x windows on the simulator and write every run plus a summary."""
    args = parser().parse_args(argv)
    try:
        pairs = csv_list(args.pairs)
        for p in pairs:
            get_pair(p)
        windows = csv_list(args.windows)
        for w in windows:
            if w not in WINDOWS:
                raise ConfigError("--windows", w, f"unknown window (valid: {', '.join(WINDOWS)})")
        try:
            seeds = [int(s) for s in csv_list(args.seeds)]
        except ValueError:
            raise ConfigError("--seeds", args.seeds, "must be comma-separated integers") from None
        refs = policies_from_args(args, DEFAULT_POLICIES)
        if args.max_retries < 0:
            raise ConfigError("--max-retries", args.max_retries, "must be >= 0")
        store = ResultStore(Path(args.out) / "parts")
        if args.fresh:
            for part in store.folder.glob("*.parquet"):
                part.unlink()
        comparisons, tasks, records = run_grid_records(
            experiment_from_args(args), pairs, refs, seeds, windows, jobs=args.jobs, ray_address=args.ray,
            capacity=_capacity(args.capacity), store=store, max_retries=args.max_retries)
    except (ConfigError, PluginError) as e:
        print(f"shadowprefill sweep: error: {e}", file=sys.stderr)
        return 2
    from shadow_sim.experiments.output import write_comparisons

    out = Path(args.out)
    path = write_rows(rows(comparisons), out, args.format)
    caps = _cap_report(experiment_from_args(args))
    extra = {"normal_caps": attrs.asdict(caps)} if caps is not None else {}  # the caps are never silent
    written = write_comparisons(out, tasks, records, comparisons, extra)
    for notice in dict.fromkeys(n for c in comparisons.values() for n in c.notices):
        print(f"warning: {notice}")
    for label, c in comparisons.items():
        print(f"== {label}")
        print(format_table(c, wide=args.wide))
    if caps is not None:
        print(caps.line())
    print(f"wrote {path.name}, {', '.join(p.name for p in written)} to {out}")
    return 0


def _cap_report(data: Mapping[str, Any]) -> CapReport | None:
    from shadowcore.config import build_attrs

    return build_attrs(NormalTraffic, "normal", data.get("normal", {})).cap_report()


__all__ = ["csv_list", "main", "run_grid", "simulate_table"]
