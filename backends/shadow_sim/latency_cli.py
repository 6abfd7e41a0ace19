"""``shadowprefill latency``: fit a latency profile to an engine's measured iterations.

    shadowprefill latency calibrate --steps steps.jsonl --model Llama-3.1-8B [--device H100-80GB]
        [--tp N] [--latency vidur|roofline] -o my-engine.json
    shadowprefill latency calibrate --steps steps.jsonl --base linear -o cpu-engine.json
    shadowprefill latency show NAME|FILE      # a profile, and the shipped ones

``--steps`` is a JSON Lines file of measured iterations, one per line:
``{"prefills": [[new_tokens, cached_context], ...], "decodes": [context, ...],
"duration_s": seconds}`` (an engine's per-step batch and time). With a catalog ``--model``
the fit is a :class:`~shadowcore.calibration.LatencyProfile` over the
simulator's kernel-level model of that model on ``--device`` (use it as
``--latency-profile FILE`` in ``simulate``, ``sweep`` and experiments); with
``--base linear`` it is a :class:`~shadowcore.latency.LinearLatencyModel` for
an engine the catalog does not know (the vLLM CPU engine: use it as
``vllm-serve --latency``). Both print the relative error per step before and
after the fit (median and p90 of the absolute error).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import attrs
import numpy as np

from shadowcore.calibration import LatencyProfile, fit_linear, fit_profile, prediction_errors, read_steps
from shadowcore.cli import HelpFormatter, describe
from shadowcore.errors import ConfigError, PluginError


def _quantiles(errors: np.ndarray) -> str:
    a = np.abs(errors)
    return f"median {np.median(a):.1%}, p90 {np.quantile(a, 0.9, method='nearest'):.1%}"


def _calibrate(a: argparse.Namespace) -> int:
    steps = read_steps(a.steps)
    if a.base == "linear":
        model = fit_linear(steps)
        args = attrs.asdict(model)
        text = json.dumps({"name": "linear", "args": args}, indent=1)
        print(f"fitted a linear latency model to {len(steps)} steps: {_quantiles(prediction_errors(model, steps))}")
        print(f"use it as: shadowprefill vllm-serve --latency '{json.dumps({'name': 'linear', 'args': args})}'")
        if a.out:
            with open(a.out, "w") as fh:
                fh.write(text + "\n")
        else:
            print(text)
        return 0
    if not a.model:
        raise ConfigError("--model", None, "a catalog model is needed (or --base linear)")
    from shadow_sim.latency import latency_model

    base = latency_model(a.model, a.device, a.tp or None, kind=a.latency)
    name = a.name or (a.out.rsplit("/", 1)[-1].removesuffix(".json") if a.out else "fitted")
    profile = fit_profile(base, steps, name, f"fitted to {len(steps)} steps of {a.steps} over {a.latency} "
                          f"{a.model} on {a.device}")
    print(f"kernel-level {a.latency} model: {_quantiles(prediction_errors(base, steps))}")
    print(f"with the fitted profile:  {_quantiles(prediction_errors(profile.apply(base), steps))}")
    print(json.dumps(profile.to_dict(), indent=1))
    if a.out:
        profile.write(a.out)
        print(f"wrote {a.out}: use it as --latency-profile {a.out}")
    return 0


def _show(a: argparse.Namespace) -> int:
    from shadow_sim.latency import resolve_profile, shipped_profiles

    if a.profile:
        print(json.dumps(resolve_profile(a.profile).to_dict(), indent=1))
    print(f"shipped profiles: {', '.join(shipped_profiles()) or '(none)'}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shadowprefill latency", description=describe(main.__doc__),
                                formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="verb", required=True)
    c = sub.add_parser("calibrate", help="fit a profile (or a linear model) to measured steps",
                       formatter_class=HelpFormatter, description=describe(__doc__.split("\n\n", 2)[2]))
    c.add_argument("--steps", required=True, help="measured iterations, JSON Lines")
    c.add_argument("--model", help="catalog model the steps ran (the kernel-level base)")
    c.add_argument("--device", default="H100-80GB", help="catalog device")
    c.add_argument("--tp", type=int, default=0, help="tensor parallelism (0: the half-of-HBM rule)")
    c.add_argument("--latency", default="vidur", choices=("vidur", "roofline"), help="kernel-level base model")
    c.add_argument("--base", default="kernels", choices=("kernels", "linear"),
                   help="kernels: a profile over --model; linear: a LinearLatencyModel from scratch")
    c.add_argument("--name", help="the profile's name (default: the output file's stem)")
    c.add_argument("-o", "--out", help="write the fit here")
    c.set_defaults(run=_calibrate)
    s = sub.add_parser("show", help="print a profile and list the shipped ones")
    s.add_argument("profile", nargs="?", help="a shipped name or a JSON file")
    s.set_defaults(run=_show)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Fit a latency profile (or a linear model) to an engine's measured iterations, or show a profile."""
    a = parser().parse_args(argv)
    try:
        return a.run(a)
    except (ConfigError, PluginError) as e:
        print(f"shadowprefill latency: error: {e}", file=sys.stderr)
        return 2


__all__ = ["LatencyProfile", "main", "parser"]
