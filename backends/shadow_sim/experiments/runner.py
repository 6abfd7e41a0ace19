"""The runner (§5.1): one experiment under several policies with the same seed,
over seeds x windows, compared on matched calls, mean +- 1 standard error.

Every (seed, window, policy) run is independent and deterministic, so the
runner can execute them in any order, in this process or in worker processes
(:func:`run_grid` with ``jobs > 1``, or Ray via :mod:`shadow_sim.experiments.sweep`).
"""

from __future__ import annotations

import math
import multiprocessing
import signal
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from shadow_sim.experiments.calibrate import ProbeSettings, capacities, promise
from shadow_sim.experiments.metrics import Call, RunRecord, aggregate, compare_runs, mean_se
from shadow_sim.experiments.spec import Experiment, ExperimentRun
from shadowcore.config import PluginRef, ShadowConfig, policy_label
from shadowcore.errors import ConfigError

DEFAULT_POLICIES = ("no-shadow", "harvest-slo-host", "oracle-host")
DEFAULT_PROBE = ProbeSettings()


@attrs.frozen
class Task:
    """One run of a grid (picklable: it travels to worker processes)."""

    experiment: Experiment
    policy: PluginRef
    seed: int
    window: str
    capacity: Mapping[str, float]
    label: str = ""  # the grid point's name (a pair, a setting)

    @property
    def name(self) -> str:
        return policy_label(self.policy)




def run_task(task: Task) -> RunRecord:
    ex = task.experiment
    if ex.normal.window != task.window:
        ex = attrs.evolve(ex, normal=attrs.evolve(ex.normal, window=task.window))
    run = ExperimentRun(ex.sim_scenario(task.seed), ShadowConfig(task.policy, seed=task.seed), experiment=ex,
                        capacity=dict(task.capacity))
    result = run.run()
    workload = run.workload
    outputs = {(p.session_id, i): c.num_output_tokens for p in workload.sessions for i, c in enumerate(p.calls)}
    measured = frozenset(p.session_id for p in workload.sessions if ex.warmup_s <= p.arrival_s < ex.end_s)
    calls = tuple(
        Call(c.session_id, c.call_index, c.model, c.is_switch, c.ttft_s, c.latency_s, c.num_prompt_tokens,
             c.num_cached_tokens, outputs[(c.session_id, c.call_index)])
        for c in result.calls
    )
    normal_met = tuple(met for arrival, met in run.normal if ex.warmup_s <= arrival < ex.end_s)
    measured_normal = [(p, c) for arrival, p, c in run.normal_tokens if ex.warmup_s <= arrival < ex.end_s]
    prompt = sum(p for p, _ in measured_normal)
    m = {**result.metrics,  # the measured window's normal prefix hits (the run's summary counts from warmup on)
         "normal_hit_rate": sum(c for _, c in measured_normal) / prompt if prompt else math.nan}
    return RunRecord(
        task.name, task.seed, task.window, calls, measured, normal_met,
        sum(r.num_prompt_tokens for r in workload.normal), m["shadow_tokens"], m["shadow_tokens_used"], m["energy_j"],
        m["energy_per_good_request_j"], run.loop.now_s, dict(m), tuple(result.notices),
    )


def tasks_for(ex: Experiment, policies: Sequence[PluginRef], seeds: Iterable[int], windows: Iterable[str],
              capacity: Mapping[str, float], label: str = "") -> list[Task]:
    return [Task(ex, p, s, w, dict(capacity), label) for s in seeds for w in windows for p in policies]


def execute(tasks: Sequence[Task], jobs: int = 1, on_done: Callable[[Task, RunRecord], None] | None = None,
            ) -> list[RunRecord]:
    """Run ``tasks`` (in worker processes when ``jobs > 1``); results in task order.

    Workers ignore SIGINT (Ctrl-C reaches the whole process group; the parent
    answers it). However this process stops -- Ctrl-C, SIGTERM turned into
    ``SystemExit`` (:func:`shadowcore.cli.exit_on_sigterm`), a failed run -- the
    pool is terminated and joined (``multiprocessing.Pool.terminate``, made for
    exactly this; ``ProcessPoolExecutor``'s shutdown after killing its workers
    raced its own feeder thread): no worker outlives it."""
    results: list[RunRecord | None] = [None] * len(tasks)
    if jobs <= 1:
        for i, t in enumerate(tasks):
            results[i] = run_task(t)
            if on_done:
                on_done(t, results[i])
        return [r for r in results if r is not None]
    pool = multiprocessing.Pool(processes=jobs, initializer=_worker_signals)
    try:
        for i, record in pool.imap_unordered(_run_indexed, enumerate(tasks)):
            results[i] = record
            if on_done:
                on_done(tasks[i], record)
    except BaseException:
        pool.terminate()  # runs in flight are abandoned
        raise
    else:
        pool.close()
    finally:
        pool.join()
    return [r for r in results if r is not None]


