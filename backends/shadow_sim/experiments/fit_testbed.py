"""Fit the shipped ``paper-testbed-h100`` latency profile to the paper's GPU testbed.

The paper's testbed (Appendix D.1: real vLLM on H100, the same SLO rule)
reports per-instance capacities of 12.8 (Qwen2.5-7B), 11.0 (Llama-3.1-8B) and
3.8 (Llama-3.1-70B, TP 4) requests/s. Our kernel-level Vidur model gives about
twice that. This script searches the one-parameter family "prefill part of
every iteration ``s`` times slower" (:class:`~shadowcore.calibration.LatencyProfile`
``prefill_scale``), calibrating each model's capacity exactly as the
experiments do (Azure-conversation-like Poisson traffic, the default probe
settings), and keeps the ``s`` with the least squared log error over the three
published numbers.

What this pins down, and what not: three published numbers fix one
parameter; they cannot tell a slower prefill from other end-to-end costs that
lower capacity the same way (per-sequence CPU work, a larger chunk budget).
The prefill family is chosen because the kernel tables' decode is close to
measured bandwidth (54-64% of peak) and a fixed per-step overhead barely moves
capacity under the 5x batch-1 SLO (measured, docs/reproduction.md).

    python -m shadow_sim.experiments.fit_testbed [--scales 1.5,1.6,...] [--write]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

from shadow_sim.experiments.calibrate import ProbeSettings, calibrate
from shadow_sim.experiments.paper_numbers import TESTBED_CAPACITY
from shadow_sim.experiments.spec import SIMULATE_DEFAULT, Experiment
from shadow_sim.latency import PROFILES_DIR
from shadowcore.calibration import LatencyProfile

#: Appendix D.1: measured capacity per instance (requests/s) on the H100 testbed.
TESTBED = {m: TESTBED_CAPACITY[m] for m in ("Qwen2.5-7B", "Llama-3.1-8B", "Llama-3.1-70B")}  # Appendix D.1
NAME = "paper-testbed-h100"


def capacities_at(scale: float, settings: ProbeSettings, folder: Path) -> dict[str, float]:
    path = folder / f"prefill-{scale:g}.json"
    LatencyProfile(f"prefill x{scale:g}", prefill_scale=scale).write(path)
    out = {}
    for model in TESTBED:
        other = "Llama-3.1-70B" if model != "Llama-3.1-70B" else "Llama-3.1-8B"
        ex = Experiment.from_dict({"models": [model, other], "preset": "", "normal": SIMULATE_DEFAULT["normal"],
                                   "latency_profile": str(path) if scale != 1.0 else ""})
        out[model] = calibrate(ex, model, settings).capacity_per_s
    return out


def log_error(caps: dict[str, float]) -> float:
    return sum(math.log(caps[m] / TESTBED[m]) ** 2 for m in TESTBED)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scales", default="1.0,1.6,1.7,1.8,1.9,2.0")
    ap.add_argument("--write", action="store_true", help=f"write profiles/{NAME}.json")
    a = ap.parse_args(argv)
    settings = ProbeSettings()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for s in (float(x) for x in a.scales.split(",")):
            caps = capacities_at(s, settings, Path(tmp))
            rows.append((s, caps, log_error(caps)))
            print(f"prefill x{s:<4g} " + "  ".join(f"{m} {c:6.2f}" for m, c in caps.items())
                  + f"   sum sq log err {rows[-1][2]:.4f}", flush=True)
    best = min(rows, key=lambda r: r[2])
    s, caps, _err = best
    print("paper testbed: " + "  ".join(f"{m} {c:6.2f}" for m, c in TESTBED.items()))
    print(f"best: prefill x{s:g} ({', '.join(f'{m} {caps[m] / TESTBED[m] - 1:+.1%}' for m in TESTBED)})")
    if a.write:
        source = ("fitted to the paper's H100 testbed capacities (Appendix D.1: "
                  + ", ".join(f"{m} {TESTBED[m]}" for m in TESTBED)
                  + " req/s per instance) over the one-parameter family prefill_scale; at the fit: "
                  + ", ".join(f"{m} {caps[m]:.2f}" for m in TESTBED)
                  + f"; scales tried {a.scales}. Three numbers fix one parameter: see docs/reproduction.md")
        profile = LatencyProfile(NAME, prefill_scale=s, source=source)
        PROFILES_DIR.mkdir(exist_ok=True)
        profile.write(PROFILES_DIR / f"{NAME}.json")
        print(json.dumps(profile.to_dict(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
