"""``shadowprefill reproduce [--quick]``: analogues of the paper's Figures 4, 5,
6, 8, 9 (load panel), 15 (switch rate) and 16 (models per router) as PNG, and a
Markdown table of our numbers next to the paper's (:mod:`paper_numbers`).

The grid: a main study (pairs x policies), a load study (rho), a switch-rate
study (Markov router) and a models-per-router study (N = 2, 3, 5 small models,
all targets vs top-1 vs our ``adaptive-host``, ``benefit-host`` and
``idle-first-host``); the main study also runs ``imminent-host``, issue 16
item 7's policy (:data:`ITEM7_POLICY`), with its bar. ``--quick`` shrinks the grid and the measurement (2 instances per model, 180 s measured, one seed, peak window)
to finish in under 30 minutes on 2 cores; the full grid uses the paper's
settings (4 instances, 600 s after 120 s warm-up, 3 seeds x 3 windows).
``--studies``/``--pairs``/``--seeds``/``--windows``/``--only-policies`` run part
of either (:class:`Grid`; the table's title names the cut), and
``--latency-profile`` puts a latency profile under every study. The table
judges each of our numbers against the paper's with
:func:`~shadow_sim.experiments.paper_numbers.verdict` (within +-30% relative),
the one rule ``--testbed`` uses too.

``--testbed`` runs the paper's GPU testbed instead (Section 6, Appendix D:
Q7/L70, L8/L70, S7/S32, S7/Q72, one instance per model, rho 0.3 and 0.5) on
vLLM's scheduler in virtual time (:mod:`shadow_vllm.virtual.testbed`) and
prints each testbed number of the paper next to ours and whether it is within
+-30%; ``--testbed --quick`` is one pair at 5% of the length (under a minute).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from shadow_sim.experiments.calibrate import capacities
from shadow_sim.experiments.distributed import ResultStore, execute_grid
from shadow_sim.experiments.normal import WINDOWS
from shadow_sim.experiments.output import no_nan
from shadow_sim.experiments.paper_numbers import PAPER, TOLERANCE, verdict
from shadow_sim.experiments.runner import (
    Comparison,
    Task,
    compare,
    format_table,
    summary_json,
    tasks_for,
    with_promise,
)
from shadow_sim.experiments.spec import PAIRS, Experiment
from shadow_sim.experiments.sweep import rows, write_rows
from shadow_sim.latency import resolve_profile
from shadowcore.cli import HelpFormatter, add_policy_options, describe, policies_from_args
from shadowcore.config import PluginRef, policy_label
from shadowcore.errors import ConfigError, PluginError

MAIN_POLICIES = ("no-shadow", "host-tier", "harvest", "harvest-slo", "harvest-slo-host", "adaptive-host",
                 "benefit-host", "idle-first-host", "imminent-host", "oracle", "oracle-host")
#: Issue 16 item 7's policy: the simulator's bar (>= 75% of the oracle's switch-call gain, normal SLO not lower,
#: energy at most +1%) is printed for it under its own rows; ``reproduce --testbed`` runs it on vLLM.
ITEM7_POLICY = "imminent-host"
SHORT = ("no-shadow", "harvest-slo", "harvest-slo-host", "oracle-host")
N_MODELS = ("Qwen2.5-7B", "Mistral-7B", "Llama-3.1-8B", "Mistral-Nemo-12B", "gpt-oss-20b")

QUICK = {"instances_per_model": 2, "duration_s": 180.0, "warmup_s": 40.0, "drain_s": 30.0,
         "session_rate_per_s": 0.1}
FULL = {"instances_per_model": 4, "duration_s": 600.0, "warmup_s": 120.0, "drain_s": 120.0,
        "session_rate_per_s": 0.05}


STUDIES = ("main", "load", "switch", "nmodels")
MAIN_PAIRS = {True: ("Q7/L70", "L8/L70"), False: ("Q7/L70", "L8/L70", "M7/L70", "L8/Nemo12")}


def studies(quick: bool, override: Mapping[str, Any] | None = None, extra: Sequence[PluginRef] = (),
            pairs: Sequence[str] | None = None,
            ) -> list[tuple[str, str, dict[str, Any], tuple[PluginRef, ...]]]:
    """(study, label, experiment fields, policies); ``override`` replaces base fields everywhere;
    ``extra`` policies (``--policy``/``--policies``) are added to every study, after its own
    (those it has already are not added twice); ``pairs`` replaces the main study's pairs."""
    base = {**(QUICK if quick else FULL), **(override or {})}
    added = tuple(extra)
    refs = lambda names: _joined(tuple(PluginRef(n) for n in names), added)
    pairs = tuple(pairs) if pairs else MAIN_PAIRS[quick]
    out = [("main", p, {**base, "models": list(PAIRS[p])}, refs(MAIN_POLICIES)) for p in pairs]
    for rho in ((0.3, 0.9) if quick else (0.2, 0.5, 0.8, 0.9)):
        out.append(("load", f"rho={rho}", {**base, "models": list(PAIRS["Q7/L70"]),
                                           "normal": {"rho": rho}}, refs(SHORT)))
    for p in ((0.1, 0.5) if quick else (0.05, 0.1, 0.3, 0.5)):
        out.append(("switch", f"p={p}", {**base, "models": list(PAIRS["Q7/L70"]), "preset": "",
                                         "scenario": {"switch_probability": p, "calls_per_session": 12,
                                                      "input_tokens_median": 1000}}, refs(SHORT)))
    nm = {**base, "instances_per_model": base.get("instances_per_model", 2) // 2 or 1}
    n_policies = (PluginRef("no-shadow"), PluginRef("harvest-slo-host"), PluginRef("harvest-slo-host", {"top_k": 1}),
                  PluginRef("adaptive-host"), PluginRef("benefit-host"), PluginRef("idle-first-host"),
                  PluginRef("oracle-host"))
    for n in ((2, 5) if quick else (2, 3, 4, 5)):
        out.append(("nmodels", f"N={n}", {**nm, "models": list(N_MODELS[:n])}, _joined(n_policies, added)))
    return out


def _joined(refs: tuple[PluginRef, ...], extra: tuple[PluginRef, ...]) -> tuple[PluginRef, ...]:
    """``refs`` then the ``extra`` ones not among them (by table name)."""
    names = {policy_label(r) for r in refs}
    return refs + tuple(r for r in extra if policy_label(r) not in names)


@attrs.frozen
class Grid:
    """Which part of the grid to run (``--studies``, ``--pairs``, ``--seeds``, ``--windows``,
    ``--only-policies``); None/empty: the ``--quick`` or full grid's own. ``only`` keeps, in
    every study, just the policies of these table names (the ``--policies`` extras stay)."""

    studies: tuple[str, ...] = STUDIES
    pairs: tuple[str, ...] | None = None
    seeds: tuple[int, ...] | None = None
    windows: tuple[str, ...] | None = None
    only: tuple[str, ...] = ()

    def seeds_for(self, quick: bool) -> tuple[int, ...]:
        return self.seeds if self.seeds else ((0,) if quick else (0, 1, 2))

    def windows_for(self, quick: bool) -> tuple[str, ...]:
        return self.windows if self.windows else (("peak",) if quick else WINDOWS)

    def describe(self, quick: bool) -> str:
        n = len(self.seeds_for(quick))
        text = (f"{'quick' if quick else 'full'} settings, {n} seed{'s' if n > 1 else ''} "
                f"({', '.join(map(str, self.seeds_for(quick)))}) x {', '.join(self.windows_for(quick))} window"
                + ("s" if len(self.windows_for(quick)) > 1 else ""))
        cut = [f"studies {', '.join(self.studies)}"] if self.studies != STUDIES else []
        cut += [f"main pairs {', '.join(self.pairs)}"] if self.pairs else []
        cut += [f"policies {', '.join(self.only)}"] if self.only else []
        return text + (f"; REDUCED grid: {'; '.join(cut)}" if cut else "")


def selected(quick: bool, override: Mapping[str, Any] | None, extra: Sequence[PluginRef], grid: Grid,
             ) -> list[tuple[str, str, dict[str, Any], tuple[PluginRef, ...]]]:
    """:func:`studies` cut to ``grid``; an ``only`` name no chosen study runs, or one without
    ``no-shadow`` (every reduction is against it), is a ConfigError naming ``--only-policies``."""
    chosen = [s for s in studies(quick, override, extra, grid.pairs) if s[0] in grid.studies]
    if not grid.only:
        return chosen
    known = {policy_label(r) for _s, _l, _f, refs in chosen for r in refs}
    unknown = [n for n in grid.only if n not in known]
    if unknown or "no-shadow" not in grid.only:
        raise ConfigError("--only-policies", ",".join(grid.only),
                          f"unknown here: {', '.join(unknown)} (the chosen studies run {', '.join(sorted(known))})"
                          if unknown else "must include no-shadow (every reduction is against it)")
    keep = set(grid.only) | {policy_label(r) for r in extra}
    return [(s, label, fields, tuple(r for r in refs if policy_label(r) in keep))
            for s, label, fields, refs in chosen]


def run_all(quick: bool, jobs: int, progress: bool = True, override: Mapping[str, Any] | None = None, *,
            store: ResultStore | None = None, ray_address: str | None = None, extra: Sequence[PluginRef] = (),
            grid: Grid = Grid()) -> dict[str, tuple[str, Comparison]]:
    tasks: list[Task] = []
    study_of: dict[str, str] = {}
    setup: dict[str, tuple[Experiment, dict[str, float]]] = {}
    for study, label, fields, policies in selected(quick, override, extra, grid):
        ex = Experiment.from_dict(fields)
        caps = {m: c.capacity_per_s for m, c in capacities(ex, progress=progress).items()}
        key = f"{study}:{label}"
        study_of[key], setup[key] = study, (ex, caps)
        tasks += tasks_for(ex, policies, grid.seeds_for(quick), grid.windows_for(quick), caps, key)
    records = execute_grid(tasks, jobs=jobs, progress=progress, store=store, ray_address=ray_address)
    return {k: (study_of[k], with_promise(c, *setup[k], grid.windows_for(quick)))
            for k, c in compare(records, tasks).items()}


# -- figures ------------------------------------------------------------------------------


def _get(c: Comparison, policy: str, metric: str) -> tuple[float, float]:
    m = c.summary.get(policy, {}).get(metric, (math.nan, math.nan))
    return m[0], (0.0 if math.isnan(m[1]) else m[1])


def _bars(ax: Any, comps: Sequence[tuple[str, Comparison]], policies: Sequence[str], metric: str, title: str,
          scale: float = 100.0) -> None:
    width = 0.8 / max(1, len(policies))
    for j, p in enumerate(policies):
        xs = [i + j * width for i in range(len(comps))]
        ys = [_get(c, p, metric)[0] * scale for _, c in comps]
        es = [_get(c, p, metric)[1] * scale for _, c in comps]
        ax.bar(xs, ys, width, yerr=es, label=p, capsize=2)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(comps))])
    ax.set_xticklabels([label.split(":", 1)[1] for label, _ in comps], fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.axhline(0, color="black", linewidth=0.5)


def _lines(ax: Any, comps: Sequence[tuple[float, Comparison]], policies: Sequence[str], metric: str,
           title: str, xlabel: str) -> None:
    for p in policies:
        pts = [(x, *_get(c, p, metric)) for x, c in comps if p in c.summary]
        if pts:
            ax.errorbar([a for a, _, _ in pts], [100 * b for _, b, _ in pts], yerr=[100 * e for _, _, e in pts],
                        marker="o", label=p, capsize=2)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.axhline(0, color="black", linewidth=0.5)


def _legend(ax: Any, **kw: Any) -> None:
    if ax.get_legend_handles_labels()[0]:  # a panel of a study that did not run has nothing to name
        ax.legend(**kw)


def figures(results: Mapping[str, tuple[str, Comparison]], out: Path, extra: Sequence[str] = ()) -> list[Path]:
    """The figures of the studies that ran; ``extra`` (the table names of the user's
    ``--policies``) joins every panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    extra = [p for p in extra if p not in MAIN_POLICIES]
    main = [(k, c) for k, (s, c) in results.items() if s == "main"]
    main_policies = [*MAIN_POLICIES, *extra]
    shown = [p for p in main_policies if p != "no-shadow"]
    short = [p for p in (*SHORT, *extra) if p != "no-shadow"]
    paths = []

    def save(fig: Any, name: str, points: Sequence[Any]) -> None:
        if not points:  # its study was cut from the grid (--studies, --pairs): no empty figure
            plt.close(fig)
            return
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    for name, panels in (
        ("fig4_latency.png", (("call_latency_red", "LLM-call latency reduction (%)"),
                              ("switch_latency_red", "Switch-call latency reduction (%)"))),
        ("fig5_ttft_hit.png", (("switch_ttft_red", "Switch-call TTFT reduction (%)"),
                               ("hit_rate", "Token-weighted prefix hit rate, all calls (%)"))),
        ("fig6_task_cost.png", (("task_time_red", "LLM time per task reduction (%)"),
                                ("token_cost_red", "Routed token cost reduction (%)"))),
    ):
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
        for ax, (metric, title) in zip(axes, panels):
            _bars(ax, main, main_policies if metric == "hit_rate" else shown, metric, title)
        _legend(axes[1], fontsize=6, ncol=2)
        save(fig, name, main)

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    over = ["harvest", "harvest-slo", "harvest-slo-host", "adaptive-host", "benefit-host", "idle-first-host",
            "imminent-host", "oracle-host", *extra]
    for ax, (metric, title, scale) in zip(axes, (
            ("prefill_tput_inc", "(a) Prefill tok/s change incl. shadow (%)", 100.0),
            ("energy_inc", "(b) Energy per good request change (%)", 100.0),
            ("normal_slo_pp", "(c) Normal-traffic SLO attainment (pp)", 100.0))):
        _bars(ax, main, over, metric, title, scale)
    _legend(axes[0], fontsize=6)
    save(fig, "fig8_overheads.png", main)

    load = sorted(((float(k.split("=")[1]), c) for k, (s, c) in results.items() if s == "load"),
                  key=lambda x: x[0])
    q7 = results.get("main:Q7/L70")
    if q7 is not None:
        load = sorted(load + [(0.7, q7[1])], key=lambda x: x[0])
    fig, ax = plt.subplots(1, 1, figsize=(5, 3.4))
    _lines(ax, load, short, "call_latency_red",
           "(e) LLM-call latency reduction (%) vs load", "normal-traffic load rho")
    _legend(ax, fontsize=7)
    save(fig, "fig9e_load.png", load)

    sw = sorted(((c.summary["no-shadow"]["switch_calls"][0] / max(1.0, _sessions(c)), c)
                 for k, (s, c) in results.items() if s == "switch"), key=lambda x: x[0])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for ax, (metric, title) in zip(axes, (("call_latency_red", "(a) LLM-call latency reduction (%)"),
                                          ("switch_latency_red", "(b) Switch-call latency reduction (%)"))):
        _lines(ax, sw, short, metric, title, "switches per session (Markov router)")
    _legend(axes[0], fontsize=7)
    save(fig, "fig15_switch_rate.png", sw)

    nm = sorted(((int(k.split("=")[1]), c) for k, (s, c) in results.items() if s == "nmodels"), key=lambda x: x[0])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    names = ["harvest-slo-host", "harvest-slo-host(top_k=1)", "adaptive-host", "benefit-host", "idle-first-host",
             *extra, "oracle-host"]
    _lines(axes[0], nm, names, "call_latency_red", "(d) LLM-call latency reduction (%)", "models per router")
    _lines(axes[1], nm, names[:-1], "shadow_unused_share", "(e) Unused shadow tokens (%)", "models per router")
    _legend(axes[0], fontsize=7)
    save(fig, "fig16_models_per_router.png", nm)
    return paths


def _sessions(c: Comparison) -> float:
    """Measured sessions per run, estimated from matched calls (12 calls per Markov session)."""
    return c.summary["no-shadow"]["calls"][0] / 12.0


# -- table --------------------------------------------------------------------------------


def _avg(comps: Sequence[Comparison], policy: str, metric: str) -> float:
    return _avg_se(comps, policy, metric)[0]


def _avg_se(comps: Sequence[Comparison], policy: str, metric: str) -> tuple[float, float]:
    """The mean over ``comps`` (pairs) of each one's mean, and its standard error from theirs
    (pairs independent: sqrt(sum SE^2) / n); NaN SE when a pair has a single run."""
    pts = [c.summary[policy][metric] for c in comps if metric in c.summary.get(policy, {})]
    pts = [(m, e) for m, e in pts if not math.isnan(m)]
    if not pts:
        return math.nan, math.nan
    return sum(m for m, _e in pts) / len(pts), math.sqrt(sum(e * e for _m, e in pts)) / len(pts)


def _oracle(comps: Sequence[Comparison]) -> str:
    """The oracle the bounds are read from: the one the share of its gain is measured against
    (:func:`~shadow_sim.experiments.runner.baseline_and_oracle`, oracle-host when it ran), since
    the paper's 54% is its 10.4% over its 19.3% bound."""
    return next((c.oracle for c in comps if c.oracle), "oracle-host")


#: Rows of :data:`PAPER` read from the main study: key -> (policy, metric); "ORACLE" is :func:`_oracle`.
MAIN_ROWS: dict[str, tuple[str, str]] = {
    "switch_latency_red": ("harvest-slo-host", "switch_latency_red"),
    "switch_latency_red_oracle": ("ORACLE", "switch_latency_red"),
    "oracle_gain_switch": ("harvest-slo-host", "oracle_gain_switch"),
    "switch_ttft_red": ("harvest-slo-host", "switch_ttft_red"),
    "call_latency_red": ("harvest-slo-host", "call_latency_red"),
    "call_latency_red_oracle": ("ORACLE", "call_latency_red"),
    "hit_rate_base": ("no-shadow", "hit_rate"),
    "hit_rate": ("harvest-slo-host", "hit_rate"),
    "hit_rate_oracle": ("oracle-host", "hit_rate"),
    "task_time_red": ("harvest-slo-host", "task_time_red"),
    "token_cost_red": ("harvest-slo-host", "token_cost_red"),
    "harvest_switch_latency_red": ("harvest", "switch_latency_red"),
    "harvest_slo_switch_latency_red": ("harvest-slo", "switch_latency_red"),
    "prefill_tput_inc": ("harvest-slo-host", "prefill_tput_inc"),
    "energy_inc": ("harvest-slo-host", "energy_inc"),
    "unused_shadow_share": ("harvest-slo-host", "shadow_unused_share"),
}


def ours_se(results: Mapping[str, tuple[str, Comparison]]) -> dict[str, float]:
    """+-1 SE of the main-study rows of :func:`ours` (:func:`_avg_se`); the other rows have none."""
    main = [c for s, c in results.values() if s == "main"]
    oracle = _oracle(main)
    return {k: _avg_se(main, oracle if p == "ORACLE" else p, m)[1] for k, (p, m) in MAIN_ROWS.items()}


def ours(results: Mapping[str, tuple[str, Comparison]]) -> dict[str, float]:
    main = [c for s, c in results.values() if s == "main"]
    by = {k: c for k, (s, c) in results.items()}
    h = "harvest-slo-host"
    oracle = _oracle(main)
    out = {k: _avg(main, oracle if p == "ORACLE" else p, m) for k, (p, m) in MAIN_ROWS.items()}
    out["normal_slo_pp_low"] = min((_get(c, h, "normal_slo_pp")[0] for c in main), default=math.nan)
    out["normal_slo_pp_high"] = max((_get(c, h, "normal_slo_pp")[0] for c in main), default=math.nan)
    out["plain_oracle_switch_latency_red"] = _avg(main, "oracle", "switch_latency_red")
    out["plain_oracle_call_latency_red"] = _avg(main, "oracle", "call_latency_red")
    lo = min((k for k in by if k.startswith("load:")), default=None, key=lambda k: float(k.split("=")[1]))
    hi = max((k for k in by if k.startswith("load:")), default=None, key=lambda k: float(k.split("=")[1]))
    if lo:
        out["load_harvest_slo_rho02"] = _get(by[lo], "harvest-slo", "call_latency_red")[0]
    if hi:
        out["load_harvest_slo_rho09"] = _get(by[hi], "harvest-slo", "call_latency_red")[0]
        out["load_hsh_rho09"] = _get(by[hi], h, "call_latency_red")[0]
    sw = sorted(k for k in by if k.startswith("switch:"))
    if sw:
        out["switchrate_hsh_low"] = _get(by[sw[0]], h, "call_latency_red")[0]
        out["switchrate_hsh_high"] = _get(by[sw[-1]], h, "call_latency_red")[0]
    n5, n2 = by.get("nmodels:N=5"), by.get("nmodels:N=2")
    if n5:
        out["n5_all_call_red"] = _get(n5, h, "call_latency_red")[0]
        out["n5_top1_call_red"] = _get(n5, "harvest-slo-host(top_k=1)", "call_latency_red")[0]
        out["n5_all_unused"] = _get(n5, h, "shadow_unused_share")[0]
        out["n5_top1_unused"] = _get(n5, "harvest-slo-host(top_k=1)", "shadow_unused_share")[0]
        out["n5_adaptive_call_red"] = _get(n5, "adaptive-host", "call_latency_red")[0]
        out["n5_adaptive_unused"] = _get(n5, "adaptive-host", "shadow_unused_share")[0]
        out["n5_benefit_call_red"] = _get(n5, "benefit-host", "call_latency_red")[0]
        out["n5_benefit_unused"] = _get(n5, "benefit-host", "shadow_unused_share")[0]
        out["n5_benefit_wasted_vs_all"] = _wasted_ratio(n5, "benefit-host", h)
    if n2:
        out["n2_unused"] = _get(n2, h, "shadow_unused_share")[0]
    out["adaptive_switch_latency_red"] = _avg(main, "adaptive-host", "switch_latency_red")
    out["adaptive_oracle_gain_switch"] = _avg(main, "adaptive-host", "oracle_gain_switch")
    out["benefit_switch_latency_red"] = _avg(main, "benefit-host", "switch_latency_red")
    out["benefit_call_latency_red"] = _avg(main, "benefit-host", "call_latency_red")
    i = ITEM7_POLICY  # issue 16 item 7: >= 75% of the oracle's switch-call gain, SLO not lower, energy <= +1%
    out["item7_oracle_gain_switch"] = _avg(main, i, "oracle_gain_switch")
    out["item7_switch_latency_red"] = _avg(main, i, "switch_latency_red")
    out["item7_switch_ttft_red"] = _avg(main, i, "switch_ttft_red")
    out["item7_normal_slo_pp_low"] = min((_get(c, i, "normal_slo_pp")[0] for c in main), default=math.nan)
    out["item7_energy_inc"] = _avg(main, i, "energy_inc")
    return out


def _wasted_ratio(c: Comparison, policy: str, reference: str) -> float:
    """Unused shadow tokens (shadow tokens x unused share, summed over runs) of ``policy``
    relative to ``reference``'s: below 1 means fewer tokens wasted in absolute terms."""
    def wasted(p: str) -> float:
        return sum(m[p]["shadow_tokens"] * m[p]["shadow_unused_share"] for _s, _w, m in c.per_run
                   if p in m and not math.isnan(m[p].get("shadow_unused_share", math.nan)))
    ref = wasted(reference)
    return wasted(policy) / ref if ref > 0 else math.nan


OURS_ONLY = {
    "plain_oracle_switch_latency_red": "Oracle (no host tier) switch-call latency reduction, main pairs",
    "plain_oracle_call_latency_red": "Oracle (no host tier) LLM-call latency reduction, main pairs",
    "n5_adaptive_call_red": "N=5, adaptive-host (ours): LLM-call reduction",
    "n5_adaptive_unused": "N=5, adaptive-host (ours): unused shadow tokens",
    "adaptive_switch_latency_red": "adaptive-host (ours) switch-call latency reduction, main pairs",
    "adaptive_oracle_gain_switch": "adaptive-host (ours) share of the oracle's switch-call gain, main pairs",
    "n5_benefit_call_red": "N=5, benefit-host (ours): LLM-call reduction",
    "n5_benefit_unused": "N=5, benefit-host (ours): unused shadow tokens",
    "n5_benefit_wasted_vs_all": "N=5, benefit-host (ours): unused shadow tokens, absolute, relative to all targets'",
    "benefit_switch_latency_red": "benefit-host (ours) switch-call latency reduction, main pairs",
    "benefit_call_latency_red": "benefit-host (ours) LLM-call latency reduction, main pairs",
    "item7_oracle_gain_switch": f"{ITEM7_POLICY} (ours) share of the oracle's switch-call gain, main pairs (target >= 75%)",
    "item7_switch_latency_red": f"{ITEM7_POLICY} (ours) switch-call latency reduction, main pairs",
    "item7_switch_ttft_red": f"{ITEM7_POLICY} (ours) switch-call TTFT reduction, main pairs",
    "item7_normal_slo_pp_low": f"{ITEM7_POLICY} (ours) normal SLO change, lowest pair (pp/100; target >= 0)",
    "item7_energy_inc": f"{ITEM7_POLICY} (ours) energy per good request change, main pairs (target <= +1%)",
}


def _pct(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def _se(x: float) -> str:
    return "–" if x is None or math.isnan(x) else f"±{100 * x:.1f}"


#: The policies table's columns: (metric, header, the paper's Harvest-SLO+Host value or None).
POLICY_COLUMNS: tuple[tuple[str, str, str | None], ...] = (
    ("switch_latency_red", "switch lat red", "switch_latency_red"),
    ("switch_ttft_red", "switch TTFT red", "switch_ttft_red"),
    ("call_latency_red", "LLM-call lat red", "call_latency_red"),
    ("token_cost_red", "routed cost red", "token_cost_red"),
    ("oracle_gain_switch", "oracle gain (switch)", "oracle_gain_switch"),
    ("energy_inc", "energy / good req", "energy_inc"),
)


def item7(gain: float, slo_pp: float, energy: float) -> str:
    """Issue 16 item 7's simulator bar on the main study's means: at least 75% of the oracle's
    switch-call gain, normal SLO attainment not lower, energy per good request at most +1%."""
    if any(math.isnan(x) for x in (gain, slo_pp, energy)):
        return "n/a"
    missed = [w for w, ok in (("gain", gain >= 0.75), ("SLO", slo_pp >= 0.0), ("energy", energy <= 0.01)) if not ok]
    return "met" if not missed else "not met (" + ", ".join(missed) + ")"


def policies_table(results: Mapping[str, tuple[str, Comparison]]) -> list[str]:
    """Every main-study policy's headline (means over pairs, +-1 SE where runs allow), the paper's
    Harvest-SLO+Host first; a policy added to the study (``--policies``, ours) gets its row here."""
    main = [c for s, c in results.values() if s == "main"]
    names = list(dict.fromkeys(p for c in main for p in c.policies if p != c.baseline))
    head = "| policy | " + " | ".join(h for _m, h, _p in POLICY_COLUMNS) + " | normal SLO (pp, min over pairs) | item 7 bar |"
    lines = [head, "|---|" + "---:|" * (len(POLICY_COLUMNS) + 1) + "---|",
             "| paper: Harvest-SLO+Host | " + " | ".join(_pct(PAPER[k][0]) for _m, _h, k in POLICY_COLUMNS)
             + " | +0.10 to +0.40 | – |"]
    for name in names:
        cells = []
        for metric, _h, _k in POLICY_COLUMNS:
            m, e = _avg_se(main, name, metric)
            cells.append(_pct(m) + ("" if math.isnan(e) else f" {_se(e)}"))
        slo = min((_get(c, name, "normal_slo_pp")[0] for c in main if name in c.summary), default=math.nan)
        bar = item7(_avg(main, name, "oracle_gain_switch"), slo, _avg(main, name, "energy_inc"))
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {'n/a' if math.isnan(slo) else f'{100 * slo:+.2f}'}"
                     + f" | {bar} |")
    return lines


def bounds_table(results: Mapping[str, tuple[str, Comparison]]) -> list[str]:
    """Per main pair, under the baseline (means over its runs): how much of a switch call its
    TTFT is -- what an oracle that makes the switch's prefill free can take off at most, before
    queueing effects -- and how many calls are switch calls (what all-call latency can gain).
    Per model switch/same-model ratios (Figure 2d) need the calls: ``benchmarks/switch_cost.py``."""
    lines = [("| pair | switch TTFT / switch-call latency | switch calls / calls | oracle's switch-lat red "
              "| oracle's LLM-call lat red | runs |"), "|---|---:|---:|---:|---:|---:|"]
    for key, (study, c) in results.items():
        if study != "main":
            continue
        per = [m[c.baseline] for _s, _w, m in c.per_run if c.baseline in m and m[c.baseline].get("calls")]
        if not per:
            continue
        share = sum(m["switch_ttft_s"] / m["switch_latency_s"] for m in per) / len(per)
        frac = sum(m["switch_calls"] / m["calls"] for m in per) / len(per)
        bound = [_get(c, c.oracle, k)[0] if c.oracle else math.nan for k in ("switch_latency_red", "call_latency_red")]
        lines.append(f"| {key.split(':', 1)[1]} | {_pct(share)} | {_pct(frac)} | {_pct(bound[0])} | {_pct(bound[1])} "
                     f"| {len(per)} |")
    return lines


def markdown(results: Mapping[str, tuple[str, Comparison]], quick: bool, grid: Grid = Grid(),
             profile: str = "") -> str:
    """Each paper number next to ours (+-1 SE over pairs where more than one run each) and
    whether ours is within +-30% of it (:func:`~shadow_sim.experiments.paper_numbers.verdict`),
    our policies' rows, every main policy's headline, then each grid point's full table."""
    o, se = ours(results), ours_se(results)
    tol = f"±{100 * TOLERANCE:.0f}%"
    lines = [f"| what | where | paper | ours | ±1 SE | within {tol}? |", "|---|---|---:|---:|---:|---|"]
    for key, (value, where, what) in PAPER.items():
        v = o.get(key, math.nan)
        lines.append(f"| {what} | {where} | {_pct(value)} | {_pct(v)} | {_se(se.get(key, math.nan))} "
                     f"| {verdict(value, v)} |")
    for key, what in OURS_ONLY.items():
        lines.append(f"| {what} | ours | – | {_pct(o.get(key, math.nan))} | – | – |")
    head = [f"# Reproduction: our numbers next to the paper's ({grid.describe(quick)})", "",
            (f"Latency: {'kernel-level tables' if not profile else f'profile {profile} over the tables'}. "
             "Ours are means over the main-study pairs (simulated, synthetic Table 1 sessions); "
             "the paper's are its §5/Appendix C/E values. Percentages; 'pp' rows are percentage points / 100. "
             f"'within {tol}' is relative to the paper's number; the oracle bounds are read from the oracle "
             "the share of its gain is measured against (oracle-host when it ran)."), ""]
    policies = ["", "## Every main-study policy (means over the main pairs)", "", *policies_table(results),
                "", "## What bounds the latency cuts (baseline runs, per main pair)", "", *bounds_table(results)]
    tables = []
    for k, (_s, c) in results.items():
        tables += ["", f"## {k}", "", "```", format_table(c), "```"]
    return "\n".join(head + lines + policies + tables) + "\n"


def _list(flag: str, text: str | None, conv: Any = str, valid: Sequence[Any] | None = None) -> tuple[Any, ...] | None:
    """A comma list flag: None when not given; empty, unparsable or unknown entries are one
    ConfigError naming the flag (and the valid choices, when there is a fixed set)."""
    if text is None:
        return None
    try:
        items = tuple(conv(x.strip()) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(flag, text, "must be a comma-separated list of integers") from None
    if not items:
        raise ConfigError(flag, text, "is empty")
    bad = [x for x in items if valid is not None and x not in valid]
    if bad:
        raise ConfigError(flag, text, f"unknown: {', '.join(map(str, bad))} (valid: {', '.join(map(str, valid))})")
    return items


def grid_from(args: argparse.Namespace) -> Grid:
    """The simulator grid's ``--studies``/``--pairs``/``--seeds``/``--windows``/``--only-policies``."""
    return Grid(studies=_list("--studies", args.studies, valid=STUDIES) or STUDIES,
                pairs=_list("--pairs", args.pairs, valid=tuple(PAIRS)),
                seeds=_list("--seeds", args.seeds, int),
                windows=_list("--windows", args.windows, valid=WINDOWS),
                only=_list("--only-policies", args.only_policies) or ())


def main(argv: Sequence[str] | None = None) -> int:
    """Reproduce the paper's figure types on the simulator: PNG figures and a Markdown table next to the paper's numbers."""
    p = argparse.ArgumentParser(prog="shadowprefill reproduce", description=describe(__doc__),
                                epilog=describe(__doc__.split("\n\n", 1)[1]), formatter_class=HelpFormatter)
    p.add_argument("--quick", action="store_true", help="reduced grid (< 30 minutes on 2 cores); with --testbed: "
                   "one pair, rho 0.3, 5%% of the run length (under a minute)")
    p.add_argument("--latency-profile", metavar="NAME|FILE",
                   help="a latency profile over the kernel-level tables (shadowprefill latency show), e.g. "
                        "paper-testbed-h100; 'none' for the tables alone (default: none; with --testbed: "
                        "paper-testbed-h100)")
    g = p.add_argument_group("part of the grid (a reduced run; every table says what was cut)")
    g.add_argument("--pairs", help="the main study's pairs, comma-separated (default Q7/L70,L8/L70,M7/L70,L8/Nemo12; "
                   "--quick: Q7/L70,L8/L70); with --testbed the testbed pairs (default Q7/L70,L8/L70,S7/S32,S7/Q72)")
    g.add_argument("--seeds", help="seeds, comma-separated (default 0,1,2; --quick and --testbed: 0)")
    g.add_argument("--studies", help=f"studies to run, comma-separated ({','.join(STUDIES)}; default all)")
    g.add_argument("--windows", help=f"normal-traffic windows ({','.join(WINDOWS)}; default all; --quick: peak)")
    g.add_argument("--only-policies", metavar="A,B,...",
                   help="run only these of each study's policies (table names, e.g. no-shadow,harvest-slo-host,"
                        "oracle-host; no-shadow required); --policies extras still join")
    t = p.add_argument_group("the GPU testbed (Section 6, Appendix D) in vLLM virtual time: --testbed")
    t.add_argument("--testbed", action="store_true",
                   help="run the paper's testbed settings on vLLM's scheduler in virtual time (needs vLLM) with "
                        "the request-level baseline and engine-level --policy (default harvest-slo and "
                        "imminent-host; host tiers off) and print the side-by-side table and item 7's bar")
    t.add_argument("--rhos", help="normal-traffic loads (default 0.3,0.5)")
    t.add_argument("--length-scale", type=float, help="scale every run's length (1 = the paper's)")
    t.add_argument("--session-rate-scale", type=float, help="scale the session rate (1 = the paper's)")
    t.add_argument("--no-engine-level", action="store_true",
                   help="only no-shadow and the request-level baseline (the arms the paper's testbed ran)")
    p.add_argument("--out", default="reproduce-out", help="output folder")
    p.add_argument("--jobs", type=int, default=2, help="local worker processes")
    p.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
                   help="run on a Ray cluster (auto, local, HOST:PORT); finished runs are kept in OUT/parts")
    p.add_argument("--set", dest="override", default="{}",
                   help='JSON object of Experiment fields for every study, e.g. \'{"latency": "roofline"}\'')
    add_policy_options(p, note="added to every study, table and figure, after its own policies")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.testbed:
        simulator_only = [f for f in ("studies", "windows", "only_policies") if getattr(args, f) is not None]
        if simulator_only:
            return _usage(f"--{simulator_only[0].replace('_', '-')} is for the simulator grid, not --testbed")
        return _testbed(args, out)
    testbed_only = [f for f in ("rhos", "length_scale", "session_rate_scale")
                    if getattr(args, f) is not None] + (["no_engine_level"] if args.no_engine_level else [])
    if testbed_only:
        return _usage(f"--{testbed_only[0].replace('_', '-')} needs --testbed")
    start = time.time()
    try:
        try:
            override = json.loads(args.override)
        except json.JSONDecodeError as e:
            raise ConfigError("--set", args.override, f"not JSON: {e.msg} at column {e.colno}") from None
        if not isinstance(override, dict):
            raise ConfigError("--set", args.override, "must be a JSON object")
        if args.latency_profile is not None:
            if "latency_profile" in override:
                raise ConfigError("--latency-profile", args.latency_profile, "and --set latency_profile: give one")
            override["latency_profile"] = "" if args.latency_profile == "none" else args.latency_profile
            resolve_profile(override["latency_profile"], "--latency-profile")
        grid = grid_from(args)
        extra = policies_from_args(args)
        selected(args.quick, override, extra, grid)  # a bad --only-policies fails before anything runs
        out.mkdir(parents=True, exist_ok=True)
        results = run_all(args.quick, args.jobs, override=override, store=ResultStore(out / "parts"),
                          ray_address=args.ray, extra=extra, grid=grid)
    except (ConfigError, PluginError) as e:
        print(f"shadowprefill reproduce: error: {e}", file=sys.stderr)
        return 2
    figs = figures(results, out, [policy_label(r) for r in extra])
    (out / "reproduction.md").write_text(markdown(results, args.quick, grid, str(override.get("latency_profile", ""))))
    write_rows(rows({k: c for k, (_s, c) in results.items()}), out, "csv")
    (out / "summary.json").write_text(json.dumps(no_nan({k: summary_json(c) for k, (_s, c) in results.items()}),
                                                 indent=1))
    print(f"wrote {len(figs)} figures, reproduction.md, runs.csv and summary.json to {out} "
          f"in {time.time() - start:.0f} s")
    return 0


def _usage(message: str) -> int:
    print(f"shadowprefill reproduce: error: {message}", file=sys.stderr)
    return 2


def _testbed(args: argparse.Namespace, out: Path) -> int:
    """``reproduce --testbed``: :mod:`shadow_vllm.virtual.testbed`, its table printed and written."""
    start = time.time()
    try:
        from shadow_vllm.virtual import testbed

        settings = testbed.settings_from(args.quick, args.pairs, args.rhos, args.seeds, args.length_scale,
                                         args.session_rate_scale, policies_from_args(args),
                                         engine_level=not args.no_engine_level)
        if args.latency_profile is not None:
            profile = "" if args.latency_profile == "none" else args.latency_profile
            resolve_profile(profile, "--latency-profile")
            settings = attrs.evolve(settings, latency_profile=profile)
        print(f"testbed in vLLM virtual time: {testbed.describe(settings)}", flush=True)
        results = testbed.run_all(settings, progress=lambda m: print(f"  [{time.time() - start:.0f} s] {m}",
                                                                     flush=True), points=out / "points")
    except (ConfigError, PluginError) as e:
        print(f"shadowprefill reproduce: error: {e}", file=sys.stderr)
        return 2
    print(testbed.write_report(results, settings, out, time.time() - start))
    print(f"wrote testbed.md and testbed.json to {out} in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
