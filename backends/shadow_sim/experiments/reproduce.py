"""``shadowprefill reproduce [--quick]``: analogues of the paper's Figures 4, 5,
6, 8, 9 (load panel), 15 (switch rate) and 16 (models per router) as PNG, and a
Markdown table of our numbers next to the paper's (:mod:`paper_numbers`).

The grid: a main study (pairs x policies), a load study (rho), a switch-rate
study (Markov router) and a models-per-router study (N = 2, 3, 5 small models,
all targets vs top-1 vs our ``adaptive-host``, ``benefit-host`` and
``idle-first-host``). ``--quick`` shrinks the grid and the measurement (2 instances per model, 180 s measured, one seed, peak window)
to finish in under 30 minutes on 2 cores; the full grid uses the paper's
settings (4 instances, 600 s after 120 s warm-up, 3 seeds x 3 windows).

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

from shadow_sim.experiments.calibrate import capacities
from shadow_sim.experiments.distributed import ResultStore, execute_grid
from shadow_sim.experiments.paper_numbers import PAPER
from shadow_sim.experiments.runner import Comparison, Task, compare, format_table, summary_json, tasks_for
from shadow_sim.experiments.spec import PAIRS, Experiment
from shadow_sim.experiments.output import no_nan
from shadow_sim.experiments.sweep import rows, write_rows
from shadowcore.cli import HelpFormatter, add_policy_options, describe, policies_from_args
from shadowcore.config import PluginRef, policy_label
from shadowcore.errors import ConfigError, PluginError

MAIN_POLICIES = ("no-shadow", "host-tier", "harvest", "harvest-slo", "harvest-slo-host", "adaptive-host",
                 "benefit-host", "idle-first-host", "oracle", "oracle-host")
SHORT = ("no-shadow", "harvest-slo", "harvest-slo-host", "oracle-host")
N_MODELS = ("Qwen2.5-7B", "Mistral-7B", "Llama-3.1-8B", "Mistral-Nemo-12B", "gpt-oss-20b")

QUICK = {"instances_per_model": 2, "duration_s": 180.0, "warmup_s": 40.0, "drain_s": 30.0,
         "session_rate_per_s": 0.1}
FULL = {"instances_per_model": 4, "duration_s": 600.0, "warmup_s": 120.0, "drain_s": 120.0,
        "session_rate_per_s": 0.05}


def studies(quick: bool, override: Mapping[str, Any] | None = None, extra: Sequence[PluginRef] = (),
            ) -> list[tuple[str, str, dict[str, Any], tuple[PluginRef, ...]]]:
    """(study, label, experiment fields, policies); ``override`` replaces base fields everywhere;
    ``extra`` policies (``--policy``/``--policies``) are added to every study, after its own
    (those it has already are not added twice)."""
    base = {**(QUICK if quick else FULL), **(override or {})}
    added = tuple(extra)
    refs = lambda names: _joined(tuple(PluginRef(n) for n in names), added)
    pairs = ("Q7/L70", "L8/L70") if quick else ("Q7/L70", "L8/L70", "M7/L70", "L8/Nemo12")
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


def run_all(quick: bool, jobs: int, progress: bool = True, override: Mapping[str, Any] | None = None, *,
            store: ResultStore | None = None, ray_address: str | None = None, extra: Sequence[PluginRef] = (),
            ) -> dict[str, tuple[str, Comparison]]:
    tasks: list[Task] = []
    study_of: dict[str, str] = {}
    for study, label, fields, policies in studies(quick, override, extra):
        ex = Experiment.from_dict(fields)
        caps = {m: c.capacity_per_s for m, c in capacities(ex, progress=progress).items()}
        key = f"{study}:{label}"
        study_of[key] = study
        tasks += tasks_for(ex, policies, (0,) if quick else (0, 1, 2),
                           ("peak",) if quick else ("peak", "median", "trough"), caps, key)
    records = execute_grid(tasks, jobs=jobs, progress=progress, store=store, ray_address=ray_address)
    return {k: (study_of[k], c) for k, c in compare(records, tasks).items()}


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


def figures(results: Mapping[str, tuple[str, Comparison]], out: Path, extra: Sequence[str] = ()) -> list[Path]:
    """The figures; ``extra`` (the table names of the user's ``--policies``) joins every panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    extra = [p for p in extra if p not in MAIN_POLICIES]
    main = [(k, c) for k, (s, c) in results.items() if s == "main"]
    main_policies = [*MAIN_POLICIES, *extra]
    shown = [p for p in main_policies if p != "no-shadow"]
    short = [p for p in (*SHORT, *extra) if p != "no-shadow"]
    paths = []

    def save(fig: Any, name: str) -> None:
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
        axes[1].legend(fontsize=6, ncol=2)
        save(fig, name)

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    over = ["harvest", "harvest-slo", "harvest-slo-host", "adaptive-host", "benefit-host", "idle-first-host",
            "oracle-host", *extra]
    for ax, (metric, title, scale) in zip(axes, (
            ("prefill_tput_inc", "(a) Prefill tok/s change incl. shadow (%)", 100.0),
            ("energy_inc", "(b) Energy per good request change (%)", 100.0),
            ("normal_slo_pp", "(c) Normal-traffic SLO attainment (pp)", 100.0))):
        _bars(ax, main, over, metric, title, scale)
    axes[0].legend(fontsize=6)
    save(fig, "fig8_overheads.png")

    load = sorted(((float(k.split("=")[1]), c) for k, (s, c) in results.items() if s == "load"),
                  key=lambda x: x[0])
    q7 = results.get("main:Q7/L70")
    if q7 is not None:
        load = sorted(load + [(0.7, q7[1])], key=lambda x: x[0])
    fig, ax = plt.subplots(1, 1, figsize=(5, 3.4))
    _lines(ax, load, short, "call_latency_red",
           "(e) LLM-call latency reduction (%) vs load", "normal-traffic load rho")
    ax.legend(fontsize=7)
    save(fig, "fig9e_load.png")

    sw = sorted(((c.summary["no-shadow"]["switch_calls"][0] / max(1.0, _sessions(c)), c)
                 for k, (s, c) in results.items() if s == "switch"), key=lambda x: x[0])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for ax, (metric, title) in zip(axes, (("call_latency_red", "(a) LLM-call latency reduction (%)"),
                                          ("switch_latency_red", "(b) Switch-call latency reduction (%)"))):
        _lines(ax, sw, short, metric, title, "switches per session (Markov router)")
    axes[0].legend(fontsize=7)
    save(fig, "fig15_switch_rate.png")

    nm = sorted(((int(k.split("=")[1]), c) for k, (s, c) in results.items() if s == "nmodels"), key=lambda x: x[0])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    names = ["harvest-slo-host", "harvest-slo-host(top_k=1)", "adaptive-host", "benefit-host", "idle-first-host",
             *extra, "oracle-host"]
    _lines(axes[0], nm, names, "call_latency_red", "(d) LLM-call latency reduction (%)", "models per router")
    _lines(axes[1], nm, names[:-1], "shadow_unused_share", "(e) Unused shadow tokens (%)", "models per router")
    axes[0].legend(fontsize=7)
    save(fig, "fig16_models_per_router.png")
    return paths


def _sessions(c: Comparison) -> float:
    """Measured sessions per run, estimated from matched calls (12 calls per Markov session)."""
    return c.summary["no-shadow"]["calls"][0] / 12.0


# -- table --------------------------------------------------------------------------------


def _avg(comps: Sequence[Comparison], policy: str, metric: str) -> float:
    vals = [_get(c, policy, metric)[0] for c in comps]
    vals = [v for v in vals if not math.isnan(v)]
    return sum(vals) / len(vals) if vals else math.nan


def ours(results: Mapping[str, tuple[str, Comparison]]) -> dict[str, float]:
    main = [c for s, c in results.values() if s == "main"]
    by = {k: c for k, (s, c) in results.items()}
    h = "harvest-slo-host"
    out = {
        "switch_latency_red": _avg(main, h, "switch_latency_red"),
        "switch_latency_red_oracle": _avg(main, "oracle", "switch_latency_red"),
        "oracle_gain_switch": _avg(main, h, "oracle_gain_switch"),
        "switch_ttft_red": _avg(main, h, "switch_ttft_red"),
        "call_latency_red": _avg(main, h, "call_latency_red"),
        "call_latency_red_oracle": _avg(main, "oracle", "call_latency_red"),
        "hit_rate_base": _avg(main, "no-shadow", "hit_rate"),
        "hit_rate": _avg(main, h, "hit_rate"),
        "hit_rate_oracle": _avg(main, "oracle-host", "hit_rate"),
        "task_time_red": _avg(main, h, "task_time_red"),
        "token_cost_red": _avg(main, h, "token_cost_red"),
        "harvest_switch_latency_red": _avg(main, "harvest", "switch_latency_red"),
        "harvest_slo_switch_latency_red": _avg(main, "harvest-slo", "switch_latency_red"),
        "prefill_tput_inc": _avg(main, h, "prefill_tput_inc"),
        "energy_inc": _avg(main, h, "energy_inc"),
        "normal_slo_pp_low": min((_get(c, h, "normal_slo_pp")[0] for c in main), default=math.nan),
        "normal_slo_pp_high": max((_get(c, h, "normal_slo_pp")[0] for c in main), default=math.nan),
        "unused_shadow_share": _avg(main, h, "shadow_unused_share"),
    }
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
    i = "idle-first-host"  # issue 16 item 7: >= 75% of the oracle's switch-call gain, SLO not lower, energy <= +1%
    out["idle_oracle_gain_switch"] = _avg(main, i, "oracle_gain_switch")
    out["idle_switch_latency_red"] = _avg(main, i, "switch_latency_red")
    out["idle_switch_ttft_red"] = _avg(main, i, "switch_ttft_red")
    out["idle_normal_slo_pp_low"] = min((_get(c, i, "normal_slo_pp")[0] for c in main), default=math.nan)
    out["idle_energy_inc"] = _avg(main, i, "energy_inc")
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
    "n5_adaptive_call_red": "N=5, adaptive-host (ours): LLM-call reduction",
    "n5_adaptive_unused": "N=5, adaptive-host (ours): unused shadow tokens",
    "adaptive_switch_latency_red": "adaptive-host (ours) switch-call latency reduction, main pairs",
    "adaptive_oracle_gain_switch": "adaptive-host (ours) share of the oracle's switch-call gain, main pairs",
    "n5_benefit_call_red": "N=5, benefit-host (ours): LLM-call reduction",
    "n5_benefit_unused": "N=5, benefit-host (ours): unused shadow tokens",
    "n5_benefit_wasted_vs_all": "N=5, benefit-host (ours): unused shadow tokens, absolute, relative to all targets'",
    "benefit_switch_latency_red": "benefit-host (ours) switch-call latency reduction, main pairs",
    "benefit_call_latency_red": "benefit-host (ours) LLM-call latency reduction, main pairs",
    "idle_oracle_gain_switch": "idle-first-host (ours) share of the oracle's switch-call gain, main pairs (target >= 75%)",
    "idle_switch_latency_red": "idle-first-host (ours) switch-call latency reduction, main pairs",
    "idle_switch_ttft_red": "idle-first-host (ours) switch-call TTFT reduction, main pairs",
    "idle_normal_slo_pp_low": "idle-first-host (ours) normal SLO change, lowest pair (pp/100; target >= 0)",
    "idle_energy_inc": "idle-first-host (ours) energy per good request change, main pairs (target <= +1%)",
}


