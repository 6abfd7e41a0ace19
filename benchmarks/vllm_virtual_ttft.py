"""Routed-call TTFT with and without shadow load, on vLLM's own scheduler at
GPU speed (virtual time, no GPU).

Not a test: it prints figures and the issue's TTFT target (routed-call TTFT
under shadow load within 1.1x of no-shadow) for agent sessions and normal
traffic as a serving cluster sees them: calls and normal requests arrive at
any time, including in the middle of an iteration (they then wait for it to
end), and normal traffic keeps the engines busy between calls.

``benchmarks/vllm_shadow.py`` measures the same target on the real vLLM CPU
engine with a tiny model, where a step is ~3.5 ms of Python and one-thread
compute and a call's TTFT after any large step (shadow or normal) is ~1.2x
that on an idle engine (the CPU's state; its control shows it). Here the
batches are timed by the simulator's latency model of an H100 instead
(``shadow_sim.latency.latency_model``, Vidur tables from the offline profiles
by default), and every scheduling decision is still vLLM's
(:mod:`shadow_vllm.virtual`: vLLM's real ``Scheduler`` and KV cache manager,
fake sampled tokens, a virtual clock).

Three arms per seed, the same scenario (the fake backend's draws: sessions of
``--calls`` calls whose model switches with ``--switch-probability``, Poisson
normal traffic on every instance):

* **no shadow**: vLLM's stock ``Scheduler`` (no subclass), no shadow requests;
* **engine-level**: :class:`shadow_vllm.scheduler.ShadowScheduler` with
  ``--policy`` (default ``harvest-slo``), the router side's jobs sent as tagged
  shadow requests (:class:`shadow_vllm.virtual.TaggedShadowFeeder`, woken at
  once, as a gateway's shadow request reaches an idle engine);
* **request-level** (Appendix D.1, the paper's prototype): stock ``Scheduler``
  with priority scheduling; after each call completes, its prompt and output
  go to the other model's instance as a lowest-priority request with one
  output token (:class:`shadow_gateway.request_level.RequestLevelShadower`:
  newest per session, one in flight per instance, sent only when that
  instance's waiting queue is empty). Its pending shadow of a session is
  dropped when that session's next call is seen on the instance (at the
  call's first token: the feeder runs on router-side events).

Calls are paired across the arms by (session, call index), normal requests by
id. The verdict is on **same-model routed calls** (no switch: shadow work
cannot help them, only slow them); switch calls (which shadows speed up) and
normal requests are reported beside them. The ratio is of means (the mean is
what a wait behind a shadow-only step moves; medians barely notice), with a
95% bootstrap interval (calls resampled in pairs, per seed pooled); ``MET``
needs the ratio and the interval's upper end within the target.

Run from the project root in the vLLM venv (one to two and a half minutes per seed for the three arms)::

    /work/venv_vllm/bin/python benchmarks/vllm_virtual_ttft.py
    /work/venv_vllm/bin/python benchmarks/vllm_virtual_ttft.py --seeds 0,1,2,3 --latency roofline
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from shadowcore.config import PluginRef, parse_ref
from shadowcore.errors import ConfigError

TTFT_TARGET = 1.1


def build_scenario(args: argparse.Namespace, seed: int) -> Any:
    from shadowcore.engine.scenario import FakeScenario

    return FakeScenario(
        models=tuple(args.models), latency_scale=(1.0,) * len(args.models), instances_per_model=1,
        duration_s=args.duration, warmup_s=0.0, session_rate_per_s=args.session_rate, calls_per_session=args.calls,
        switch_probability=args.switch_probability, input_tokens_median=args.input_tokens,
        output_tokens_median=args.output_tokens, normal_rate_per_s=args.normal_rate,
        normal_prompt_median=args.normal_prompt, normal_output_median=args.normal_output,
        num_blocks=args.num_blocks, block_size=16, token_budget=args.budget, seed=seed,
    )


ARMS = ("no shadow", "engine-level", "request-level")


def host_tier(args: argparse.Namespace, model: str, num_blocks: int, block_size: int) -> dict[str, Any]:
    """``VirtualEngineConfig`` fields of the host tier (``--host-tier``): vLLM's ``OffloadingConnector``
    with ``--host-blocks-per-device-block`` x the device pool of host memory, and a fake transfer worker
    as fast in tokens per second as ``--pcie-bytes-per-s`` is for ``model``'s real KV (the virtual
    engine's KV spec is a tiny stand-in: one layer, 2 KV heads x 32, fp32)."""
    if not args.host_tier:
        return {}
    from shadow_sim.models import get_model

    virtual_bytes_per_token = 2 * 2 * 32 * 4  # K and V x 2 KV heads x head_dim 32 x fp32, one layer
    tokens_per_s = args.pcie_bytes_per_s / get_model(model).kv_bytes_per_token()
    return {"kv_offloading_bytes": int(args.host_blocks_per_device_block * num_blocks * block_size
                                       * virtual_bytes_per_token),
            "kv_transfer_bytes_per_s": tokens_per_s * virtual_bytes_per_token}