def _run_indexed(item: tuple[int, Task]) -> tuple[int, RunRecord]:
    return item[0], run_task(item[1])


def _worker_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # terminate() ends a worker at once, whatever the parent set


def group(records: Sequence[RunRecord], tasks: Sequence[Task]) -> dict[tuple[str, int, str], list[RunRecord]]:
    """Records by (label, seed, window)."""
    out: dict[tuple[str, int, str], list[RunRecord]] = {}
    for t, r in zip(tasks, records):
        out.setdefault((t.label, t.seed, t.window), []).append(r)
    return out


def baseline_and_oracle(names: Sequence[str]) -> tuple[str, str | None]:
    base = "no-shadow" if "no-shadow" in names else names[0]
    oracle = next((n for n in ("oracle-host", "oracle") if n in names), None)
    return base, oracle


@attrs.frozen
class Comparison:
    """Per run and aggregated metrics of one grid label.

    ``steps``: per policy, its steps by reason summed over runs
    (``steps_*`` of the runs' summaries); ``silent``: the policies that can
    shadow (their controller is not ``never_grants``) but planned no shadow
    token in any run; ``notices``: the runs' warnings, each once."""

    label: str
    policies: tuple[str, ...]
    baseline: str
    oracle: str | None
    per_run: tuple[tuple[int, str, Mapping[str, Mapping[str, float]]], ...]  # (seed, window, metrics)
    summary: Mapping[str, Mapping[str, tuple[float, float]]]  # policy -> metric -> (mean, SE)
    steps: Mapping[str, Mapping[str, float]] = attrs.field(factory=dict)
    silent: tuple[str, ...] = ()
    notices: tuple[str, ...] = ()
    #: What calibration promised the normal traffic, beside what it got (:func:`with_promise`); None: not asked.
    promise: Mapping[str, Any] | None = None


def _can_shadow(ref: PluginRef) -> bool:
    from shadowcore.policy import load_policy

    return not load_policy(ref).slack.cls.never_grants


def compare(records: Sequence[RunRecord], tasks: Sequence[Task]) -> dict[str, Comparison]:
    """Comparisons by grid label."""
    by_label: dict[str, list[tuple[int, str, dict]]] = {}
    names: dict[str, tuple[str, ...]] = {}
    for (label, seed, window), runs in group(records, tasks).items():
        policies = tuple(r.policy for r in runs)
        base, oracle = baseline_and_oracle(policies)
        names[label] = policies
        by_label.setdefault(label, []).append((seed, window, compare_runs(runs, base, oracle)))
    out = {}
    for label, runs in by_label.items():
        base, oracle = baseline_and_oracle(names[label])
        mine = [(t, r) for t, r in zip(tasks, records) if t.label == label]
        steps: dict[str, dict[str, float]] = {}
        shadowed: dict[str, float] = {}
        refs: dict[str, PluginRef] = {}
        notices: dict[str, None] = {}
        for t, r in mine:
            refs[t.name] = t.policy
            shadowed[t.name] = shadowed.get(t.name, 0.0) + r.shadow_tokens
            row = steps.setdefault(t.name, {})
            for k, v in r.summary.items():
                if k.startswith("steps_"):
                    row[k[6:]] = row.get(k[6:], 0.0) + v
            notices.update(dict.fromkeys(r.notices))
        silent = tuple(p for p in names[label] if shadowed.get(p, 0.0) == 0 and _can_shadow(refs[p]))
        out[label] = Comparison(label, names[label], base, oracle, tuple(runs), aggregate([m for _, _, m in runs]),
                                steps, silent, tuple(notices))
    return out


