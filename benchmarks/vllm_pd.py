"""The simulator's P/D finding, measured on vLLM virtual time side by side.

The simulator found that shadow pushes rarely shrink switch-call transfers on
a P/D cluster: decode pools fill with the normal traffic's prefix cache, and
pushed shadow KV (reclaim-first) is evicted before the switch. This script runs
one seeded P/D scenario (small pools, so that D pools fill within a short run)
through the simulator's ``PDRun`` and through vLLM virtual time
(``shadow_vllm.virtual.pd``: the real vLLM scheduler, the P/D shadow
schedulers, the real ``NixlConnector`` scheduler side, a fake link), for No
Shadow and Harvest-SLO (and the simulator's Oracle), and prints per policy:
the mean KV transfer of a measured switch call, pushed and dropped tokens,
pushed blocks D later served to a call (promoted) and pushed blocks D evicted.

    python benchmarks/vllm_pd.py [--duration 120] [--memory 0.3] [--json out.json]

Both runs use the same workload (the simulator's, played again), pools, budgets,
SLOs and H100 roofline latency; reads are charged by their tokens as the
simulator charges transfers.
"""

from __future__ import annotations

import argparse
import json
import time

MODELS = ("Qwen2.5-7B", "Llama-3.1-8B")


def scenario(duration_s: float, memory: float, seed: int) -> dict:
    return {
        "models": MODELS, "latency": "roofline", "duration_s": duration_s, "warmup_s": duration_s / 4,
        "session_rate_per_s": 0.1, "calls_per_session": 8, "switch_probability": 0.4, "input_tokens_median": 1500,
        "output_tokens_median": 100, "normal_rate_per_s": 1.0, "normal_prompt_median": 1000,
        "normal_output_median": 100, "memory_utilization": memory, "seed": seed,
        "pd": {"num_prefill": 2, "num_decode": 1, "link_bytes_per_s": 50e9},
    }


def _sim_only(sc: dict, policy: str) -> dict:
    from shadow_sim.disagg import PDRun
    from shadow_sim.simulator import SimScenario

    from shadowcore.config import PluginRef, ShadowConfig

    run = PDRun(SimScenario.from_dict(sc), ShadowConfig(PluginRef(policy)))
    m = run.run().metrics
    return {"switch_transfer_MB": m["switch_transfer_bytes"] / 1e6, "switch_calls": m.get("switch_calls")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--memory", type=float, default=0.3, help="SimScenario.memory_utilization (pool size)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    from shadow_vllm.virtual import pd_compare

    from shadowcore.kv import KVClass

    sc = scenario(args.duration, args.memory, args.seed)
    rows = {}
    for policy in ("no-shadow", "harvest-slo"):
        t0 = time.perf_counter()
        sim = pd_compare.sim_run(sc, policy)
        vrun = pd_compare.virtual_run(sim)
        side = pd_compare.summary(sim, vrun, warmup_s=sc["warmup_s"])
        bs = sim.scenario.block_size
        ds = [e for es in vrun.decode.values() for e in es]
        side["vllm_virtual"]["pushed_tokens_used"] = float(sum(e.scheduler.shadow_bridge.num_promoted_blocks
                                                               for e in ds) * bs)
        side["vllm_virtual"]["pushed_tokens_evicted"] = float(sum(
            e.scheduler.shadow_bridge.num_evicted_blocks[KVClass.SHADOW] for e in ds) * bs)
        s = sim.summary()
        side["simulator"]["pushed_tokens_used"] = s["pushed_tokens_used"]
        side["simulator"]["pushed_tokens_evicted"] = float(sum(
            d.kv.num_evicted_blocks[KVClass.SHADOW] for dd in sim.cluster.decode.values() for d in dd) * bs)
        side["pools_blocks"] = {i.instance_id: i.kv.num_blocks for i in sim.cluster.by_id.values()}
        rows[policy] = side
        print(f"{policy}: {time.perf_counter() - t0:.0f} s", flush=True)
    rows["oracle (simulator)"] = {"simulator": _sim_only(sc, "oracle")}
    print(f"\nP/D, {args.duration:.0f} s, memory_utilization {args.memory}, seed {args.seed} "
          f"(measured switch calls after {sc['warmup_s']:.0f} s)\n")
    keys = ("switch_calls", "switch_transfer_MB", "pushed_tokens", "pushed_tokens_dropped", "pushed_tokens_used",
            "pushed_tokens_evicted")
    print("| policy | engine | " + " | ".join(keys) + " |")
    print("|---|---|" + "---:|" * len(keys))
    for policy, side in rows.items():
        for engine in ("simulator", "vllm_virtual"):
            if engine in side:
                vals = [side[engine].get(k, float("nan")) for k in keys]
                print(f"| {policy} | {engine} | " + " | ".join(f"{v:.1f}" if isinstance(v, float) else str(v)
                                                            for v in vals) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
