"""What ``shadowprefill reproduce`` (the full grid) costs on Ray: a few of its
tasks measured on a local Ray cluster, the rest extrapolated.

    python benchmarks/grid_cost.py                       # 4 tasks on ray.init(num_cpus=2)
    python benchmarks/grid_cost.py --policies no-shadow,harvest-slo-host --num-cpus 2

The full grid is ``shadow_sim.experiments.reproduce.studies(quick=False)``
with 3 seeds x 3 windows per study and policy. Measured: tasks of its main
study (Q7/L70, the paper's setting: 4 instances per model, 600 s measured
after 120 s warm-up, 120 s drain), seed 0, the peak window, one per policy,
run through the same Ray path as ``reproduce --ray`` (tables shipped through
the object store, ``shadow_sim.experiments.distributed``), each timed inside
its worker (wall and CPU seconds of ``run_task``). Printed: each task, the
batch's wall time on the local cluster, and the grid's cost extrapolated
from the measured mean CPU seconds per task (every task taken to cost the
mean; the N-model study has up to 10 instances, the load study rho up to 0.9,
so it is an estimate) to W workers of one core each: ceil(tasks / W) x mean,
as Ray hands tasks to free workers.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time


def _timed(task, tables) -> dict:
    """Ray task body: the grid's task as ``reproduce --ray`` runs it, timed in the worker."""
    from shadow_sim.experiments.distributed import _run_shipped

    t0, c0 = time.perf_counter(), time.process_time()
    rec = _run_shipped(task, tables)
    return {"policy": task.name, "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
            "simulated_s": rec.makespan_s, "calls": len(rec.calls), "pid": os.getpid()}


def grid_size() -> int:
    from shadow_sim.experiments.reproduce import studies

    return sum(len(policies) for *_, policies in studies(False)) * 3 * 3  # seeds x windows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default="no-shadow,harvest-slo-host,oracle-host,benefit-host")
    ap.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray cluster")
    ap.add_argument("--workers", default="4,64", help="worker counts to extrapolate to")
    a = ap.parse_args(argv)

    from shadow_sim.experiments.calibrate import capacities
    from shadow_sim.experiments.distributed import connect, latency_tables
    from shadow_sim.experiments.reproduce import studies
    from shadow_sim.experiments.runner import tasks_for
    from shadow_sim.experiments.spec import Experiment

    from shadowcore.config import PluginRef

    _, label, fields, _ = next(s for s in studies(False) if s[0] == "main")
    ex = Experiment.from_dict(fields)
    caps = {m: c.capacity_per_s for m, c in capacities(ex, progress=False).items()}
    tasks = tasks_for(ex, [PluginRef(p.strip()) for p in a.policies.split(",") if p.strip()], (0,), ("peak",),
                      caps, f"main:{label}")
    ray = connect("local", a.num_cpus)
    tables = ray.put(latency_tables(tasks))
    remote = ray.remote(max_retries=0)(_timed)
    t0 = time.perf_counter()
    rows = ray.get([remote.remote(t, tables) for t in tasks])
    batch_wall = time.perf_counter() - t0
    ray.shutdown()

    n = grid_size()
    print(f"full grid: {n} tasks (reproduce's studies x 3 seeds x 3 windows); measured {len(rows)} of its main study "
          f"({label}, {fields['instances_per_model']} instances per model, {ex.warmup_s:.0f} + "
          f"{ex.duration_s:.0f} + {ex.drain_s:.0f} s) on ray.init(num_cpus={a.num_cpus}), {os.cpu_count()} CPUs here")
    print(f"{'policy':<20} {'wall s':>8} {'CPU s':>8} {'simulated s':>12} {'calls':>6}")
    for r in rows:
        print(f"{r['policy']:<20} {r['wall_s']:>8.1f} {r['cpu_s']:>8.1f} {r['simulated_s']:>12.0f} {r['calls']:>6}")
    mean = statistics.fmean(r["cpu_s"] for r in rows)
    print(f"these {len(rows)} tasks on the local cluster: {batch_wall:.0f} s wall; mean {mean:.0f} CPU-s per task")
    print(f"EXTRAPOLATED (every task at the measured mean, one core per worker): full grid {n * mean / 3600:.1f} "
          "CPU-hours")
    for w in (int(x) for x in a.workers.split(",")):
        wall_s = math.ceil(n / w) * mean
        wall = f"{wall_s / 3600:.1f} h" if wall_s >= 3600 else f"{wall_s / 60:.1f} min"
        print(f"  {w:>3} workers: ~{wall} wall ({math.ceil(n / w)} tasks each)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
