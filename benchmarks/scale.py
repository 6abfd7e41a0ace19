"""The simulator at real load: the embedded default's cluster for a simulated
hour, grown in instances and in load, each run in a fresh process.

    python benchmarks/scale.py                         # the whole table (long: hours at 128 instances)
    python benchmarks/scale.py --duration 300 --instances 8,32 --rhos 0.7
    python benchmarks/scale.py --duration 120 --instances 8,32 --rhos 0.7 --seeds 0,1,2
    python benchmarks/scale.py --policies no-shadow --instances 8 --rhos 0.3,0.7,0.9

Each run is the embedded default experiment of ``shadowprefill simulate``
(FusionBench-like sessions on Qwen2.5-7B / Llama-3.1-70B, Vidur latency,
Azure-like Poisson normal traffic at ``rho`` of each instance's shipped or
cached calibrated capacity) with ``--duration`` seconds of arrivals after the
default warm-up, ``instances`` in total (half per model) and the session rate
scaled with the instance count (per-instance load unchanged). The instance
axis runs at rho 0.7, the load axis at the first instance count.

The sessions are one draw per seed, and a draw varies: at seed 0 the
8-instance cluster gets 12 sessions with 93 routed calls (18 sessions are
expected), the 32-instance one 70 with 841, so one seed's "32 instances cost
6x" is partly a 9x larger routed workload. ``--seeds 0,1,2`` runs each point
once per seed and the growth lines compare the seeds' means (per seed: CPU
time and workload); each growth line prints the workload's growth beside the
cost's. The smallest cluster, the reference of every growth line, draws the
least work, so its draw varies the most: it runs ``--ref-seeds`` seeds (by
default the largest count over the smallest, 16 for 8 and 128: as many
instances simulated in all as the largest point has), ``--seeds`` first and
then the next integers. The largest point's expected workload is then
exactly the reference's summed one, and "128 instances at most 16x" compares
equal expected work, not one small draw against one large one.

Printed per run: wall and CPU seconds of the run loop (setup excluded, shown
apart), engine iterations, iterations per CPU-second, simulated seconds per
wall-second, the process's peak RSS; then how cost grows with instances and
load, and the issue's targets beside the measured values (issue 17):

* one simulated hour of the 8-instance cluster at rho 0.7 in <= 30 CPU-seconds
  per policy (the run's CPU time scaled linearly from its simulated seconds,
  warm-up and drain included, to 3,600: printed with the figure);
* 128 instances at most 16x the 8-instance time (cost linear in instances);
* cost per iteration flat in batch size: judged where only the batch grows
  (``benchmarks/batch_cost.py``, run in a child: 16 to 256 decodes, one
  admission, one prefill chunk and one finish per iteration), MET when the
  largest batch's cost is within ``FLAT_TOLERANCE`` (1.2x) of the smallest's.
  The load axis prints the same ratio for information (mean decodes per
  iteration against CPU microseconds per iteration at each rho): there the
  load also raises the admissions and finishes per iteration, which are
  per-request work by design (issue 17: per-request work at admission, chunk
  boundaries, preemption and completion only), so its cost follows the
  requests, not the batch.

Our ratio to Vidur at this per-instance load (Vidur simulates one instance)
is ``benchmarks/sim_vs_vidur.py``'s, which runs both simulators side by side
at the trace's rate and at ``--rho 0.7`` of the model's shipped capacity;
``--vidur`` runs it here (Vidur's metrics off, one interleaved run each) and
prints its target lines with the others (needs the ``sim`` extra and the
Azure conversation trace, ``--vidur-trace``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import subprocess
import sys
import time

HOUR_S = 3600.0


def one_run(policy: str, instances: int, rho: float, duration_s: float, seed: int) -> dict:
    """Run in this process; return the figures."""
    from shadow_sim.experiments.calibrate import capacities
    from shadow_sim.experiments.spec import SIMULATE_DEFAULT, Experiment, ExperimentRun

    from shadowcore.config import PluginRef, ShadowConfig

    if instances % 2:
        raise SystemExit("scale: --instances must be even (half per model)")
    base = dict(SIMULATE_DEFAULT)
    per_model = instances // 2
    data = {**base, "instances_per_model": per_model, "duration_s": duration_s,
            "session_rate_per_s": base["session_rate_per_s"] * per_model / base["instances_per_model"],
            "normal": {**base["normal"], "rho": rho}}
    t0 = time.perf_counter()
    ex = Experiment.from_dict(data)
    probe = Experiment.from_dict(base)  # capacities are per instance: the shipped ones of the default
    caps = {m: c.capacity_per_s for m, c in capacities(probe, progress=False).items()}
    run = ExperimentRun(ex.sim_scenario(seed), ShadowConfig(PluginRef(policy), seed=seed), experiment=ex,
                        capacity=caps)
    setup_s = time.perf_counter() - t0
    t0, c0 = time.perf_counter(), time.process_time()
    result = run.run()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    iterations = sum(i.num_iterations_run for i in run.cluster.by_id.values())
    decoded = sum(r.num_output_tokens for r in run.workload.normal) + sum(
        c.num_output_tokens for p in run.workload.sessions for c in p.calls)
    return {"policy": policy, "instances": instances, "rho": rho, "duration_s": duration_s, "setup_s": setup_s,
            "wall_s": wall, "cpu_s": cpu, "iterations": iterations, "simulated_s": run.loop.now_s,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "calls": result.metrics["calls"], "normal_slo": result.metrics["normal_slo_attainment"],
            "mean_batch": decoded / max(1, iterations), "seed": seed,
            "sessions": len(run.workload.sessions),
            "routed_calls": sum(len(p.calls) for p in run.workload.sessions),
            "normal_requests": len(run.workload.normal)}


def in_child(policy: str, instances: int, rho: float, duration_s: float, seed: int) -> dict:
    cmd = [sys.executable, __file__, "--child", json.dumps([policy, instances, rho, duration_s, seed])]
    out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy(), check=False)
    if out.returncode != 0:
        raise SystemExit(f"scale: run {policy} x {instances} at rho {rho} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    head = (f"{'policy':<18} {'inst':>5} {'rho':>4} {'seed':>4} {'sessions':>8} {'calls':>6} {'setup s':>8} "
            f"{'wall s':>8} {'CPU s':>8} {'iterations':>11} {'iter/CPU-s':>11} {'us/iter':>8} {'batch':>6} "
            f"{'sim s/wall s':>12} {'peak MB':>8} {'normal SLO':>10}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['policy']:<18} {r['instances']:>5} {r['rho']:>4.1f} {r['seed']:>4} {r['sessions']:>8} "
                     f"{r['routed_calls']:>6} {r['setup_s']:>8.1f} {r['wall_s']:>8.1f} "
                     f"{r['cpu_s']:>8.1f} {r['iterations']:>11,} {r['iterations'] / r['cpu_s']:>11,.0f} "
                     f"{1e6 * r['cpu_s'] / r['iterations']:>8.1f} {r['mean_batch']:>6.1f} "
                     f"{r['simulated_s'] / r['wall_s']:>12.1f} {r['peak_rss_mb']:>8.0f} {r['normal_slo']:>10.3f}")
    lines.append("sessions, calls: the run's agent sessions and their routed calls (warm-up and drain included); "
                 "us/iter: CPU microseconds per engine iteration; batch: mean decodes per iteration "
                 "(output tokens / iterations)")
    return "\n".join(lines)


def pooled(rows: list[dict]) -> list[dict]:
    """One row per (policy, instances, rho): the seeds' runs summed (``mean_batch`` weighted by iterations),
    so the growth lines compare whole workloads, not one draw of each (a draw's sessions and routed calls
    vary by tens of percent: seed 0's 8-instance workload has 93 routed calls, its 32-instance one 841)."""
    out: dict[tuple, dict] = {}
    for r in rows:
        key = (r["policy"], r["instances"], r["rho"])
        if key not in out:
            out[key] = {**r, "seeds": 1}
            continue
        p = out[key]
        batch = (p["mean_batch"] * p["iterations"] + r["mean_batch"] * r["iterations"]) / max(
            1, p["iterations"] + r["iterations"])
        for k in POOLED:
            p[k] += r[k]
        p["mean_batch"], p["seeds"] = batch, p["seeds"] + 1
    return list(out.values())


#: The figures :func:`pooled` sums over seeds (a per-seed mean is the sum over ``seeds``).
POOLED = ("setup_s", "wall_s", "cpu_s", "iterations", "simulated_s", "sessions", "routed_calls", "normal_requests")


def _per_seed(r: dict, k: str) -> float:
    """``r[k]`` of a :func:`pooled` row as the mean over its seeds."""
    return r[k] / r.get("seeds", 1)


def _grown(r: dict, ref: dict, k: str) -> float:
    """How much figure ``k`` grew from ``ref`` to ``r`` (:func:`pooled` rows): the ratio of per-seed means."""
    return _per_seed(r, k) / _per_seed(ref, k)


def growth(rows: list[dict], first: int) -> list[str]:
    """The growth lines, from :func:`pooled` rows."""
    out = []
    for policy in dict.fromkeys(r["policy"] for r in rows):
        mine = [r for r in rows if r["policy"] == policy]
        ref = next((r for r in mine if r["instances"] == first and r["rho"] == 0.7), None)
        if ref is None:
            continue
        hour = ref["cpu_s"] * HOUR_S / ref["simulated_s"]
        scaled = f" (from {ref['simulated_s']:.0f} simulated s incl. warm-up and drain, scaled linearly)"
        seeds = f" ({ref['seeds']} seeds pooled)" if ref.get("seeds", 1) > 1 else ""
        out.append(f"{policy}{seeds}: one simulated hour of {first} instances at rho 0.7: {hour:.0f} CPU-s{scaled} "
                   f"[target <= 30: {'MET' if hour <= 30 else 'NOT MET'}]")
        for r in mine:
            if r is ref:
                continue
            if r["rho"] == 0.7:
                k = r["instances"] / first
                x = _grown(r, ref, "cpu_s")
                verdict = f" [target <= 16x: {'MET' if x <= 16 else 'NOT MET'}]" if r["instances"] == 16 * first else ""
                means = (f" (means: {r.get('seeds', 1)} seed(s) against {ref.get('seeds', 1)})"
                         if r.get("seeds", 1) != ref.get("seeds", 1) else "")
                work = (f"; the workload: {_grown(r, ref, 'routed_calls'):.1f}x the routed calls, "
                        f"{_grown(r, ref, 'normal_requests'):.1f}x the normal requests, "
                        f"{_grown(r, ref, 'iterations'):.1f}x the iterations")
                out.append(f"  {r['instances']} instances ({k:.0f}x): {x:.1f}x the CPU time, "
                           f"{x / k:.2f}x per instance{verdict}{work}{means}")
            elif r["instances"] == first:
                out.append(f"  rho {r['rho']:.1f}: {_grown(r, ref, 'cpu_s'):.2f}x the CPU time, "
                           f"{r['iterations'] / r['cpu_s'] / (ref['iterations'] / ref['cpu_s']):.2f}x the "
                           "iterations per CPU-second")
        out.extend(batch_lines([r for r in mine if r["instances"] == first]))
        out.extend(above_baseline(ref, rows, first))
        out.append(f"  per instance at rho 0.7: {ref['iterations'] / ref['cpu_s'] / first:,.0f} iterations per CPU-second "
                   f"of one instance's share (Vidur runs one instance: benchmarks/sim_vs_vidur.py --rho 0.7 prints "
                   f"our ratio to it at this per-instance load [target >= 30x])")
    return out


def above_baseline(ref: dict, rows: list[dict], first: int) -> list[str]:
    """What a shadow policy's reference point costs above no-shadow's on the same draws, per routed call, beside
    what the hour target leaves for it (nothing when ``ref`` is no-shadow's, or no-shadow has no such point or
    ran other seeds: the draws must be the same for the difference to be the shadow work's)."""
    base = next((r for r in rows if r["policy"] == "no-shadow" and r["instances"] == first and r["rho"] == 0.7), None)
    if ref["policy"] == "no-shadow" or base is None or base.get("seeds", 1) != ref.get("seeds", 1) \
            or base["routed_calls"] != ref["routed_calls"]:
        return []
    extra_ms = 1e3 * (ref["cpu_s"] - base["cpu_s"]) / ref["routed_calls"]
    left_ms = 1e3 * (30.0 * ref["simulated_s"] / HOUR_S - base["cpu_s"]) / ref["routed_calls"]
    return [(f"  above no-shadow on the same draws: {extra_ms:.1f} CPU-ms per routed call "
             f"({ref['routed_calls']:,} calls); the hour target leaves {left_ms:.1f} ms per call above no-shadow's")]


#: "Flat in batch size": the cost per iteration at the largest mean batch of the load axis within this factor of
#: the cost at the smallest (run-to-run spread on the shared machine is about 10%).
FLAT_TOLERANCE = 1.2


def batch_lines(loads: list[dict]) -> list[str]:
    """Cost per iteration against mean batch size along the load axis (one instance count, :func:`pooled` rows),
    with issue 17's "flat in batch size" verdict; nothing with fewer than two loads."""
    loads = sorted(loads, key=lambda r: r["mean_batch"])
    if len(loads) < 2:
        return []
    us = [1e6 * r["cpu_s"] / r["iterations"] for r in loads]
    points = "; ".join(f"rho {r['rho']:.1f}: batch {r['mean_batch']:.1f}, {u:.1f} us, "
                       f"{1e3 * (r['normal_requests'] + r['routed_calls']) / r['iterations']:.1f} requests per "
                       "1,000 iterations" for r, u in zip(loads, us))
    x = us[-1] / us[0]
    head = (f"  cost per iteration against mean batch along the load axis ({points}): {x:.2f}x the cost for "
            f"{loads[-1]['mean_batch'] / loads[0]['mean_batch']:.1f}x the batch (for information: the requests "
            "per iteration grow with it, and each one's admission and finish are per-request work)")
    return [head, flat_target()]


def flat_target() -> str:
    """Issue 17's "flat in batch size" line: ``benchmarks/batch_cost.py`` in a child (only the batch grows)."""
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, os.path.join(here, "batch_cost.py"), "--json"], capture_output=True,
                         text=True, env=os.environ.copy(), check=False)
    if out.returncode != 0:
        return "  batch_cost.py did not run: " + " | ".join((out.stdout + out.stderr).strip().splitlines()[-3:])
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    (b0, u0), (b1, u1) = rows[0], rows[-1]
    x = u1 / u0
    return ("  cost per iteration with only the batch growing (benchmarks/batch_cost.py: "
            + ", ".join(f"{b} decodes {u:.1f} us" for b, u in rows)
            + f"): {x:.2f}x the cost for {b1 / b0:.0f}x the batch [target: flat in batch size, within "
            f"{FLAT_TOLERANCE:.1f}x: {'MET' if x <= FLAT_TOLERANCE else 'NOT MET'}]")


