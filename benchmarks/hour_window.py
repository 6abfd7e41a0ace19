"""Time a one-hour window of the default simulator scenario (two models, four
instances each, Vidur latency) under one policy, and print wall time and
iterations per wall-second. The simulator issue asks for "minutes on 2 cores".

    python benchmarks/hour_window.py [--policy harvest-slo-host] [--duration 3600] [--normal-rate 1.0]

The normal-traffic rate is per instance (requests/s); capacity calibration to
rho x capacity belongs to the workload runner.
"""

from __future__ import annotations

import argparse
import time

from shadow_sim.simulator import SimRun, SimScenario

from shadowcore.config import PluginRef, ShadowConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="harvest-slo-host")
    ap.add_argument("--duration", type=float, default=3600.0)
    ap.add_argument("--normal-rate", type=float, default=1.0)
    ap.add_argument("--latency", default="vidur", choices=["vidur", "roofline"])
    args = ap.parse_args()
    scenario = SimScenario.from_dict(
        {"duration_s": args.duration, "normal_rate_per_s": args.normal_rate, "latency": args.latency}
    )
    t0 = time.perf_counter()
    run = SimRun(scenario, ShadowConfig(PluginRef(args.policy)))
    setup_s = time.perf_counter() - t0
    t0, c0 = time.perf_counter(), time.process_time()
    result = run.run()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    iterations = sum(i.num_iterations_run for i in run.cluster.by_id.values())
    print(f"policy {args.policy}; {len(run.cluster.by_id)} instances; {args.duration:.0f} s of arrivals, "
          f"{run.loop.now_s:.0f} s simulated (drained)")
    print(f"setup {setup_s:.1f} s; run {wall:.1f} s wall, {cpu:.1f} s CPU; {iterations} iterations "
          f"= {iterations / wall:,.0f} per wall-second, {iterations / cpu:,.0f} per CPU-second")
    print(f"calls {result.metrics['calls']:.0f}, switch calls {result.metrics['switch_calls']:.0f}, "
          f"normal SLO {result.metrics['normal_slo_attainment']:.3f}")


if __name__ == "__main__":
    main()
