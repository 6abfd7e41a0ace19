"""``shadowprefill sessions``: convert agent sessions into the session-trace
format and print their Table 1 statistics.

::

    shadowprefill sessions convert --from swe-agent a.traj b.traj -o mine.jsonl [--tokenizer PATH]
    shadowprefill sessions convert --from copilot shard-0000.jsonl.gz -o copilot.jsonl
    shadowprefill sessions convert --from csv calls.csv -o mine.jsonl
    shadowprefill sessions convert --from preset fusionbench --num-sessions 2000 -o fb.jsonl
    shadowprefill sessions stats mine.jsonl [--block-size 16] [--json]

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
from shadowcore.workloads.sessions import PRESETS, TABLE1, generate, get_preset

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
    )


def preset_trace(name: str, num_sessions: int, seed: int = 0) -> SessionTrace:
    """``num_sessions`` sessions of a preset (as :func:`~shadowcore.workloads.sessions.generate`
    draws them), as a trace whose header names the preset and seed."""
    if isinstance(num_sessions, bool) or not isinstance(num_sessions, int) or num_sessions < 1:
        raise ConfigError("--num-sessions", num_sessions, "must be an integer >= 1")
    sessions = generate(get_preset(name), math.inf, seed, max_sessions=num_sessions)
    header = TraceHeader(source=f"preset:{name}", tokenizer="synthetic",
                         metadata={"preset": name, "seed": seed, "num_sessions": num_sessions})
    return from_agent_sessions(sessions, header)


def _pct(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.1%}"


def format_stats(st: TraceStats, header: TraceHeader) -> str:
    rows = [
        ("sessions", f"{st.num_sessions}"), ("calls", f"{st.num_calls}"),
        ("calls / session", f"{st.mean_calls_per_session:.2f}"),
        ("switch rate", f"{st.switch_rate:.1%}"), ("switches / session", f"{st.switches_per_session:.2f}"),
        ("mean prompt", f"{st.mean_prompt / 1000:.1f}K"), ("p99 prompt", f"{st.p99_prompt / 1000:.1f}K"),
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
    s = sub.add_parser("stats", help="Table 1 statistics of a session-trace file")
    s.add_argument("file")
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


if __name__ == "__main__":
    sys.exit(main())