def vidur_targets(trace: str | None) -> list[str]:
    """``benchmarks/sim_vs_vidur.py``'s issue-17 target lines (Vidur's metrics
    off, at the trace's rate and at rho 0.7 per instance), run in a child."""
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [sys.executable, os.path.join(here, "sim_vs_vidur.py"), "--vidur-metrics", "off", "--repeat", "1",
           "--rho", "0.7"] + (["--trace", trace] if trace else [])
    out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy(), check=False)
    if out.returncode != 0:
        tail = (out.stdout + out.stderr).strip().splitlines()[-3:]
        return ["Vidur comparison did not run (benchmarks/sim_vs_vidur.py): " + " | ".join(tail)]
    lines = out.stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("targets (issue 17)")), None)
    if start is None:
        return ["Vidur comparison printed no targets (benchmarks/sim_vs_vidur.py)"]
    return ["Vidur (benchmarks/sim_vs_vidur.py, one instance): " + lines[start]] + [
        line for line in lines[start + 1:] if line.startswith("  ")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--policies", default="no-shadow,harvest-slo-host")
    ap.add_argument("--instances", default="8,32,128", help="instance counts at rho 0.7 (even numbers)")
    ap.add_argument("--rhos", default="0.3,0.7,0.9", help="loads at the first instance count")
    ap.add_argument("--duration", type=float, default=HOUR_S, help="seconds of arrivals after the warm-up")
    ap.add_argument("--seeds", default="0", help="seeds (comma-separated): each point runs once per seed and "
                                                   "the growth lines pool them")
    ap.add_argument("--ref-seeds", type=int, default=None,
                    help="seeds of the reference point (the first instance count at rho 0.7): --seeds, then the "
                         "next integers (default: the largest instance count over the first, at least "
                         "len(--seeds))")
    ap.add_argument("--vidur", action="store_true",
                    help="also run benchmarks/sim_vs_vidur.py (metrics off, rho 0.7) and print its target lines")
    ap.add_argument("--vidur-trace", default=None, help="the Azure conversation trace for --vidur "
                                                       "(default: sim_vs_vidur.py's)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(one_run(*json.loads(a.child))))
        return 0
    policies = [p.strip() for p in a.policies.split(",") if p.strip()]
    counts = [int(x) for x in a.instances.split(",")]
    rhos = [float(x) for x in a.rhos.split(",")]
    seeds = [int(x) for x in a.seeds.split(",")]
    grid = [(p, n, 0.7) for p in policies for n in counts]
    grid += [(p, counts[0], r) for p in policies for r in rhos if r != 0.7]
    num_ref = max(len(seeds), max(counts) // counts[0] if a.ref_seeds is None else a.ref_seeds)
    ref_seeds = seeds + list(itertools.islice((s for s in itertools.count(max(seeds) + 1) if s not in seeds),
                                              num_ref - len(seeds)))
    runs = [(p, n, r, seed) for seed in seeds for p, n, r in grid]
    runs += [(p, counts[0], 0.7, seed) for seed in ref_seeds[len(seeds):] for p in policies]
    rows = []
    for p, n, r, seed in runs:
        rows.append(in_child(p, n, r, a.duration, seed))
        print(f"done: {p} x {n} instances at rho {r}, seed {seed} in {rows[-1]['wall_s']:.1f} s",
              file=sys.stderr, flush=True)
    rows.sort(key=lambda r: (policies.index(r["policy"]), r["rho"] != 0.7, r["instances"], r["rho"], r["seed"]))
    print(table(rows))
    print("\n".join(growth(pooled(rows), counts[0])))
    if a.vidur:
        print("\n".join(vidur_targets(a.vidur_trace)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
