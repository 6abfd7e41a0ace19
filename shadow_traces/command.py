"""``shadowprefill sessions``: convert agent sessions into the session-trace
format and print their Table 1 statistics.

::

    shadowprefill sessions convert --from swe-agent a.traj b.traj -o mine.jsonl [--tokenizer PATH]
    shadowprefill sessions convert --from copilot shard-0000.jsonl.gz -o copilot.jsonl
    shadowprefill sessions convert --from csv calls.csv -o mine.jsonl
    shadowprefill sessions convert --from preset fusionbench --num-sessions 2000 -o fb.jsonl
    shadowprefill sessions stats mine.jsonl [--block-size 16] [--json]
    shadowprefill sessions stats --preset fusionbench-testbed --pair Q7/L70 [--num-sessions 2000] [--seed 0]

Statistics (:func:`trace_stats`): the workload columns of the paper's Table 1
(switch rate = switch calls / calls, switches per session, mean and p99 of the
prompt over all calls; numpy's linear-interpolation percentile) and the hit
rates a no-shadow deployment would get with an IDEAL prefix cache: each model
keeps, for every session, the whole sequence (prompt + output) of the last call
it served, nothing is evicted, and the session stays on one instance per model;
a call on model ``m`` hits the common prefix with what ``m`` served last,
rounded down to ``block_size`` and at most prompt - 1 tokens (the engine always
computes the last prompt token); a compaction makes every earlier cache useless.
Hit rates are token-weighted over all calls and over switch calls. Where the
trace carries observed ``cached_tokens`` their hit rate is printed too.
For a trace exported from a preset the Table 1 targets are printed beside it.

``--preset NAME`` draws the preset's sessions (``--pair`` maps them onto a
catalog pair, with the pair's own published statistics where it has them:
:func:`~shadowcore.workloads.sessions.for_pair`) and prints, next to ours, the
paper's Table 1 row of the workload, Table 5's row of the pair, and the
switch/same-call cost ratio beside Figure 2d's. Our ratio is an ISOLATED
estimate, not a serving measurement: per call, the batch-1 prefill of its
uncached tokens (ideal cache, chunks of 2,048 tokens) plus its output tokens
decoded one at a time at the call's context, with the simulator's latency model
of the call's model on H100 (``--latency``); the paper's is measured under
load (rho 0.7), where decoding slows and queues form, so expect ours lower.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence

import attrs
import numpy as np

from shadow_traces.agent_loaders import LOADERS
from shadow_traces.session_trace import (
    SessionTrace,
    TraceHeader,
    from_agent_sessions,
    read_session_trace,
    write_session_trace,
)
from shadowcore.errors import ConfigError, ShadowError
from shadowcore.workloads.sessions import (
    FIGURE2D_SWITCH_COST,
    PRESETS,
    TABLE1,
    TABLE5,
    for_pair,
    generate,
    get_preset,
)

__all__ = ["TraceStats", "main", "preset_trace", "trace_stats"]


@attrs.frozen
class TraceStats:
    """Table 1 statistics of a session trace (see the module docstring)."""

    num_sessions: int
    num_calls: int
    num_switch_calls: int
    switch_rate: float
    switches_per_session: float
    mean_calls_per_session: float
    mean_prompt: float
    p99_prompt: float
    compactions_per_session: float
    ideal_hit_rate: float
    ideal_switch_hit_rate: float
    observed_hit_rate: float | None  # None: the trace records no cached_tokens
    calls_without_model: int
    mean_output: float | None = None  # output tokens per call


def _ideal_cached(trace: SessionTrace, block_size: int) -> tuple[list[int], list[int], list[bool]]:
    prompts, cached, switch = [], [], []
    for s in trace.sessions:
        served: dict[str | None, int] = {}
        prev_model: str | None = None
        for i, (c, prompt) in enumerate(zip(s.calls, s.prompt_lengths())):
            if c.compact_to_tokens is not None:
                served.clear()
            hit = min(served.get(c.model, 0), max(0, prompt - 1))
            prompts.append(prompt)
            cached.append(hit // block_size * block_size)
            switch.append(i > 0 and c.model != prev_model)
            served[c.model] = prompt + c.output_tokens
            prev_model = c.model
    return prompts, cached, switch


def trace_stats(trace: SessionTrace, block_size: int = 16) -> TraceStats:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ConfigError("block_size", block_size, "must be an integer >= 1")
    if not trace.sessions:
        raise ConfigError("trace", 0, "holds no sessions")
    prompts, cached, switch = _ideal_cached(trace, block_size)
    p = np.asarray(prompts, dtype=np.float64)
    c = np.asarray(cached, dtype=np.float64)
    sw = np.asarray(switch, dtype=bool)
    n, calls = len(trace.sessions), len(prompts)
    observed = [x.cached_tokens for s in trace.sessions for x in s.calls]
    obs = None
    if any(o is not None for o in observed):
        known = [(o, q) for o, q in zip(observed, prompts) if o is not None]
        total = sum(q for _, q in known)
        obs = sum(o for o, _ in known) / total if total else math.nan

    def ratio(mask: np.ndarray) -> float:
        total = p[mask].sum()
        return float(c[mask].sum() / total) if total else math.nan

    compactions = sum(x.compact_to_tokens is not None for s in trace.sessions for x in s.calls)
    return TraceStats(
        n, calls, int(sw.sum()), float(sw.sum() / calls), float(sw.sum() / n), calls / n, float(p.mean()),
        float(np.percentile(p, 99)), compactions / n, ratio(np.ones(calls, dtype=bool)), ratio(sw), obs,
        sum(x.model is None for s in trace.sessions for x in s.calls),
        float(np.mean([x.output_tokens for s in trace.sessions for x in s.calls])),
    )


def preset_trace(name: str, num_sessions: int, seed: int = 0, models: Sequence[str] | None = None) -> SessionTrace:
    """``num_sessions`` sessions of a preset (as :func:`~shadowcore.workloads.sessions.generate`
    draws them), as a trace whose header names the preset and seed; ``models`` (a pair) maps
    the preset onto them with the pair's own statistics (:func:`~shadowcore.workloads.sessions.for_pair`)."""
    if isinstance(num_sessions, bool) or not isinstance(num_sessions, int) or num_sessions < 1:
        raise ConfigError("--num-sessions", num_sessions, "must be an integer >= 1")
    preset = get_preset(name)
    if models is not None:
        preset = attrs.evolve(for_pair(preset, models), models=tuple(models))
    sessions = generate(preset, math.inf, seed, max_sessions=num_sessions)
    header = TraceHeader(source=f"preset:{name}", tokenizer="synthetic",
                         metadata={"preset": name, "seed": seed, "num_sessions": num_sessions,
                                   **({"models": list(models)} if models is not None else {})})
    return from_agent_sessions(sessions, header)