def run_arm(args: argparse.Namespace, seed: int, latency: dict[str, Any], arm: str) -> Any:
    """One virtual run of ``arm`` (one of :data:`ARMS`)."""
    from shadow_vllm import virtual
    from shadow_vllm.scheduler import ShadowScheduler

    from shadowcore.config import PluginRef, ShadowConfig
    from shadowcore.latency import BatchShape

    shadow = arm == "engine-level"
    sc = build_scenario(args, seed)
    config = ShadowConfig(PluginRef(args.policy, args.policy_kwargs) if shadow else PluginRef("no-shadow", {}))
    engine_config = {}
    for m in sc.models:
        extra = {}
        if shadow:  # the engine rebuilds the policy, the SLOs (the paper's rule) and the same latency model
            tpot = max(sc.slo.tpot_s, 5 * latency[m].predict_s(BatchShape((), (sc.input_tokens_median,))))
            extra = {"shadowprefill": {
                "shadow": json.loads(config.to_json()),
                "slo": {"ttft_s": sc.slo.ttft_s, "tpot_s": tpot},
                "latency": {"name": "shadow_sim.latency:latency_model", "args": {"name": m, "kind": args.latency}},
            }}
        engine_config[m] = virtual.VirtualEngineConfig(
            block_size=sc.block_size, num_blocks=sc.num_blocks + 1, max_num_batched_tokens=sc.token_budget,
            max_num_seqs=256, scheduling_policy="priority" if arm == "request-level" else "fcfs",
            additional_config=extra, **host_tier(args, m, sc.num_blocks, sc.block_size))
    from shadow_vllm.effects import RequestLevelFeeder

    feeder = virtual.TaggedShadowFeeder(wake=True) if shadow else RequestLevelFeeder() if arm == "request-level" \
        else None
    run = virtual.VirtualScenarioRun(sc, config, latency, engine_config,
                                     scheduler_cls=ShadowScheduler if shadow else None, shadow_feeder=feeder)
    return run.run()


CLASSES = ("same-model routed calls", "switch calls", "normal requests")


def collect(run: Any) -> dict[str, dict[Any, float]]:
    """TTFT by key: same-model calls, switch calls (keyed by session and index), normal requests (by id)."""
    out: dict[str, dict[Any, float]] = {c: {} for c in CLASSES}
    for c in run.calls:
        out["switch calls" if c.is_switch else "same-model routed calls"][(c.session_id, c.call_index)] = c.ttft_s
    for r in run.normal:
        if r.ttft_s is not None:
            out["normal requests"][r.request_id] = r.ttft_s
    return out


def _is_shadow(request_id: str) -> bool:
    return request_id.startswith(("shadow:", "shadow-"))  # engine-level (TaggedShadowFeeder), request-level


def shadow_work(run: Any) -> tuple[int, int]:
    """(shadow prompt tokens computed, shadow-only iterations) over the run's engines."""
    tokens = steps = 0
    for engine in run.cluster.by_id.values():
        for step in engine.steps:
            shadow = sum(r.num_scheduled_tokens for r in step.batch if _is_shadow(r.request_id))
            tokens += shadow
            steps += bool(step.batch) and shadow == sum(r.num_scheduled_tokens for r in step.batch)
    return tokens, steps


