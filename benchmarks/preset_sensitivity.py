"""Sensitivity of the headline to a number the paper does not publish.

Table 1 gives no output length for xRouteBench, Router-R1 or GHCP-coding (Table 5
gives one only for the testbed's FusionBench and SWE-bench pairs), so those
presets' outputs are reasoned choices. This script scales one preset's output
median (``--scales``) and prints, per scale, the simulator's headline under
Harvest-SLO+Host against No Shadow: switch-call latency, switch-call TTFT and
LLM-call latency reductions (one seed, peak window; short runs, see the flags).
Not a test: it prints figures for docs/reproduction.md.

    python benchmarks/preset_sensitivity.py --preset router-r1 --scales 0.5,1,2
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import attrs


def main(argv: list[str] | None = None) -> int:
    from shadow_sim.experiments.calibrate import capacities
    from shadow_sim.experiments.runner import compare, execute, tasks_for
    from shadow_sim.experiments.spec import PAIRS, Experiment

    from shadowcore.config import PluginRef
    from shadowcore.workloads import sessions

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="router-r1")
    p.add_argument("--pair", default="Q7/L70")
    p.add_argument("--scales", default="0.5,1,2", help="output-median multipliers")
    p.add_argument("--instances", type=int, default=2)
    p.add_argument("--duration", type=float, default=180.0)
    p.add_argument("--warmup", type=float, default=40.0)
    p.add_argument("--session-rate", type=float, default=0.1)
    p.add_argument("--jobs", type=int, default=1)
    a = p.parse_args(argv)
    base = sessions.PRESETS[a.preset]
    fields = {"models": list(PAIRS[a.pair]), "preset": a.preset, "instances_per_model": a.instances,
              "duration_s": a.duration, "warmup_s": a.warmup, "drain_s": 30.0, "session_rate_per_s": a.session_rate}
    ex = Experiment.from_dict(fields)
    caps = {m: c.capacity_per_s for m, c in capacities(ex).items()}  # outputs do not enter the capacity
    policies = (PluginRef("no-shadow"), PluginRef("harvest-slo-host"))
    print(f"{a.preset} on {a.pair}: output median x scale (the preset's: {base.output.median:g}, sigma "
          f"{base.output.sigma:g}); {a.instances} instances/model, {a.duration:.0f} s after {a.warmup:.0f} s, seed 0, "
          f"capacities {caps}")
    print(f"{'scale':>6} {'mean out':>9} {'switch lat red':>15} {'switch TTFT red':>16} {'call lat red':>13}")
    for scale in (float(s) for s in a.scales.split(",")):
        t0 = time.time()
        sessions.PRESETS[a.preset] = attrs.evolve(base, output=attrs.evolve(base.output, median=base.output.median
                                                                                * scale))
        try:
            tasks = tasks_for(Experiment.from_dict(fields), policies, (0,), ("peak",), caps, "x")
            c = compare(execute(tasks, jobs=a.jobs), tasks)["x"]
        finally:
            sessions.PRESETS[a.preset] = base
        h = c.summary["harvest-slo-host"]
        drawn = sessions.generate(attrs.evolve(base, output=attrs.evolve(base.output, median=base.output.median
                                                                         * scale)), math.inf, 0, max_sessions=500)
        outs = [x.num_output_tokens for s in drawn for x in s.calls]
        mean_out = sum(outs) / len(outs)
        print(f"{scale:6g} {mean_out:9.0f} {100 * h['switch_latency_red'][0]:14.1f}% "
              f"{100 * h['switch_ttft_red'][0]:15.1f}% {100 * h['call_latency_red'][0]:12.1f}%   "
              f"({time.time() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