def run_comparison(ex: Experiment, policies: Sequence[PluginRef | str], seeds: Sequence[int] = (0,),
                   windows: Sequence[str] = ("peak",), *, jobs: int = 1, progress: bool = False,
                   settings: ProbeSettings = DEFAULT_PROBE, label: str = "") -> Comparison:
    """Calibrate, run every (seed, window, policy), compare."""
    return run_comparison_records(ex, policies, seeds, windows, jobs=jobs, progress=progress,
                                  settings=settings, label=label)[0]


def run_comparison_records(ex: Experiment, policies: Sequence[PluginRef | str], seeds: Sequence[int] = (0,),
                           windows: Sequence[str] = ("peak",), *, jobs: int = 1, progress: bool = False,
                           settings: ProbeSettings = DEFAULT_PROBE, label: str = "",
                           ) -> tuple[Comparison, list[Task], list[RunRecord]]:
    """:func:`run_comparison`, with the tasks and their records (the per-call data)."""
    refs = [p if isinstance(p, PluginRef) else PluginRef(p) for p in policies]
    if len({policy_label(r) for r in refs}) != len(refs):
        raise ConfigError("policies", [policy_label(r) for r in refs], "each policy may appear once")
    caps = {m: c.capacity_per_s for m, c in capacities(ex, settings, progress=progress).items()}
    tasks = tasks_for(ex, refs, seeds, windows, caps, label)
    records = with_progress(tasks, jobs, progress)
    return with_promise(compare(records, tasks)[label], ex, caps, windows, settings), tasks, records


def with_promise(c: Comparison, ex: Experiment, capacity: Mapping[str, float], windows: Sequence[str],
                 settings: ProbeSettings = DEFAULT_PROBE) -> Comparison:
    """``c`` with the normal SLO attainment calibration promised (the probe at the
    run's rate, arrival process and window: :func:`~shadow_sim.experiments.calibrate.promise`,
    the mean over ``windows``) next to what each policy got (its mean over runs).
    Unchanged when a model has no capacity (nothing was calibrated)."""
    if any(m not in capacity for m in ex.models):
        return c
    promises = [promise(ex, dict(capacity), w, settings) for w in windows]
    got = {p: c.summary[p]["normal_slo_attainment"][0] for p in c.policies}
    value = {
        "arrivals": promises[0].arrivals, "rho": ex.normal.rho, "windows": list(windows),
        "per_model": {m: float(np.mean([pr.per_model[m] for pr in promises])) for m in ex.models},
        "promised": float(np.mean([pr.attainment for pr in promises])), "got": got,
        "line": attrs.evolve(promises[0], window="/".join(windows),
                             attainment=float(np.mean([pr.attainment for pr in promises]))).line(got),
    }
    return attrs.evolve(c, promise=value)


Executor = Callable[..., list[RunRecord]]  # (tasks, on_done) -> records in task order


def with_progress(tasks: Sequence[Task], jobs: int, progress: bool, *,
                  on_done: Callable[[Task, RunRecord], None] | None = None,
                  executor: Executor | None = None) -> list[RunRecord]:
    """Run ``tasks`` with a progress bar over tasks as they finish. ``executor(tasks,
    on_done)`` runs them (default: :func:`execute` with ``jobs`` local processes);
    ``on_done`` is called for each finished task, before the bar moves."""
    run = executor or (lambda ts, cb: execute(ts, jobs, cb))
    if not progress:
        return run(tasks, on_done)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  transient=False) as bar:
        job = bar.add_task("simulating", total=len(tasks))

        def done(t: Task, r: RunRecord) -> None:
            if on_done:
                on_done(t, r)
            bar.update(job, advance=1, description=f"{t.label or 'run'} seed {t.seed} {t.window} {t.name}")

        if jobs <= 1:
            bar.update(job, description=f"{tasks[0].name} ..." if tasks else "")
        return run(tasks, done)



# -- tables ---------------------------------------------------------------------------

