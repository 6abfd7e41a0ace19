"""The ``shadowprefill`` command.

``shadowprefill simulate`` runs one scenario under several policies (same
workload seed for all) and prints a comparison table; with no arguments it
runs the embedded default on the default backend (``--policy
'NAME:{json}'``, repeated, gives policies with arguments). ``shadowprefill plugins``
lists registered policies and backends and whether each loads.

Other subcommands (``sweep``, ``reproduce``, ``serve``, ``vllm-serve``...) are
plugins of the entry-point group ``shadowprefill.commands``: each is a
``main(argv) -> int`` callable, imported only when its subcommand runs (so
this module imports nothing beyond the core), and a broken one is named in
the error.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from shadowcore.config import PluginRef, ShadowConfig, policy_label
from shadowcore.errors import ConfigError, PluginError
from shadowcore.policy import load_policy
from shadowcore.registry import Registry, backends, commands, load_reference, policies

DEFAULT_POLICIES = ("no-shadow", "harvest-slo-host", "oracle-host")
DEFAULT_BACKEND = "sim"
BASELINE = "no-shadow"
#: The result-folder writer and plotter (in the simulator package: pyarrow and matplotlib, the ``sim`` extra).
OUTPUT = "shadow_sim.experiments.output"
#: The plain path's columns: (metric, title, format, legend); "{base}" is the baseline's name.
COLUMNS: tuple[tuple[str, str, str, str], ...] = (
    ("call_latency_s", "call lat (s)", "{:.3f}", "mean latency (to last token) of the measured calls"),
    ("switch_latency_s", "sw lat (s)", "{:.3f}", "mean latency of the measured switch calls"),
    ("switch_ttft_s", "sw TTFT (s)", "{:.3f}", "mean time to first token of the measured switch calls"),
    ("call_latency_red", "lat red", "{:+.1%}", "reduction of the mean call latency against {base} (positive: better)"),
    ("switch_latency_red", "sw lat red", "{:+.1%}", "reduction of the mean switch-call latency against {base}"),
    ("switch_ttft_red", "sw TTFT red", "{:+.1%}", "reduction of the mean switch-call TTFT against {base}"),
    ("hit_rate", "hit rate", "{:.1%}", "cached prompt tokens / prompt tokens, measured calls"),
    ("switch_hit_rate", "sw hit", "{:.1%}", "cached prompt tokens / prompt tokens, measured switch calls"),
    ("normal_slo_attainment", "normal SLO", "{:.1%}", "share of normal requests that met both SLOs"),
    ("shadow_tokens", "shadow tok", "{:.0f}", "shadow tokens computed"),
    ("steps_granted", "granted", "{:.0f}", "planned steps with shadow chunks"),
    ("steps_below_n_min", "< n_min", "{:.0f}",
     "planned steps with a budget, jobs and room, but nothing from n_min up fit the budget"),
)
#: The default columns (``--wide``: all of :data:`COLUMNS`).
KEY_COLUMNS = ("switch_ttft_s", "call_latency_red", "switch_latency_red", "switch_ttft_red", "switch_hit_rate",
               "normal_slo_attainment", "shadow_tokens")
REDUCED = {"call_latency_red": "call_latency_s", "switch_latency_red": "switch_latency_s",
           "switch_ttft_red": "switch_ttft_s"}
SILENT_MARK = "!"


def _plugins(_args: argparse.Namespace) -> int:
    for title, registry in (("policies", policies), ("backends", backends), ("commands", commands)):
        print(f"{title} ({registry.group}):")
        for name, entries in registry.entries().items():
            print(f"  {name:<20} {_status(registry, name)}  {', '.join(e.target for e in entries)}")
    return 0


def _status(registry: Registry, name: str) -> str:
    try:
        registry.load(name)
    except PluginError as exc:
        return f"BROKEN ({exc})"
    return "ok"


def load_scenario(path: str | None) -> dict[str, Any]:
    """The JSON object in ``path`` ({} for None); a bad file is one ConfigError naming file:line:column."""
    if path is None:
        return {}
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        lines = e.doc.splitlines()
        line = lines[e.lineno - 1] if 0 < e.lineno <= len(lines) else ""
        raise ConfigError(f"{path}:{e.lineno}:{e.colno}", line, e.msg) from None
    except OSError as e:
        raise ConfigError("--scenario", path, str(e)) from None
    if not isinstance(data, dict):
        raise ConfigError("--scenario", path, "must hold a JSON object")
    return data


def policy_ref(text: str) -> PluginRef:
    """``--policy``'s value: ``NAME`` or ``NAME:{JSON object of arguments}``,
    e.g. ``harvest-slo:{"eviction_order": "lru"}``."""
    name, sep, rest = text.partition(":{")
    name = name.strip()
    if not sep:
        return PluginRef(name)
    try:
        args = json.loads("{" + rest)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--policy {name}", "{" + rest, f"arguments are not JSON: {e.msg} (column {e.colno})") \
            from None
    return PluginRef.parse(f"--policy {name}", {"name": name, "args": args})


def with_baseline(refs: list[PluginRef]) -> list[PluginRef]:
    """``refs`` with ``no-shadow`` first when it is missing (reductions are always against it)."""
    if any(r.name == BASELINE and not r.args for r in refs):
        return refs
    print(f"adding {BASELINE} to the policies: reductions are against it", file=sys.stderr)
    return [PluginRef(BASELINE), *refs]


def _simulate(args: argparse.Namespace) -> int:
    scenario = load_scenario(args.scenario)
    if args.duration is not None:
        scenario["duration_s"] = args.duration
    if args.policy and args.policies is not None:
        raise ConfigError("--policy", args.policy, "give --policies or --policy, not both")
    if args.policy:
        refs = [policy_ref(p) for p in args.policy]
    else:
        names = args.policies if args.policies is not None else ",".join(DEFAULT_POLICIES)
        refs = [PluginRef(n.strip()) for n in names.split(",") if n.strip()]
    specs = []
    for i, ref in enumerate(refs):  # every policy loads before anything runs (a bad argument costs no run)
        specs.append(load_policy(ref, field=f"--policy {ref.name}" if args.policy else f"--policies[{i}]"))
    labels = [policy_label(r) for r in refs]
    if len(set(labels)) != len(labels):
        raise ConfigError("--policy" if args.policy else "--policies", labels, "each policy may appear once")
    refs = with_baseline(refs)
    configs = [ShadowConfig(ref, seed=args.seed) for ref in refs]
    out = Path(args.out) if args.out else None
    write_folder = _output("write_folder", "--out") if out is not None else None  # fails before any run
    backend = backends.load(args.backend)()
    compare = getattr(backend, "compare", None)  # a backend's own runner (sim: matched calls, reductions, +-SE)
    if compare is not None:
        table = compare(scenario, configs, out=out, wide=args.wide)
        if table is not None:
            print(table)
            return 0
    results = []
    for i, cfg in enumerate(configs, 1):
        print(f"[{i}/{len(configs)}] {policy_label(cfg.policy)} ...", file=sys.stderr, flush=True)
        results.append(backend.run(scenario, cfg))
    rows = plain_comparison(results, refs)
    for notice in rows["notices"]:
        print(f"warning: {notice}")
    print(format_table(rows, wide=args.wide))
    if write_folder is not None:
        paths = write_folder(out, plain_call_rows(results, refs, args.seed), {"": rows},
                                    format_table(rows, wide=True), args.backend, rows["notices"])
        print(f"wrote {', '.join(p.name for p in paths)} to {out}")
    return 0


def _output(name: str, field: str) -> Any:
    """A function of the result-folder module (:data:`OUTPUT`); one error line when it cannot load."""
    try:
        return load_reference(f"{OUTPUT}:{name}")
    except PluginError as e:
        raise ConfigError(field, OUTPUT, "result folders need the simulator package and its extra "
                                         f"(pip install 'shadowprefill[sim]'): {e}") from None


def _reduction(x: float, base: float) -> float:
    return 1.0 - x / base if base and not (math.isnan(x) or math.isnan(base)) else math.nan


def plain_comparison(results: Sequence[Any], refs: Sequence[PluginRef]) -> dict[str, Any]:
    """A plain (one run per policy) comparison, shaped as a result folder's
    ``summary.json`` comparison: per policy label its metrics and the
    reductions against ``no-shadow`` (no standard error: one run)."""
    labels = [policy_label(r) for r in refs]
    base = next(r.metrics for r, ref in zip(results, refs) if ref.name == BASELINE and not ref.args)
    policies, silent, notices = {}, [], {}
    for label, ref, r in zip(labels, refs, results):
        m = dict(r.metrics)
        m.update({red: _reduction(m[key], base[key]) for red, key in REDUCED.items()})
        policies[label] = {k: {"mean": v, "se": None} for k, v in m.items()}
        if m.get("shadow_tokens", 0.0) == 0 and not load_policy(ref).slack.cls.never_grants:
            silent.append(label)
        notices.update(dict.fromkeys(getattr(r, "notices", ())))
    oracle = next((lab for lab, ref in zip(labels, refs) if ref.name in ("oracle-host", "oracle")), None)
    steps = {lab: {k[6:]: v["mean"] for k, v in m.items() if k.startswith("steps_")} for lab, m in policies.items()}
    return {"label": "", "baseline": BASELINE, "oracle": oracle, "runs": 1, "policies": policies, "steps": steps,
            "silent": silent, "notices": list(notices)}


def plain_call_rows(results: Sequence[Any], refs: Sequence[PluginRef], seed: int) -> list[dict[str, Any]]:
    """The ``calls.parquet`` rows of a plain comparison."""
    out = []
    for ref, r in zip(refs, results):
        warmup = getattr(r, "warmup_s", 0.0)
        for c in r.calls:
            out.append({"label": "", "policy": policy_label(ref), "seed": seed, "window": "",
                        "session_id": c.session_id, "call_index": c.call_index, "model": c.model,
                        "is_switch": c.is_switch, "measured": c.arrival_s >= warmup, "ttft_s": c.ttft_s,
                        "latency_s": c.latency_s, "num_prompt_tokens": c.num_prompt_tokens,
                        "num_cached_tokens": c.num_cached_tokens, "num_output_tokens": None})
    return out


def format_table(comparison: Mapping[str, Any], wide: bool = False) -> str:
    """A plain comparison's table (:func:`plain_comparison`): the key columns
    (every one with ``wide``), a note on the baseline, and a legend line per
    column. A policy that can shadow but planned no shadow token is marked."""
    columns = COLUMNS if wide else tuple(c for c in COLUMNS if c[0] in KEY_COLUMNS)
    header = ["policy"] + [title for _, title, _, _ in columns]
    rows = []
    for label, m in comparison["policies"].items():
        cells = [label + (SILENT_MARK if label in comparison["silent"] else "")]
        for key, _, fmt, _ in columns:
            v = m.get(key, {}).get("mean")
            cells.append("-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v))
        rows.append(cells)
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    base = comparison["baseline"]
    note = f"one run per policy; reductions against {base}; no standard error (sim experiments: over seeds x windows)"
    notes = [note]
    if comparison["silent"]:
        notes.append(f"{SILENT_MARK} planned no shadow token although it can shadow "
                     f"({', '.join(comparison['silent'])}): see the warnings above")
    width = max(len(title) for _, title, _, _ in columns)
    notes += [f"  {title.ljust(width)}  {text.format(base=base)}" for _, title, _, text in columns]
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows] + notes)


def _plot(args: argparse.Namespace) -> int:
    plot_main = _output("plot_main", "plot")
    return int(plot_main([*args.folders, *(["--out", args.out] if args.out else [])]))


def _run_plugin_command(name: str, argv: list[str]) -> int:
    try:
        return int(commands.load(name)(argv) or 0)
    except (ConfigError, PluginError) as e:
        print(f"shadowprefill {name}: error: {e}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    builtin = {"simulate", "plugins", "plot"}
    plugin_commands = {n: e for n, e in commands.entries().items() if n not in builtin}
    if argv and argv[0] in plugin_commands:  # its own parser handles its arguments and --help
        return _run_plugin_command(argv[0], argv[1:])
    parser = argparse.ArgumentParser(prog="shadowprefill", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    sim = sub.add_parser("simulate", help="run one scenario under several policies")
    sim.add_argument("--backend", default=DEFAULT_BACKEND, help="registered backend name")
    sim.add_argument("--policies", default=None,
                     help=f"comma-separated policy names (default: {','.join(DEFAULT_POLICIES)})")
    sim.add_argument("--policy", action="append", metavar="NAME[:JSON]",
                     help='one policy, with arguments if any, e.g. \'harvest-slo:{"eviction_order": "lru"}\' '
                          "(repeat it; instead of --policies)")
    sim.add_argument("--scenario", help="JSON file with scenario fields (default: the embedded scenario)")
    sim.add_argument("--duration", type=float, help="simulated seconds of arrivals")
    sim.add_argument("--seed", type=int, default=0, help="policy seed")
    sim.add_argument("--out", metavar="DIR", help="write a result folder: per-call calls.parquet, summary.json, "
                                                 "table.txt and PNG plots (see shadowprefill plot)")
    sim.add_argument("--wide", action="store_true", help="print every column (default: the key ones, < 120 chars)")
    sim.set_defaults(func=_simulate)
    plot = sub.add_parser("plot", help="redraw a result folder's plots, or compare two folders")
    plot.add_argument("folders", nargs="+", metavar="DIR", help="one result folder, or two to compare")
    plot.add_argument("--out", help="where to write the PNGs (default: DIR, or DIR/compare for two)")
    plot.set_defaults(func=_plot)
    plug = sub.add_parser("plugins", help="list registered policies, backends and commands")
    plug.set_defaults(func=_plugins)
    for name, entries in plugin_commands.items():  # listed in --help; run above
        sub.add_parser(name, help=f"(plugin {entries[0].target}; see shadowprefill {name} --help)")
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["simulate", *argv])
    try:
        return args.func(args)
    except (ConfigError, PluginError) as e:
        print(f"shadowprefill: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
