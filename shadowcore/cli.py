"""The ``shadowprefill`` command.

``shadowprefill simulate`` runs one scenario under several policies (same
workload seed for all) and prints a comparison table; with no arguments it
runs the embedded default on the default backend (``--policy
'NAME:{json}'``, repeated, or ``--policies a,b:{json}`` give the policies; see
:func:`add_policy_options`, shared by every command). ``shadowprefill plugins``
lists registered policies and backends and whether each loads.

Other subcommands (``sweep``, ``reproduce``, ``serve``, ``vllm-serve``...) are
plugins of the entry-point group ``shadowprefill.commands``: each is a
``main(argv) -> int`` callable, imported only when its subcommand runs (so
this module imports nothing beyond the core), and a broken one is named in
the error.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import re
import signal
import sys
import textwrap
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from shadowcore.config import PluginRef, ShadowConfig, parse_ref, parse_refs, policy_label
from shadowcore.errors import ConfigError, PluginError
from shadowcore.policy import load_policy
from shadowcore.registry import Registry, backends, commands, load_reference, policies, routers

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
    ("steps_granted", "granted", "{:.0f}", "steps with shadow chunks"),
    ("steps_below_n_min", "< n_min", "{:.0f}",
     "steps with a budget, jobs and room, but nothing from n_min up fit the budget"),
)
#: The default columns (``--wide``: all of :data:`COLUMNS`).
KEY_COLUMNS = ("switch_ttft_s", "call_latency_red", "switch_latency_red", "switch_ttft_red", "switch_hit_rate",
               "normal_slo_attainment", "shadow_tokens")
REDUCED = {"call_latency_red": "call_latency_s", "switch_latency_red": "switch_latency_s",
           "switch_ttft_red": "switch_ttft_s"}
SILENT_MARK = "!"
TABLE_WIDTH = 120  # the default table's width limit (characters)


#: The entry-point groups ``shadowprefill plugins`` lists, with what each holds.
GROUPS: tuple[tuple[str, Registry, str], ...] = (
    ("policies", policies, "shadow policies: factories returning a PolicySpec"),
    ("backends", backends, "engines that run a scenario under a policy"),
    ("routers", routers, "the gateway's per-step model routers"),
    ("commands", commands, "subcommands of shadowprefill"),
)


class HelpFormatter(argparse.HelpFormatter):
    """``--help`` of every command: each option with a default shows it (options without
    one, flags and help texts that state their default stay as written)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or any(action.default is x for x in (None, False, argparse.SUPPRESS))
                or "%(default)" in text or "default:" in text or "(default)" in text):
            return text
        return text + " (default: %(default)s)"

    def _split_lines(self, text: str, width: int) -> list[str]:  # no line break inside harvest-slo
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return textwrap.fill(" ".join(text.split()), width, initial_indent=indent, subsequent_indent=indent,
                             break_on_hyphens=False)


def describe(doc: str | None) -> str:
    """A docstring's first paragraph as one line (reST quotes dropped), for ``--help``."""
    text = inspect.cleandoc(doc or "").split("\n\n", 1)[0]
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text)
    return " ".join(text.replace("``", "").split())


def summary(obj: Any) -> str:
    """A plugin's one-line description: the first sentence of its own docstring (or
    of its module's), or ``(no description)``."""
    doc = obj.__doc__ if isinstance(obj, type) else inspect.getdoc(obj)
    if not doc:
        doc = getattr(inspect.getmodule(obj), "__doc__", None)
    text = describe(doc)
    end = text.find(". ")
    return (text[:end + 1] if end >= 0 else text) or "(no description)"


def _plugins(_args: argparse.Namespace) -> int:
    broken = []
    for title, registry, what in GROUPS:
        print(f"{title} ({registry.group}): {what}")
        entries = registry.entries()
        if not entries:
            print("  (none registered)")
        for name, found in entries.items():
            status, description = _check_plugin(registry, name)
            if status != "ok":
                broken.append(f"{registry.group}:{name}")
            print(f"  {name:<20} {status}  {description}  [{', '.join(e.target for e in found)}]")
    if broken:
        print(f"shadowprefill plugins: {len(broken)} broken: {', '.join(broken)}", file=sys.stderr)
        return 1
    return 0


def _check_plugin(registry: Registry, name: str) -> tuple[str, str]:
    """(``ok`` or ``BROKEN (why)``, one-line description). A policy is also built with its
    default arguments, so that a factory that fails is found here, not in a run."""
    try:
        obj = registry.load(name)
    except PluginError as exc:
        return f"BROKEN ({exc})", "-"
    if registry is not policies:
        return "ok", summary(obj)
    try:
        spec = load_policy(PluginRef(name), registry)
    except ConfigError as e:
        if e.field.startswith("policy.args"):  # needs arguments: loads, cannot be built bare
            return "ok", f"{summary(obj)} (needs arguments: {e.problem})"
        return f"BROKEN ({e.problem})", "-"
    return "ok", spec.description or summary(obj)


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


