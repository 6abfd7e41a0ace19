"""Where a shadow policy's iterations cost more than no-shadow's, by path (issue 17's hour target).

One run of the scale benchmark's cluster (``scale.py``'s ``one_run``: the embedded default, rho 0.7) with
timers around the engine's entry points and the shadow path's steps. Iterations are split by whether a job
was pending on the instance when the iteration started (``start_step``/``end_step``; ``run_steady`` takes
runs of steady iterations in one call, and only where none is pending), and the shadow steps are timed
inside them: the planned iterations (``_start_agg_planned``, of which the hook's ``begin_step`` and the chunk's
KV work ``_run_shadow``), the proven-empty ones (``_empty_plan_reason``, of which the job refresh
``_refreshed_jobs`` and its prefix lookups ``cached_prefix_blocks``), the owed evictions' settle and the
prefix scans (``match_prefix``). Steady starts (``_start_steady``) are also split by the dearest of those
steps run inside each: one that plans, one whose refresh settles owed evictions, one whose refresh scans, one
answered from memory, and one with no lookup at all.

Timers nest (a step's time is inside its iteration's), so the rows do not add up, and they add their own cost
(the instrumented run is slower than ``scale.py --child``'s): read the shares and the per-call times against
each other, not as CPU seconds of an uninstrumented run. The simulator's results are those of an
uninstrumented run (the timers only wrap).

    python benchmarks/shadow_path.py                                  # harvest-slo-host, 8 instances, 300 s
    python benchmarks/shadow_path.py --policy no-shadow --duration 120
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import time

from scale import one_run

#: The engine's entry points, each timed apart by whether a job was pending on the instance.
_ENTRIES = ("start_step", "end_step", "run_steady")
#: The shadow path's steps: (module, class, method, label), each timed as a whole.
_STEPS = (
    ("shadowcore.engine.instance", "EngineInstance", "_start_agg_planned", "planned iteration (the hook may grant)"),
    ("shadowcore.hook", "EngineHook", "begin_step", "  of which: the hook's plan"),
    ("shadowcore.engine.instance", "EngineInstance", "_run_shadow", "  of which: the chunks' KV work"),
    ("shadowcore.engine.instance", "EngineInstance", "_empty_plan_reason", "proven-empty iteration's check"),
    ("shadowcore.hook", "EngineHook", "_refreshed_jobs", "  of which: the job refresh"),
    ("shadowcore.kv", "KVClassManager", "cached_prefix_blocks", "prefix lookups (refresh and placement)"),
    ("shadowcore.kv", "KVClassManager", "_settle", "owed evictions settled"),
    ("shadowcore.kv", "KVClassManager", "match_prefix", "prefix scans (lookups not remembered, chunks)"),
)
#: Steady starts (``_start_steady``) split by what their shadow path did, from the steps seen inside each.
_STEADY_KINDS = (
    ("planned iteration (the hook may grant)", "steady start that plans (may grant)"),
    ("owed evictions settled", "steady start whose refresh settles (and scans)"),
    ("prefix scans (lookups not remembered, chunks)", "steady start whose refresh scans"),
    ("prefix lookups (refresh and placement)", "steady start answered from memory"),
)


def _instrument(times: collections.Counter, calls: collections.Counter) -> None:
    from shadowcore.engine.instance import EngineInstance

    clock = time.process_time_ns

    def pending(inst) -> str:
        hook = inst.hook
        if hook is None:
            return "no hook"
        return "job pending" if hook.manager.pending_jobs(inst.instance_id) else "no job pending"

    for name in _ENTRIES:
        orig = getattr(EngineInstance, name)

        @functools.wraps(orig)
        def entry(self, *args, _orig=orig, _name=name, **kwargs):
            key = (_name, pending(self))
            t0 = clock()
            out = _orig(self, *args, **kwargs)
            times[key] += clock() - t0
            calls[key] += out[1] if _name == "run_steady" else 1  # run_steady: (last, num, end)
            return out

        setattr(EngineInstance, name, entry)
    seen: set[str] = set()  # the steps run inside the steady start being timed
    for module, cls_name, name, label in _STEPS:
        cls = getattr(importlib.import_module(module), cls_name)
        orig = getattr(cls, name)

        @functools.wraps(orig)
        def step(*args, _orig=orig, _label=label, **kwargs):
            seen.add(_label)
            t0 = clock()
            out = _orig(*args, **kwargs)
            times[(_label, "")] += clock() - t0
            calls[(_label, "")] += 1
            return out

        setattr(cls, name, step)
    steady = EngineInstance._start_steady

    @functools.wraps(steady)
    def start_steady(self, *args, **kwargs):
        seen.clear()
        waiting = pending(self)  # when the start began, as for the entry points
        t0 = clock()
        out = steady(self, *args, **kwargs)
        dt = clock() - t0
        kind = next((k for label, k in _STEADY_KINDS if label in seen), "steady start with no lookup")
        times[(kind, waiting)] += dt
        calls[(kind, waiting)] += 1
        return out

    EngineInstance._start_steady = start_steady


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="harvest-slo-host")
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--rho", type=float, default=0.7)
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of arrivals (default 300)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    times: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    _instrument(times, calls)
    r = one_run(args.policy, args.instances, args.rho, args.duration, args.seed)
    routed = r["routed_calls"]
    print(f"{args.policy}, {args.instances} instances, rho {args.rho}, {args.duration:g} s of arrivals, seed "
          f"{args.seed}: {r['iterations']:,} iterations, {routed:,} routed calls, instrumented run "
          f"{r['cpu_s']:.2f} CPU-s")
    print(f"{'path':<48} {'pending':<15} {'iterations/calls':>16} {'CPU s':>8} {'share':>6} {'us each':>9} "
          f"{'ms/routed call':>14}")
    kinds = [k for _, k in _STEADY_KINDS] + ["steady start with no lookup"]
    order = [(n, p) for n in (*_ENTRIES, *kinds) for p in ("job pending", "no job pending", "no hook")] + \
        [(label, "") for *_x, label in _STEPS]
    for key in order:
        if not calls[key]:
            continue
        s = times[key] / 1e9
        print(f"{key[0]:<48} {key[1]:<15} {calls[key]:>16,} {s:>8.3f} {s / r['cpu_s']:>6.1%} "
              f"{times[key] / calls[key] / 1e3:>9.2f} {s * 1e3 / max(1, routed):>14.2f}")
    print("rows nest (a step's time is inside its iteration's); the timers add their own cost: compare shares")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