#: Every column (``--wide``): (metric, title, kind).
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("call_latency_s", "call lat (s)", "abs"),
    ("switch_latency_s", "switch lat (s)", "abs"),
    ("switch_ttft_s", "switch TTFT (s)", "abs"),
    ("call_latency_red", "call lat red", "pct"),
    ("switch_latency_red", "switch lat red", "pct"),
    ("switch_ttft_red", "switch TTFT red", "pct"),
    ("task_time_red", "task time red", "pct"),
    ("hit_rate", "hit rate", "pct"),
    ("switch_hit_rate", "switch hit", "pct"),
    ("token_cost_red", "cost red", "pct"),
    ("normal_slo_attainment", "normal SLO", "pct"),
    ("normal_slo_pp", "SLO (pp)", "pp"),
    ("normal_hit_rate", "normal hit", "pct"),
    ("energy_inc", "energy/good", "pct"),
    ("shadow_unused_share", "unused shadow", "pct"),
    ("prefill_tput_inc", "prefill tput", "pct"),
    ("oracle_gain_switch", "oracle gain", "pct"),
)
#: The default columns: they fit 120 characters with the usual policy names.
KEY_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("switch_ttft_s", "sw TTFT (s)", "abs"),
    ("call_latency_red", "lat red", "pct"),
    ("switch_latency_red", "sw lat red", "pct"),
    ("switch_ttft_red", "sw TTFT red", "pct"),
    ("switch_hit_rate", "sw hit", "pct"),
    ("normal_slo_pp", "SLO pp", "pp"),
    ("oracle_gain_switch", "oracle gain", "pct"),
)
#: What each metric is (the table's legend); "{base}" and "{oracle}" are filled in.
LEGEND: dict[str, str] = {
    "call_latency_s": "mean latency (to last token) of the matched calls",
    "switch_latency_s": "mean latency of the matched switch calls (the call goes to another model than the last)",
    "switch_ttft_s": "mean time to first token of the matched switch calls",
    "call_latency_red": "reduction of the mean call latency against {base} (positive is better)",
    "switch_latency_red": "reduction of the mean switch-call latency against {base}",
    "switch_ttft_red": "reduction of the mean switch-call TTFT against {base}",
    "task_time_red": "reduction of the LLM time per task (sum of a session's call latencies) against {base}",
    "hit_rate": "cached prompt tokens / prompt tokens, all matched calls",
    "switch_hit_rate": "cached prompt tokens / prompt tokens, matched switch calls",
    "token_cost_red": "reduction of the routed token cost (cached input at 10%) against {base}",
    "normal_slo_attainment": "share of normal requests that met both SLOs",
    "normal_slo_pp": "change of the normal requests' SLO attainment against {base}, percentage points",
    "normal_hit_rate": "cached prompt tokens / prompt tokens of the measured normal requests (prefix sharing)",
    "energy_inc": "change of GPU energy per good request against {base}",
    "shadow_unused_share": "share of shadow tokens whose KV no switch call used (extra hits over {base})",
    "prefill_tput_inc": "change of prefill tokens/s (routed uncached + normal + shadow) against {base}",
    "oracle_gain_switch": "share of {oracle}'s switch-latency reduction this policy gets: (base - policy) / (base - oracle)",
}
SILENT_MARK = "!"
#: The default table's width limit (characters).
TABLE_WIDTH = 120


def _cell(mean: float, se: float, kind: str) -> str:
    if math.isnan(mean):
        return "-"
    if kind == "abs":
        s = f"{mean:.3f}"
        return s + (f"±{se:.3f}" if not math.isnan(se) else "")
    if kind == "pp":
        s = f"{100 * mean:+.2f}"
        return s + (f"±{100 * se:.2f}" if not math.isnan(se) else "")
    s = f"{100 * mean:.1f}%"
    return s + (f"±{100 * se:.1f}" if not math.isnan(se) else "")


