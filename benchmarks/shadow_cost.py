"""Where a shadow policy's extra simulator cost goes (issue 17): the pieces of
the shadow path timed in place, per simulated hour, beside the run's CPU time.

    python benchmarks/shadow_cost.py                              # harvest-slo-host, 8 instances, rho 0.7, 120 s
    python benchmarks/shadow_cost.py --policy harvest-slo --duration 60

One run of ``scale.py``'s setting in this process, with the engine's and the
hook's shadow-path functions wrapped by a timer (``time.thread_time`` around
each call: this thread's CPU time, so a loaded machine's waits are left out
but not its cache misses; the timer adds about a microsecond a call; compare
the rows with each other and with the run's CPU time, not with another
day's). Rows overlap where one piece calls another: the hook's refresh
(``cached_prefix_tokens``) is mostly inside ``empty plan``, and the owed evictions a KV query settles first
(``settle``: eviction and host-tier spill work the next query would do anyway)
are shown apart from the scan they precede. Changes nothing in the run: the
same iterations, calls and simulated seconds as ``scale.py --child`` prints.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import scale

from shadowcore import hook, kv
from shadowcore.engine import _fastpath
from shadowcore.engine import instance as engine

#: (owner, attribute, row): what is timed. Module functions are looked up by the engine at call time.
PIECES = (
    (_fastpath, "empty_plan_reason", "empty plan (budget, refresh, sizing) of a mixed iteration"),
    (engine.EngineInstance, "_summary", "aggregate snapshot of a mixed iteration"),
    (hook.EngineHook, "budget", "the controller's budget (hook.budget)"),
    (hook.EngineHook, "_refreshed_jobs", "the hook's job refresh (_refreshed_jobs)"),
    (hook.EngineHook, "_size", "the hook's sizing (_size: latency lookups)"),
    (engine.EngineInstance, "cached_prefix_tokens", "cached_prefix_tokens (the hook's refresh; the router's placement)"),
    (_fastpath, "can_skip", "can_skip (a steady iteration)"),
    (engine.EngineInstance, "_start_agg_planned", "planned iteration (snapshot, plan, shadow KV)"),
    (kv.KVClassManager, "release", "KV release (shadow chunks, and others)"),
    (kv._HostTier, "spill", "host-tier spill (evictions)"),
)


def _timed(fn, row: str, totals: collections.Counter, counts: collections.Counter, stack: list):
    def timed(*args, **kwargs):
        stack.append(row)
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[row] += time.thread_time() - t0
            counts[row] += 1
            stack.pop()
    return timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="harvest-slo-host")
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--rho", type=float, default=0.7)
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    totals, counts, stack = collections.Counter(), collections.Counter(), []
    for owner, name, row in PIECES:
        setattr(owner, name, _timed(getattr(owner, name), row, totals, counts, stack))
    settle = kv.KVClassManager._settle

    def timed_settle(self) -> None:
        t0 = time.thread_time()
        settle(self)
        row = f"settle (owed evictions) inside: {stack[-1] if stack else 'the rest'}"
        totals[row] += time.thread_time() - t0
        counts[row] += 1

    kv.KVClassManager._settle = timed_settle
    r = scale.one_run(args.policy, args.instances, args.rho, args.duration, args.seed)
    per_hour = scale.HOUR_S / r["simulated_s"]
    print(f"{args.policy}, {args.instances} instances, rho {args.rho}, {args.duration:g} s of arrivals: "
          f"{r['simulated_s']:.0f} s simulated, {r['iterations']:,} iterations, {r['cpu_s']:.2f} CPU-s "
          f"({r['cpu_s'] * per_hour:.1f} per simulated hour, timers included)")
    print(f"{'piece':<72} {'calls':>8} {'us/call':>8} {'s/sim-h':>8}")
    for row in sorted(totals, key=totals.get, reverse=True):
        print(f"{row:<72} {counts[row]:>8,} {totals[row] / counts[row] * 1e6:>8.1f} {totals[row] * per_hour:>8.2f}")


if __name__ == "__main__":
    main()