def call_costs(trace: SessionTrace, block_size: int, latency: dict, chunk_tokens: int = 2048,
               max_calls: int = 4000) -> tuple[float, float]:
    """(mean isolated cost of a switch call, of a same-model call) in seconds, over the first
    ``max_calls`` calls of each kind (see the module docstring); ``latency`` maps a trace model
    to its latency model."""
    from shadowcore.latency import BatchShape, chunked_prefill_s

    prompts, cached, switch = _ideal_cached(trace, block_size)
    calls = [c for s in trace.sessions for c in s.calls]
    costs: dict[bool, list[float]] = {True: [], False: []}
    for c, prompt, hit, sw in zip(calls, prompts, cached, switch):
        if c.model is None or len(costs[sw]) >= max_calls or (not sw and c is calls[0]):
            continue
        lat = latency[c.model]
        decode = lat.predict_s(BatchShape((), (prompt + c.output_tokens // 2,)))
        costs[sw].append(chunked_prefill_s(lat, prompt - hit, chunk_tokens, hit) + c.output_tokens * decode)
    mean = lambda xs: sum(xs) / len(xs) if xs else math.nan
    return mean(costs[True]), mean(costs[False])


def _pct(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.1%}"


def format_stats(st: TraceStats, header: TraceHeader) -> str:
    rows = [
        ("sessions", f"{st.num_sessions}"), ("calls", f"{st.num_calls}"),
        ("calls / session", f"{st.mean_calls_per_session:.2f}"),
        ("switch rate", f"{st.switch_rate:.1%}"), ("switches / session", f"{st.switches_per_session:.2f}"),
        ("mean prompt", f"{st.mean_prompt / 1000:.1f}K"), ("p99 prompt", f"{st.p99_prompt / 1000:.1f}K"),
        ("mean output", "-" if st.mean_output is None else f"{st.mean_output:.0f}"),
        ("compactions / session", f"{st.compactions_per_session:.2f}"),
        ("hit rate (no-shadow, ideal cache)", _pct(st.ideal_hit_rate)),
        ("switch hit rate (no-shadow, ideal cache)", _pct(st.ideal_switch_hit_rate)),
    ]
    if st.observed_hit_rate is not None:
        rows.append(("hit rate (observed cached_tokens)", _pct(st.observed_hit_rate)))
    if st.calls_without_model:
        rows.append(("calls without a model", f"{st.calls_without_model} (switches need a router)"))
    preset = header.metadata.get("preset") if header.source.startswith("preset:") else None
    target = TABLE1.get(preset) if isinstance(preset, str) else None
    if target is not None:
        want = {"switch rate": f"{target.switch_rate:.1%}", "switches / session": f"{target.switches_per_session:.2f}",
                "mean prompt": f"{target.mean_prompt / 1000:.1f}K", "p99 prompt": f"{target.p99_prompt / 1000:.1f}K",
                "hit rate (no-shadow, ideal cache)": f"{target.hit_rate:.1f}% (measured, not fitted)",
                "switch hit rate (no-shadow, ideal cache)": f"{target.switch_hit_rate:.1f}% (measured, not fitted)"}
        rows = [(k, v + (f"   Table 1 {preset}: {want[k]}" if k in want else "")) for k, v in rows]
    width = max(len(k) for k, _ in rows)
    src = f"source: {header.source or '?'}; token counts: {header.tokenizer or '?'}"
    return "\n".join([src] + [f"{k:<{width}}  {v}" for k, v in rows])


def paper_rows(preset: str, models: Sequence[str] | None, st: TraceStats,
               ratio: tuple[float, float] | None) -> str:
    """Table 1's row of ``preset``'s workload, Table 5's row of the pair, Figure 2d's switch
    cost, each next to ours; 'unpublished' where the paper gives no number."""
    bench = "fusionbench" if preset == "fusionbench-testbed" else preset
    t1 = TABLE1.get(bench)
    t5 = TABLE5.get(tuple(m.lower() for m in models)) if models else None
    if t5 is not None and t5.benchmark != bench:  # Table 5 is the testbed's FusionBench and SWE-bench replay
        t5 = None
    out = [f"{'statistic':<34} {'ours':>9} {'Table 1':>9} {'Table 5':>9}"]

    def row(name: str, ours: str, a: str, b: str) -> None:
        out.append(f"{name:<34} {ours:>9} {a:>9} {b:>9}")

    k = lambda x: f"{x / 1000:.1f}K"
    row("switch rate", f"{st.switch_rate:.1%}", f"{t1.switch_rate:.0%}" if t1 else "-",
        f"{t5.switch_rate:.0%}" if t5 else "-")
    row("switches / session", f"{st.switches_per_session:.2f}", f"{t1.switches_per_session}" if t1 else "-",
        f"{t5.switches_per_session}" if t5 else "-")
    row("mean prompt", k(st.mean_prompt), k(t1.mean_prompt) if t1 else "-", k(t5.mean_prompt) if t5 else "-")
    row("p99 prompt", k(st.p99_prompt), k(t1.p99_prompt) if t1 else "-", k(t5.p99_prompt) if t5 else "-")
    mean_output = "-" if st.mean_output is None else f"{st.mean_output:.0f}"
    row("mean output", mean_output, "unpubl.", f"{t5.mean_output:.0f}" if t5 else "unpubl.")
    row("hit rate (ideal cache / served)", _pct(st.ideal_hit_rate), f"{t1.hit_rate:.1f}%" if t1 else "-",
        f"{t5.hit_rate:.1f}%" if t5 else "-")
    if ratio is not None:
        sw, same = ratio
        fig = FIGURE2D_SWITCH_COST.get(bench)
        out.append(f"switch / same-model call cost: ours {sw / same:.2f}x (isolated: {sw:.2f} s / {same:.2f} s), "
                   f"Figure 2d {f'{fig:.1f}x (measured under load)' if fig else 'unpublished for this workload'}")
    out.append("(Table 1's hit rates and Table 5's are served outcomes, not fitted; 'unpubl.': the paper gives none)")
    return "\n".join(out)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shadowprefill sessions", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="action", required=True)
    c = sub.add_parser("convert", help="convert sessions into a session-trace file")
    c.add_argument("--from", dest="source", required=True, choices=(*LOADERS, "preset"))
    c.add_argument("inputs", nargs="+", metavar="IN", help="input files (for --from preset: the preset name)")
    c.add_argument("-o", "--output", required=True, help="the .jsonl file to write")
    c.add_argument("--tokenizer", help="swe-agent: a local tokenizer.json or tokenizer folder "
                   "(default: the chars/4 estimate)")
    c.add_argument("--model", help="swe-agent: the model of every call (default: the trajectory's)")
    c.add_argument("--session-interval", type=float, default=10.0, help="swe-agent: seconds between sessions")
    c.add_argument("--tool-gap", type=float, default=2.0,
                   help="swe-agent: tool seconds where the trajectory records no execution_time")
    c.add_argument("--num-sessions", type=int, default=2000, help="preset: how many sessions")
    c.add_argument("--seed", type=int, default=0, help="preset: generation seed")
    s = sub.add_parser("stats", help="Table 1 statistics of a session-trace file or a preset")
    s.add_argument("file", nargs="?", help="a session-trace file (or give --preset)")
    s.add_argument("--preset", help="draw a preset's sessions and compare them with the paper's Tables 1 and 5")
    s.add_argument("--pair", help="preset: a catalog pair (e.g. Q7/L70) or two models A,B (default: the preset's)")
    s.add_argument("--num-sessions", type=int, default=2000, help="preset: how many sessions")
    s.add_argument("--seed", type=int, default=0, help="preset: generation seed")
    s.add_argument("--latency", default="vidur", choices=("vidur", "roofline", "none"),
                   help="preset: latency model of the isolated switch/same cost ratio (none: skip it)")
    s.add_argument("--block-size", type=int, default=16, help="prefix-cache block size of the ideal cache")
    s.add_argument("--json", action="store_true", help="print JSON")
    return p


def _convert(args: argparse.Namespace) -> int:
    if args.source == "preset":
        if len(args.inputs) != 1 or args.inputs[0] not in PRESETS:
            raise ConfigError("--from preset", args.inputs, f"give one preset name ({', '.join(PRESETS)})")
        trace, notes = preset_trace(args.inputs[0], args.num_sessions, args.seed), []
    elif args.source == "swe-agent":
        trace, notes = LOADERS["swe-agent"](args.inputs, tokenizer=args.tokenizer, model=args.model,
                                            session_interval_s=args.session_interval, tool_gap_s=args.tool_gap)
    else:
        if len(args.inputs) != 1:
            raise ConfigError(f"--from {args.source}", args.inputs, "takes one input file")
        trace, notes = LOADERS[args.source](args.inputs[0])
    write_session_trace(trace, args.output)
    for n in notes:
        print(n, file=sys.stderr)
    print(f"wrote {args.output}: {len(trace)} sessions, {trace.num_calls} calls, models {list(trace.models)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.action == "convert":
            return _convert(args)
        if args.preset is not None:
            return _preset_stats(args)
        if args.file is None:
            raise ConfigError("file", None, "give a session-trace file or --preset NAME")
        if args.pair is not None:
            raise ConfigError("--pair", args.pair, "goes with --preset")
        trace = read_session_trace(args.file)
        st = trace_stats(trace, args.block_size)
        if args.json:
            print(json.dumps({k: None if isinstance(v, float) and math.isnan(v) else v
                              for k, v in attrs.asdict(st).items()}, indent=1))
        else:
            print(format_stats(st, trace.header))
        return 0
    except ShadowError as e:
        print(f"shadowprefill sessions: error: {e}", file=sys.stderr)
        return 2


def _pair_models(pair: str | None, preset: str) -> tuple[str, ...] | None:
    if pair is None:
        return None
    if "," in pair:
        models = tuple(m.strip() for m in pair.split(",") if m.strip())
    else:
        from shadow_sim.experiments.spec import PAIRS

        if pair not in PAIRS:
            raise ConfigError("--pair", pair, f"not a pair name ({', '.join(PAIRS)}); or give two models A,B")
        models = PAIRS[pair]
    if len(models) != len(get_preset(preset).models):
        raise ConfigError("--pair", pair, f"preset {preset!r} needs {len(get_preset(preset).models)} models")
    return models


def _preset_stats(args: argparse.Namespace) -> int:
    if args.file is not None:
        raise ConfigError("file", args.file, "give either a file or --preset")
    models = _pair_models(args.pair, args.preset)
    trace = preset_trace(args.preset, args.num_sessions, args.seed, models=models)
    st = trace_stats(trace, args.block_size)
    ratio = None
    if args.latency != "none":
        from shadow_sim.latency import latency_model

        latency = {m: latency_model(m, kind=args.latency) for m in trace.models}
        ratio = call_costs(trace, args.block_size, latency)
    if args.json:
        data = {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in attrs.asdict(st).items()}
        if ratio is not None:
            data["switch_cost_s"], data["same_model_cost_s"] = ratio
        print(json.dumps(data, indent=1))
        return 0
    print(format_stats(st, attrs.evolve(trace.header, source=f"preset {args.preset}"
                                        + (f" on {', '.join(models)}" if models else ""))))
    print()
    print(paper_rows(args.preset, models, st, ratio))
    return 0


if __name__ == "__main__":
    sys.exit(main())