def _pct(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def markdown(results: Mapping[str, tuple[str, Comparison]], quick: bool) -> str:
    o = ours(results)
    lines = ["| what | paper | ours | where |", "|---|---:|---:|---|"]
    for key, (value, where, what) in PAPER.items():
        lines.append(f"| {what} | {_pct(value)} | {_pct(o.get(key, math.nan))} | {where} |")
    for key, what in OURS_ONLY.items():
        lines.append(f"| {what} | – | {_pct(o.get(key, math.nan))} | ours |")
    grid = "quick grid (1 seed, peak window)" if quick else "full grid (3 seeds x 3 windows)"
    head = [f"# Reproduction: our numbers next to the paper's ({grid})", "",
            ("Ours are means over the main-study pairs (simulated, synthetic Table 1 sessions); "
             "the paper's are its §5/Appendix C/E values. Percentages; 'pp' rows are percentage points / 100."), ""]
    tables = []
    for k, (_s, c) in results.items():
        tables += ["", f"## {k}", "", "```", format_table(c), "```"]
    return "\n".join(head + lines + tables) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Reproduce the paper's figure types on the simulator: PNG figures and a Markdown table next to the paper's numbers."""
    p = argparse.ArgumentParser(prog="shadowprefill reproduce", description=describe(__doc__),
                                epilog=describe(__doc__.split("\n\n", 1)[1]), formatter_class=HelpFormatter)
    p.add_argument("--quick", action="store_true", help="reduced grid (< 30 minutes on 2 cores); with --testbed: "
                   "one pair, rho 0.3, 5%% of the run length (under a minute)")
    t = p.add_argument_group("the GPU testbed (Section 6, Appendix D) in vLLM virtual time: --testbed")
    t.add_argument("--testbed", action="store_true",
                   help="run the paper's testbed settings on vLLM's scheduler in virtual time (needs vLLM) with "
                        "the request-level baseline and engine-level --policy (default harvest-slo; policies "
                        "without the host tier) and print the side-by-side table")
    t.add_argument("--pairs", help="testbed pairs, comma-separated (default Q7/L70,L8/L70,S7/S32,S7/Q72)")
    t.add_argument("--rhos", help="normal-traffic loads (default 0.3,0.5)")
    t.add_argument("--seeds", help="seeds (default 0)")
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
        return _testbed(args, out)
    testbed_only = [f for f in ("pairs", "rhos", "seeds", "length_scale", "session_rate_scale")
                    if getattr(args, f) is not None] + (["no_engine_level"] if args.no_engine_level else [])
    if testbed_only:
        print(f"shadowprefill reproduce: error: --{testbed_only[0].replace('_', '-')} needs --testbed",
              file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    try:
        try:
            override = json.loads(args.override)
        except json.JSONDecodeError as e:
            raise ConfigError("--set", args.override, f"not JSON: {e.msg} at column {e.colno}") from None
        if not isinstance(override, dict):
            raise ConfigError("--set", args.override, "must be a JSON object")
        extra = policies_from_args(args)
        results = run_all(args.quick, args.jobs, override=override, store=ResultStore(out / "parts"),
                          ray_address=args.ray, extra=extra)
    except (ConfigError, PluginError) as e:
        print(f"shadowprefill reproduce: error: {e}", file=sys.stderr)
        return 2
    figs = figures(results, out, [policy_label(r) for r in extra])
    (out / "reproduction.md").write_text(markdown(results, args.quick))
    write_rows(rows({k: c for k, (_s, c) in results.items()}), out, "csv")
    (out / "summary.json").write_text(json.dumps(no_nan({k: summary_json(c) for k, (_s, c) in results.items()}),
                                                 indent=1))
    print(f"wrote {len(figs)} figures, reproduction.md, runs.csv and summary.json to {out} "
          f"in {time.time() - start:.0f} s")
    return 0


def _testbed(args: argparse.Namespace, out: Path) -> int:
    """``reproduce --testbed``: :mod:`shadow_vllm.virtual.testbed`, its table printed and written."""
    start = time.time()
    try:
        from shadow_vllm.virtual import testbed

        settings = testbed.settings_from(args.quick, args.pairs, args.rhos, args.seeds, args.length_scale,
                                         args.session_rate_scale, policies_from_args(args),
                                         engine_level=not args.no_engine_level)
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
