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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shadowcore.config import PluginRef, ShadowConfig
from shadowcore.errors import ConfigError, PluginError
from shadowcore.policy import load_policy
from shadowcore.registry import Registry, backends, commands, policies

DEFAULT_POLICIES = ("no-shadow", "harvest-slo-host", "oracle-host")
DEFAULT_BACKEND = "sim"
COLUMNS = (
    ("call_latency_s", "call lat (s)", "{:.3f}"),
    ("switch_latency_s", "switch lat (s)", "{:.3f}"),
    ("switch_ttft_s", "switch TTFT (s)", "{:.3f}"),
    ("hit_rate", "hit rate", "{:.1%}"),
    ("switch_hit_rate", "switch hit", "{:.1%}"),
    ("normal_slo_attainment", "normal SLO", "{:.1%}"),
    ("shadow_tokens", "shadow tok", "{:.0f}"),
)


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


def _simulate(args: argparse.Namespace) -> int:
    scenario = load_scenario(args.scenario)
    if args.duration is not None:
        scenario["duration_s"] = args.duration
    if args.latency_profile:
        scenario["latency_profile"] = args.latency_profile
    if args.policy and args.policies is not None:
        raise ConfigError("--policy", args.policy, "give --policies or --policy, not both")
    if args.policy:
        refs = [policy_ref(p) for p in args.policy]
    else:
        names = args.policies if args.policies is not None else ",".join(DEFAULT_POLICIES)
        refs = [PluginRef(n.strip()) for n in names.split(",") if n.strip()]
    for i, ref in enumerate(refs):  # every policy loads before anything runs (a bad argument costs no run)
        load_policy(ref, field=f"--policy {ref.name}" if args.policy else f"--policies[{i}]")
    configs = [ShadowConfig(ref, seed=args.seed) for ref in refs]
    backend = backends.load(args.backend)()
    compare = getattr(backend, "compare", None)  # a backend's own runner (sim: matched calls, reductions, +-SE)
    if compare is not None:
        table = compare(scenario, configs)
        if table is not None:
            print(table)
            return 0
    results = []
    for i, cfg in enumerate(configs, 1):
        print(f"[{i}/{len(configs)}] {cfg.policy.name} ...", file=sys.stderr, flush=True)
        results.append(backend.run(scenario, cfg))
    print(format_table(results))
    return 0


def format_table(results: Sequence[Any]) -> str:
    """A comparison table; the last column is the call-latency reduction
    against the first policy (the baseline)."""
    header = ["policy"] + [c[1] for c in COLUMNS] + ["lat. red."]
    rows = []
    base = results[0].metrics["call_latency_s"] if results else math.nan
    for r in results:
        cells = [r.policy] + [fmt.format(r.metrics[key]) for key, _, fmt in COLUMNS]
        cells.append(f"{(1 - r.metrics['call_latency_s'] / base):+.1%}" if base else "n/a")
        rows.append(cells)
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _run_plugin_command(name: str, argv: list[str]) -> int:
    try:
        return int(commands.load(name)(argv) or 0)
    except (ConfigError, PluginError) as e:
        print(f"shadowprefill {name}: error: {e}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    builtin = {"simulate", "plugins"}
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
    sim.add_argument("--latency-profile", metavar="NAME|FILE",
                     help="calibrate the latency model: a shipped profile or a JSON file (shadowprefill latency)")
    sim.add_argument("--seed", type=int, default=0, help="policy seed")
    sim.set_defaults(func=_simulate)
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
