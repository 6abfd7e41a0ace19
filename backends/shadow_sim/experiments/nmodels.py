"""The models-per-router study on its own (Figure 16d/e analogue): one N, any
policies, any seeds, mean +- 1 SE.

``python -m shadow_sim.experiments.nmodels --n 5 --seeds 0,1,2 --policies
no-shadow,harvest-slo-host,'harvest-slo-host:{"top_k":1}',expected-benefit-host,oracle-host``
runs exactly the grid point ``reproduce --quick`` uses for N models
(:func:`shadow_sim.experiments.reproduce.studies`) and prints the comparison
table plus each policy's per-seed LLM-call latency reduction, and the shadow tokens and unused (wasted)
shadow tokens in absolute numbers (the table's "unused shadow" is a share).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from shadow_sim.experiments.calibrate import capacities
from shadow_sim.experiments.metrics import mean_se
from shadow_sim.experiments.output import no_nan
from shadow_sim.experiments.reproduce import N_MODELS, studies
from shadow_sim.experiments.runner import compare, format_table, summary_json, tasks_for, with_progress, with_promise
from shadow_sim.experiments.spec import Experiment
from shadow_sim.experiments.sweep import csv_list
from shadowcore.cli import HelpFormatter, add_policy_options, describe, exit_on_sigterm, policies_from_args
from shadowcore.errors import ConfigError, PluginError


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shadow_sim.experiments.nmodels", description=describe(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--n", type=int, default=5, help="models per router (2-5)")
    p.add_argument("--quick", action=argparse.BooleanOptionalAction, default=True,
                   help="the --quick measurement settings of reproduce (default) or the full ones")
    add_policy_options(p)
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    p.add_argument("--jobs", type=int, default=2, help="local worker processes")
    p.add_argument("--out", help="write summary.json here")
    args = p.parse_args(argv)
    try:
        refs = policies_from_args(args)
    except (ConfigError, PluginError) as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    if not refs:
        p.error("give the policies to compare: --policies a,b or --policy 'NAME:{json}' (repeatable)")
    fields = next((f for s, label, f, _ in studies(args.quick) if s == "nmodels" and label == f"N={args.n}"), None)
    if fields is None:
        fields = next(f for s, _l, f, _ in studies(args.quick) if s == "nmodels")
        fields = {**fields, "models": list(N_MODELS[:args.n])}
    ex = Experiment.from_dict(fields)
    caps = {m: c.capacity_per_s for m, c in capacities(ex, progress=False).items()}
    seeds = [int(s) for s in csv_list(args.seeds)]
    start = time.time()
    tasks = tasks_for(ex, refs, seeds, ("peak",), caps, f"N={args.n}")
    c = compare(with_progress(tasks, args.jobs, False), tasks)[f"N={args.n}"]
    c = with_promise(c, ex, caps, ("peak",))  # the normal SLO calibration promised, beside what each got
    print(format_table(c))
    print("\npolicy: shadow tokens and unused (wasted) shadow tokens per run, thousands, mean +- 1 SE; per seed")
    for pol in c.policies:
        shadow = mean_se([m[pol]["shadow_tokens"] / 1e3 for _s, _w, m in c.per_run])
        wasted = mean_se([wasted_tokens(m[pol]) / 1e3 for _s, _w, m in c.per_run])
        per = " ".join(f"s{seed}: call {100 * m[pol]['call_latency_red']:+.1f}% "
                       f"wasted {wasted_tokens(m[pol]) / 1e3:.0f}k" for seed, _w, m in c.per_run)
        print(f"{pol}: shadow {shadow[0]:.0f}k +- {shadow[1]:.0f}, wasted {wasted[0]:.0f}k +- {wasted[1]:.0f}; {per}")
    print(f"{len(tasks)} runs in {time.time() - start:.0f} s wall")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(no_nan(summary_json(c)), indent=1))
    return 0


def wasted_tokens(m: dict[str, float]) -> float:
    """Shadow tokens never used by a switch call: shadow tokens x unused share (0 without shadow work)."""
    u = m.get("shadow_unused_share", math.nan)
    return 0.0 if math.isnan(u) else m["shadow_tokens"] * u


if __name__ == "__main__":
    exit_on_sigterm()
    sys.exit(main())