class _PolicyText(argparse.Action):
    """``--policy``/``--policies``: keeps ``(flag, text)`` in command-line order (parsed later, so an
    error is one line naming the flag rather than argparse's "invalid value")."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, [*getattr(namespace, self.dest, []), (option_string, values)])


def add_policy_options(parser: argparse.ArgumentParser, default: Sequence[str] = (), note: str = "") -> None:
    """The policy options every command shares: ``--policy 'NAME:{json}'`` (repeatable) and
    ``--policies a,b`` (a comma list, entries may carry ``:{json}`` too); both may be given and
    mixed, and keep their order. Read them with :func:`policies_from_args`. ``note`` ends both
    help texts (what the command does with them)."""
    shown = (f"; {note}" if note else "") + (f" (default: {','.join(default)})" if default else "")
    parser.add_argument("--policy", dest="policy_texts", action=_PolicyText, default=argparse.SUPPRESS,
                        metavar="NAME[:JSON]",
                        help='one policy, with JSON arguments if any, e.g. \'harvest-slo:{"beta": 0.3, '
                             '"delta": 0.1}\'; repeat it, mix it with --policies' + (f"; {note}" if note else ""))
    parser.add_argument("--policies", dest="policy_texts", action=_PolicyText, default=argparse.SUPPRESS,
                        metavar="A,B,...",
                        help="comma-separated policies, each NAME or NAME:{JSON} (commas inside the JSON do "
                             "not split)" + shown)


def policies_from_args(args: argparse.Namespace, default: Sequence[str] = ()) -> list[PluginRef]:
    """The policies of ``--policy``/``--policies`` (``default`` when neither is given), each
    loaded once so that a bad name or argument is one error naming the flag and the
    policy before anything runs."""
    given = getattr(args, "policy_texts", None) or ([("--policies", ",".join(default))] if default else [])
    refs = []
    for flag, text in given:
        for ref in parse_refs(text, flag):
            load_policy(ref, field=f"{flag} {ref.name}")
            refs.append(ref)
    return refs


def with_baseline(refs: list[PluginRef]) -> list[PluginRef]:
    """``refs`` with ``no-shadow`` first when it is missing (reductions are always against it)."""
    if any(r.name == BASELINE and not r.args for r in refs):
        return refs
    print(f"adding {BASELINE} to the policies: reductions are against it", file=sys.stderr)
    return [PluginRef(BASELINE), *refs]


def _simulate(args: argparse.Namespace) -> int:
    """Run one scenario under several policies, same workload seed for all, and print a
    comparison table. Without --scenario: the embedded default experiment on the chosen
    backend (see README); --policy/--policies pick the policies."""
    scenario = load_scenario(args.scenario)
    if args.duration is not None:
        scenario["duration_s"] = args.duration
    if args.latency_profile:
        scenario["latency_profile"] = args.latency_profile
    if args.sessions is not None:
        scenario["sessions"] = args.sessions
    if args.router is not None:
        if args.sessions is None:
            raise ConfigError("--router", args.router, "re-routes the sessions of --sessions FILE")
        scenario["session_router"] = parse_ref(args.router, "--router").to_dict()
    refs = policies_from_args(args, DEFAULT_POLICIES)  # every policy loads before anything runs
    labels = [policy_label(r) for r in refs]
    if len(set(labels)) != len(labels):
        raise ConfigError("--policy", labels, "each policy may appear once")
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
    columns = list(COLUMNS if wide else (c for c in COLUMNS if c[0] in KEY_COLUMNS))
    left_out: list[str] = []
    while True:
        header = ["policy"] + [title for _, title, _, _ in columns]
        rows = []
        for label, m in comparison["policies"].items():
            cells = [label + (SILENT_MARK if label in comparison["silent"] else "")]
            for key, _, fmt, _ in columns:
                v = m.get(key, {}).get("mean")
                cells.append("-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v))
            rows.append(cells)
        widths = [max(len(x) for x in col) for col in zip(header, *rows)]
        if wide or len(columns) <= 1 or sum(widths) + 2 * (len(widths) - 1) <= TABLE_WIDTH:
            break
        left_out.insert(0, columns.pop()[1])  # long policy names: the last key columns make room
    line = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    base = comparison["baseline"]
    note = f"one run per policy; reductions against {base}; no standard error (sim experiments: over seeds x windows)"
    notes = [note]
    if comparison["silent"]:
        notes.append(f"{SILENT_MARK} planned no shadow token although it can shadow "
                     f"({', '.join(comparison['silent'])}): see the warnings above")
    if left_out:
        notes.append(f"left out to fit {TABLE_WIDTH} columns: {', '.join(left_out)} (--wide shows every column)")
    width = max(len(title) for _, title, _, _ in columns)
    notes += [f"  {title.ljust(width)}  {text.format(base=base)}" for _, title, _, text in columns]
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows] + notes)


def _plot(args: argparse.Namespace) -> int:
    plot_main = _output("plot_main", "plot")
    return int(plot_main([*args.folders, *(["--out", args.out] if args.out else [])]))


def exit_on_sigterm() -> None:
    """Make SIGTERM raise ``SystemExit(143)`` in this (main) thread, as Ctrl-C raises
    KeyboardInterrupt, so that ``finally`` blocks run: worker pools terminate their
    workers (:func:`shadow_sim.experiments.runner.execute`) instead of orphaning them."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_signal)


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _plugins_doc() -> str:
    return ("List every registered plugin of each entry-point group (policies, backends, routers, commands) "
            "with whether it loads and a one-line description; exits 1 when any is broken.")


