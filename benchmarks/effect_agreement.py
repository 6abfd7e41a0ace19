"""Effect-level agreement, the full case (issue 16 item 6): one session file
plus one normal-traffic draw, one instance per model, through the simulator's
engine and through vLLM's scheduler in virtual time, with the same latency
model; for no-shadow, request-level, harvest-slo and benefit-host it prints
each engine's switch-call TTFT reduction, switch hit rate and same-model TTFT
ratio, the gap and whether it is within the tolerance (10% relative, 1 point,
0.03). ``tests/vllm/test_effect_agreement.py`` runs a small case of the same
harness (:mod:`shadow_vllm.effects`).

Not a test: it prints figures (and exits 1 when an arm misses). Without
``--sessions`` it writes a seeded session file (``shadow_vllm.effects.write_session_file``)
and replays it; ``--sessions FILE`` replays yours (a call CSV or a session-trace
file; its recorded models are mapped onto ``--models`` by order of first
appearance, and every call must fit vLLM's ``max_model_len`` of 32768).
``--engine-default-tails`` also runs the engine-level arms with the shadow
scheduler's default ``keep_tails_below_n_min: false`` (``docs/vllm.md``,
"Tails below n_min"), which this harness's feeder does not need, to show
what that default costs.

Run from the project root (a few minutes: most of it is vLLM's scheduler)::

    python benchmarks/effect_agreement.py
    python benchmarks/effect_agreement.py --latency vidur --duration 240 --engine-default-tails
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", default=None, help="a session file (call CSV or session trace); default: generated")
    p.add_argument("--num-sessions", type=int, default=48, help="sessions of the generated file")
    p.add_argument("--models", nargs=2, default=["Qwen2.5-7B", "Llama-3.1-8B"])
    p.add_argument("--latency", default="roofline", choices=("vidur", "roofline"),
                   help="the simulator's H100 latency model, the same in both engines")
    p.add_argument("--duration", type=float, default=240.0, help="seconds of normal traffic (and session arrivals)")
    p.add_argument("--normal-rate", type=float, default=2.0, help="normal requests per second per instance")
    p.add_argument("--normal-prompt", type=int, default=800)
    p.add_argument("--normal-output", type=int, default=150)
    p.add_argument("--num-blocks", type=int, default=8192, help="KV blocks of 16 tokens per instance")
    p.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    p.add_argument("--seed", type=int, default=0, help="the normal-traffic draw and the generated sessions")
    p.add_argument("--engine-default-tails", action="store_true",
                   help="also run the engine-level arms with keep_tails_below_n_min false (the engine default)")
    return p.parse_args(argv)


def load_plans(path: str, models: Sequence[str], session_models: dict[str, str] | None = None) -> list:
    from shadow_traces.agent_loaders import load_call_csv
    from shadow_traces.replay import trace_plans
    from shadow_traces.session_trace import read_session_trace

    trace = load_call_csv(path)[0] if path.endswith(".csv") else read_session_trace(path)
    return trace_plans(trace, models, session_models=session_models, start_s=0.5)


def main(argv: Sequence[str] | None = None) -> int:
    from shadow_sim.latency import latency_model
    from shadow_vllm import effects

    from shadowcore.engine.scenario import FakeScenario

    args = parse_args(argv)
    models = tuple(args.models)
    with tempfile.TemporaryDirectory() as tmp:
        path, mapping = args.sessions, None
        if path is None:
            path, mapping = str(Path(tmp) / "sessions.csv"), {"small": models[0], "large": models[1]}
            effects.write_session_file(path, args.num_sessions, 0.9 * args.duration, seed=args.seed)
        plans = load_plans(path, models, mapping)
    scenario = FakeScenario(
        models=models, latency_scale=(1.0,) * len(models), instances_per_model=1, duration_s=args.duration,
        warmup_s=0.0, input_tokens_median=1500, normal_rate_per_s=args.normal_rate,
        normal_prompt_median=args.normal_prompt, normal_output_median=args.normal_output,
        num_blocks=args.num_blocks, block_size=16, token_budget=args.budget, seed=args.seed,
    )
    latency = {m: latency_model(m, kind=args.latency) for m in models}

    def spec(m: str) -> dict:
        return {"name": "shadow_sim.latency:latency_model", "args": {"name": m, "kind": args.latency}}

    print(f"effect-level agreement: {len(plans)} sessions ({args.sessions or 'generated'}), "
          f"{args.normal_rate}/s normal requests per instance over {args.duration:.0f} s, one instance each of "
          f"{' and '.join(models)}, {args.latency} H100 latency in both engines; seed {args.seed}", flush=True)
    sim, vllm = {}, {}
    for arm in effects.ARMS:
        t0 = time.perf_counter()
        sim[arm] = effects.run_sim(arm, scenario, plans, latency)
        t1 = time.perf_counter()
        vllm[arm] = effects.run_virtual(arm, scenario, plans, latency, spec)
        print(f"  {arm}: {len(sim[arm])} / {len(vllm[arm])} calls finished (simulator / vLLM), "
              f"{t1 - t0:.1f} s / {time.perf_counter() - t1:.1f} s wall", flush=True)
    rows = effects.compare(sim, vllm)
    print("\n" + effects.table(rows))
    missed = [r.arm for r in rows if r.misses]
    print(f"\nwithin tolerance: {'all arms' if not missed else 'NOT ' + ', '.join(missed)}")
    if args.engine_default_tails:
        default = dict(vllm)
        for arm in ("harvest-slo", "benefit-host"):
            default[arm] = effects.run_virtual(arm, scenario, plans, latency, spec, keep_tails_below_n_min=False)
        print("\nthe same, vLLM's engine-level arms with the engine default keep_tails_below_n_min: false\n"
              + effects.table([r for r in effects.compare(sim, default) if r.arm in ("harvest-slo", "benefit-host")]))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