def aligned(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """``header``, a rule and ``rows``, the first column left-aligned, the others right-aligned."""
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(x.rjust(w) if i else x.ljust(w) for i, (x, w) in enumerate(zip(cells, widths)))

    return [line(header), line(["-" * w for w in widths])] + [line(r) for r in rows]


def legend(columns: Sequence[tuple[str, str, str]], base: str, oracle: str | None) -> list[str]:
    """One line per column: its title and what it is."""
    width = max((len(title) for _, title, _ in columns), default=0)
    out = []
    for key, title, _ in columns:
        if key == "oracle_gain_switch" and oracle is None:
            text = "share of an oracle's switch-latency reduction (no oracle policy compared: -)"
        else:
            text = LEGEND[key].format(base=base, oracle=oracle)
        out.append(f"  {title.ljust(width)}  {text}")
    return out


def format_table(c: Comparison, columns: Sequence[tuple[str, str, str]] | None = None, *,
                 wide: bool = False) -> str:
    """A text table, one row per policy, then a legend of its columns; ± is
    one standard error over seeds x windows. ``columns`` (default:
    :data:`KEY_COLUMNS`, or every one of :data:`COLUMNS` when ``wide``)."""
    fit = columns is None and not wide
    columns = list((COLUMNS if wide else KEY_COLUMNS) if columns is None else columns)
    left_out: list[str] = []
    while True:
        header = ["policy"] + [title for _, title, _ in columns]
        rows = [[p + (SILENT_MARK if p in c.silent else "")] + [_cell(*c.summary[p][key], kind)
                                                                 for key, _, kind in columns] for p in c.policies]
        if not fit or len(columns) <= 1 or max(map(len, aligned(header, rows))) <= TABLE_WIDTH:
            break
        left_out.insert(0, columns.pop()[1])  # long policy names: the last key columns make room
    n = len(c.per_run)
    calls = c.summary[c.baseline]["calls"][0]
    se = ("± is one standard error over the runs" if n > 1 else "one run: no standard error (give more seeds)")
    note = [f"{n} run(s) (seeds x windows); matched calls per run: {calls:.0f}; {se}",
            f"reductions and changes against {c.baseline}"]
    if c.silent:
        note.append(f"{SILENT_MARK} planned no shadow token in any run although it can shadow "
                    f"({', '.join(c.silent)}): see the warnings above")
    note += oracle_notes(c)
    note += normal_hit_notes(c, [key for key, _, _ in columns])
    if c.promise is not None:
        note.append(c.promise["line"])
    if left_out:
        note.append(f"left out to fit {TABLE_WIDTH} columns: {', '.join(left_out)} (--wide shows every column)")
    return "\n".join(aligned(header, rows) + note + legend(columns, c.baseline, c.oracle))


def normal_hit_notes(c: Comparison, shown: Sequence[str] = ()) -> list[str]:
    """One line with every policy's normal-traffic prefix hit rate, when some
    run's normal requests hit cached prefixes (a trace with block hashes) and
    the table has no such column."""
    rates = {p: c.summary[p].get("normal_hit_rate", (math.nan, math.nan)) for p in c.policies}
    if "normal_hit_rate" in shown or not any(m > 0 for m, _ in rates.values()):
        return []
    cells = ", ".join(f"{p} {_cell(m, se, 'pct')}" for p, (m, se) in rates.items())
    return [f"normal-traffic prefix hit rate (cached / prompt tokens of measured normal requests): {cells}"]


def oracle_notes(c: Comparison, metric: str = "switch_latency_red") -> list[str]:
    """A line per policy whose ``metric`` beats the oracle's: the oracle is
    meant to bound every policy, and when it does not the runs are too few or
    too short to tell them apart; the line gives the per-run difference (mean
    ± 1 SE over runs) that shows it."""
    if c.oracle is None:
        return []
    out = []
    for p in c.policies:
        if p in (c.oracle, c.baseline):
            continue
        diffs = [m[p][metric] - m[c.oracle][metric] for _s, _w, m in c.per_run
                 if p in m and c.oracle in m and not math.isnan(m[p][metric] - m[c.oracle][metric])]
        if not diffs or sum(diffs) <= 0:
            continue
        mean, se = mean_se(diffs)
        spread = f"±{100 * se:.1f} (1 SE, {len(diffs)} runs)" if not math.isnan(se) else "(one run, no SE)"
        out.append(f"{c.oracle} does not bound {p}: {metric} {100 * mean:+.1f} pp above it {spread}: "
                   "add seeds or time")
    return out


def summary_json(c: Comparison) -> dict[str, Any]:
    return {
        "label": c.label, "baseline": c.baseline, "oracle": c.oracle, "runs": len(c.per_run),
        "policies": {p: {k: {"mean": v[0], "se": v[1]} for k, v in m.items()} for p, m in c.summary.items()},
        "steps": {p: dict(m) for p, m in c.steps.items()}, "silent": list(c.silent), "notices": list(c.notices),
        **({"normal_slo_promise": {k: v for k, v in c.promise.items() if k != "line"}} if c.promise else {}),
    }