def bootstrap_mean_ratio(loaded: np.ndarray, base: np.ndarray, reps: int = 4000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of mean(loaded) / mean(base), pairs resampled together."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(loaded), size=(reps, len(loaded)))
    ratios = loaded[idx].mean(axis=1) / base[idx].mean(axis=1)
    lo, hi = np.quantile(ratios, [0.025, 0.975])
    return float(lo), float(hi)


def report(pairs: dict[str, dict[str, list[tuple[float, float]]]]) -> bool:
    """``pairs[arm][class]``: (no-shadow TTFT, the arm's TTFT) per call or request."""
    print(f"\n{'TTFT, ms':24s} {'arm':14s} {'n':>5s} {'no shadow':>9s} {'with':>9s} {'mean ratio':>10s} "
          f"{'95% CI':>16s} {'median':>7s} {'p90':>7s}")
    met = False
    for name in CLASSES:
        for arm in ARMS[1:]:
            rows = pairs[arm][name]
            if not rows:
                print(f"{name:24s} {arm:14s} {0:5d}")
                continue
            base = np.array([b for b, _ in rows])
            loaded = np.array([s for _, s in rows])
            ratio = loaded.mean() / base.mean()
            lo, hi = bootstrap_mean_ratio(loaded, base)
            med = float(np.median(loaded) / np.median(base))
            p90 = float(np.quantile(loaded, 0.9) / np.quantile(base, 0.9))
            verdict = ""
            if name == CLASSES[0]:
                ok = ratio <= TTFT_TARGET and hi <= TTFT_TARGET
                verdict = f"  target <= {TTFT_TARGET}x: " + ("MET" if ok else "NOT MET" if ratio > TTFT_TARGET
                                                              else "UNDECIDED")
                met = ok if arm == "engine-level" else met
            print(f"{name:24s} {arm:14s} {len(rows):5d} {base.mean() * 1e3:9.1f} {loaded.mean() * 1e3:9.1f} "
                  f"{ratio:9.3f}x [{lo:6.3f}, {hi:6.3f}] {med:6.3f}x {p90:6.3f}x{verdict}")
    print("(TTFT means in ms; ratios: the arm over no shadow, the same calls; median and p90: ratios of quantiles)")
    return met


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2", help="comma-separated scenario seeds")
    p.add_argument("--models", nargs=2, default=["Qwen2.5-7B", "Llama-3.1-8B"])
    p.add_argument("--latency", default="vidur", choices=("vidur", "roofline"),
                   help="the simulator's H100 latency model timing each batch")
    p.add_argument("--policy", default="harvest-slo", metavar="NAME[:JSON]",
                   help='shadow policy of the engine-level arm, with arguments if any, e.g. \'harvest-slo:{"delta": 0}\'')
    p.add_argument("--policy-args", default=None, help="its arguments as JSON (older spelling; not both)")
    p.add_argument("--duration", type=float, default=240.0, help="simulated seconds of arrivals")
    p.add_argument("--session-rate", type=float, default=0.2, help="agent sessions per second")
    p.add_argument("--calls", type=int, default=6, help="calls per session")
    p.add_argument("--switch-probability", type=float, default=0.3)
    p.add_argument("--input-tokens", type=int, default=1500, help="median new input per call")
    p.add_argument("--output-tokens", type=int, default=120, help="median output per call")
    p.add_argument("--normal-rate", type=float, default=2.0, help="normal requests per second per instance")
    p.add_argument("--normal-prompt", type=int, default=800)
    p.add_argument("--normal-output", type=int, default=150)
    p.add_argument("--num-blocks", type=int, default=8192, help="KV blocks of 16 tokens per instance")
    p.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    p.add_argument("--host-tier", action="store_true",
                   help="every arm's engines get vLLM's CPU KV offloading (OffloadingConnector, scheduler side "
                        "real, transfers faked on the virtual clock); use a *-host --policy")
    p.add_argument("--host-blocks-per-device-block", type=float, default=4.0, help="host tier size")
    p.add_argument("--pcie-bytes-per-s", type=float, default=25e9, help="host link of the real model's KV")
    args = p.parse_args(argv)
    try:
        args.seed_list = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        p.error(f"--seeds: {args.seeds!r} is not a comma-separated list of integers")
    try:
        ref = parse_ref(args.policy, "--policy")
        if args.policy_args is not None:
            if ref.args:
                raise ConfigError("--policy-args", args.policy_args, "--policy already gives the arguments")
            ref = PluginRef.parse("--policy-args", {"name": ref.name, "args": json.loads(args.policy_args)})
    except json.JSONDecodeError as e:
        p.error(f"--policy-args: not JSON ({e})")
    except ConfigError as e:
        p.error(str(e))
    args.policy, args.policy_kwargs = ref.name, dict(ref.args)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    from shadow_sim.latency import latency_model

    args = parse_args(argv)
    latency = {m: latency_model(m, kind=args.latency) for m in args.models}
    print(f"vLLM scheduler in virtual time, {args.latency} latency of {' and '.join(args.models)} on H100-80GB, "
          f"one instance each; {args.duration:.0f} s of arrivals: {args.session_rate}/s sessions x {args.calls} "
          f"calls (switch p={args.switch_probability}), {args.normal_rate}/s normal requests per instance; "
          f"engine-level policy {args.policy} {args.policy_kwargs}; "
          f"{'host tier (OffloadingConnector) on every arm; ' if args.host_tier else ''}seeds {args.seed_list}")
    pairs: dict[str, dict[str, list[tuple[float, float]]]] = {arm: {c: [] for c in CLASSES} for arm in ARMS}
    for seed in args.seed_list:
        t0 = time.perf_counter()
        runs = {arm: run_arm(args, seed, latency, arm) for arm in ARMS}
        ttft = {arm: collect(run) for arm, run in runs.items()}
        base = ttft["no shadow"]
        for arm in ARMS[1:]:
            for name, by_key in base.items():
                rows = [(t, ttft[arm][name][k]) for k, t in by_key.items() if k in ttft[arm][name]]
                if len(rows) < len(by_key):
                    print(f"  seed {seed}, {arm}: {len(by_key) - len(rows)} {name} did not finish (left out)")
                pairs[arm][name].extend(rows)
        work = {arm: shadow_work(runs[arm]) for arm in ARMS[1:]}
        print(f"seed {seed}: {len(base[CLASSES[0]])} same-model calls, {len(base[CLASSES[1]])} switch calls, "
              f"{len(base[CLASSES[2]])} normal requests; shadow tokens (shadow-only iterations): "
              + ", ".join(f"{arm} {t} ({n})" for arm, (t, n) in work.items())
              + f"; {time.perf_counter() - t0:.0f} s wall", flush=True)
    met = report(pairs)
    print(f"\nengine-level TTFT target (virtual time, {args.latency} H100): {'MET' if met else 'NOT met'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