def _command_help(name: str, target: str) -> str:
    """A plugin command's line in ``shadowprefill --help`` (imports it: only for --help)."""
    try:
        return summary(commands.load(name))
    except PluginError as e:
        return f"BROKEN plugin {target}: {e}"


def _run_plugin_command(name: str, argv: list[str]) -> int:
    try:
        return int(commands.load(name)(argv) or 0)
    except (ConfigError, PluginError) as e:
        print(f"shadowprefill {name}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"shadowprefill {name}: interrupted", file=sys.stderr)
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    exit_on_sigterm()
    builtin = {"simulate", "plugins", "plot"}
    plugin_commands = {n: e for n, e in commands.entries().items() if n not in builtin}
    if argv and argv[0] in plugin_commands:  # its own parser handles its arguments and --help
        return _run_plugin_command(argv[0], argv[1:])
    parser = argparse.ArgumentParser(prog="shadowprefill", formatter_class=HelpFormatter,
                                     description="Shadow prefill for per-step model routing in agentic LLM "
                                                 "serving: simulate, sweep, reproduce, serve.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sim = sub.add_parser("simulate", help="run one scenario under several policies, print a comparison table",
                         formatter_class=HelpFormatter, description=describe(_simulate.__doc__))
    sim.add_argument("--backend", default=DEFAULT_BACKEND, help="registered backend name (shadowprefill plugins)")
    add_policy_options(sim, DEFAULT_POLICIES)
    sim.add_argument("--scenario", help="JSON file with scenario fields (default: the embedded scenario)")
    sim.add_argument("--duration", type=float, help="simulated seconds of arrivals")
    sim.add_argument("--latency-profile", metavar="NAME|FILE",
                     help="calibrate the latency model: a shipped profile or a JSON file (shadowprefill latency)")
    sim.add_argument("--sessions", metavar="FILE",
                     help="replay the agent sessions of a session-trace file (see shadowprefill sessions)")
    sim.add_argument("--router", metavar="NAME[:JSON]",
                     help="re-route the --sessions file's calls: markov (e.g. 'markov:{\"p_switch\": 0.4}'), "
                          "accuracy-per-cost, or a shadowprefill.session_routers plugin (default: replay)")
    sim.add_argument("--seed", type=int, default=0, help="policy seed")
    sim.add_argument("--out", metavar="DIR", help="write a result folder: per-call calls.parquet, summary.json, "
                                                 "table.txt and PNG plots (see shadowprefill plot)")
    sim.add_argument("--wide", action="store_true", help="print every column (default: the key ones, < 120 chars)")
    sim.set_defaults(func=_simulate)
    plot = sub.add_parser("plot", help="redraw a result folder's plots, or compare two folders",
                          formatter_class=HelpFormatter,
                          description="Redraw the PNG plots of a result folder (simulate/sweep --out) from its "
                                      "calls.parquet and summary.json, or draw two folders' policies on one set.")
    plot.add_argument("folders", nargs="+", metavar="DIR", help="one result folder, or two to compare")
    plot.add_argument("--out", help="where to write the PNGs (default: DIR, or DIR/compare for two)")
    plot.set_defaults(func=_plot)
    plug = sub.add_parser("plugins", help="list registered policies, backends, routers and commands",
                          formatter_class=HelpFormatter, description=describe(_plugins_doc()))
    plug.set_defaults(func=_plugins)
    wants_help = any(a in ("-h", "--help") for a in argv)
    for name, entries in plugin_commands.items():  # listed in --help; run above
        sub.add_parser(name, help=_command_help(name, entries[0].target) if wants_help else entries[0].target)
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["simulate", *argv])
    try:
        return args.func(args)
    except (ConfigError, PluginError) as e:
        print(f"shadowprefill: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("shadowprefill: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
