"""Capacity calibration (§5.1, Appendix D.1): the highest normal-traffic rate
per instance at which at least 90% of requests meet both SLOs
(TTFT <= max(1 s, 5x isolated prefill), TPOT <= max(25 ms, 5x batch-1 decode)).

Method: one instance of the model serves normal traffic with the arrival
process the run will use (:func:`probe_arrivals`): Poisson (lengths from the
experiment's source, a fixed probe seed) for ``warmup_s + measure_s``, or, for a
trace replay, the trace's PEAK window time-scaled to the probed rate and
replayed (tiled) for ``warmup_s`` plus at least one whole pass of the window, so
a bursty trace is provisioned for its bursts (issue 14 item 5). Requests carry
their trace prefixes when the run's do. The attainment is over requests arriving
after the warm-up, and the run drains. The rate doubles from ``start_per_s``
until a probe misses the target, then bisects between the last passing and
the first failing rate until they are within ``rel_tol``. The result records both: ``capacity_per_s`` passed, and
``fail_per_s`` (at most ``rel_tol`` above it) missed, on the same probe seed.

Results are cached under ``$SHADOWPREFILL_CACHE/capacity`` (default
``~/.cache/shadowprefill/capacity``), keyed by a sha256 of every input (model,
device, TP, latency kind and the latency tables' input key -- for Vidur the
sha256 of the profiles and training settings that names its table cache, for the
roofline the model and device specs --, SLOs, engine limits, length source and,
for a trace file, its content hash, probe settings, a method version), so a
repeated experiment does not re-probe; a replayed or prefix-sharing source adds
its arrival process to the key (Poisson keys without prefixes are unchanged).

Promise (:func:`promise`): the attainment the calibration predicts for the run,
measured the same way at the run's own rate (``rho`` x capacity, the run's
window), next to which the run reports what it got.

Shipped capacities: :data:`SHIPPED` (``capacity_shipped.json`` next to this
module) holds results of this very calibration for the models of the embedded
``simulate`` default and of ``reproduce --quick``, under the same keys, so a
first run from cold caches skips probing. They were written by
``python -m shadow_sim.experiments.calibrate --ship MODEL ...`` (:func:`ship`),
and a test recomputes the two bracketing probes of one entry. A key changes with
any input above, so a changed profile, SLO or engine setting falls back to
probing. (Vidur's table training is not bit-reproducible across builds -- about
0.5% mean difference between two builds of the same key --, so a recomputed
capacity can differ from a shipped one by about one bisection step.)
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import attrs
import numpy as np

from shadow_sim.experiments.normal import MAX_OUTPUT_TOKENS, MAX_PROMPT_TOKENS
from shadow_sim.experiments.spec import SIMULATE_DEFAULT, Experiment, NormalOnlyRun
from shadow_sim.hardware import get_device
from shadow_sim.latency import latency_model, resolve_profile, vidur_available
from shadow_sim.models import get_model
from shadow_sim.simulator import SimScenario
from shadow_sim.vidur_latency import ENV_CACHE
from shadowcore.config import PluginRef, ShadowConfig
from shadowcore.errors import ConfigError

TARGET = 0.9
METHOD_VERSION = 2  # 2: the key includes the latency tables' input key (a replay adds "arrivals")
SHIPPED = Path(__file__).with_name("capacity_shipped.json")


@attrs.frozen
class ProbeSettings:
    warmup_s: float = 30.0
    measure_s: float = 120.0
    start_per_s: float = 1.0
    rel_tol: float = 0.04
    max_probes: int = 24
    seed: int = 12345


@attrs.frozen
class Capacity:
    model: str
    capacity_per_s: float
    fail_per_s: float
    attainment: float  # at capacity_per_s
    fail_attainment: float  # at fail_per_s
    probes: tuple[tuple[float, float], ...]  # (rate, attainment) in probe order


def cache_dir() -> Path:
    root = os.environ.get(ENV_CACHE)
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "shadowprefill"
    return base / "capacity"


def _probe_scenario(ex: Experiment, model: str) -> dict:
    other = next(m for m in ("Llama-3.1-8B", "Qwen2.5-7B") if m != model)
    return {**ex.scenario, "models": [model, other], "device": ex.device, "latency": ex.latency,
            "latency_profile": ex.latency_profile, "instances_per_model": 1, "normal_rate_per_s": 0.0, "seed": 0}


def latency_key(kind: str, model: str, device: str, tp: int) -> str:
    """The identity of the latency model a run builds for ``model``: for Vidur the
    input key of its table cache (profiles, grid, training, versions), for the
    roofline a hash of the model and device specs."""
    if kind == "auto":
        kind = "vidur" if vidur_available() else "roofline"
    if kind == "vidur":
        from shadow_sim.vidur_latency import TrainingConfig, build_profiles, cache_key

        return "vidur:" + cache_key(build_profiles(model, device, tp), TrainingConfig())
    specs = {"model": attrs.asdict(get_model(model)), "device": attrs.asdict(get_device(device))}
    return f"{kind}:" + hashlib.sha256(json.dumps(specs, sort_keys=True, default=str).encode()).hexdigest()


def _key(ex: Experiment, model: str, settings: ProbeSettings) -> str:
    sc = ex.sim_scenario(0)
    lengths = ex.normal.lengths
    source = lengths.source
    if lengths.is_file:
        source = hashlib.sha256(Path(lengths.source).read_bytes()).hexdigest()
        if lengths.caps != (MAX_PROMPT_TOKENS, MAX_OUTPUT_TOKENS):  # default caps keep the earlier keys
            source += f":caps={lengths.caps[0]},{lengths.caps[1]}"
    fields = {
        "v": METHOD_VERSION, "model": model, "device": sc.device, "tp": sc.tp_of(model), "latency": sc.latency,
        "slo": attrs.asdict(sc.slo), "budget": sc.token_budget, "seqs": sc.max_num_seqs, "block": sc.block_size,
        "mem": sc.memory_utilization, "input_median": sc.input_tokens_median, "lengths": source,
        "settings": attrs.asdict(settings),
        "latency_key": latency_key(sc.latency, model, sc.device, sc.tp_of(model)),
    }
    profile = resolve_profile(sc.latency_profile)
    if not profile.is_identity:  # absent otherwise: the keys of uncalibrated runs (and shipped capacities) stay
        fields["latency_profile"] = profile.to_dict()
    if ex.normal.kind == "trace":  # calibrated by replaying the peak window (absent for Poisson: keys stay)
        fields["arrivals"] = "replay-peak"
    if ex.normal.shares_prefixes:
        fields["prefix_sharing"] = True
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:20]


def probe_arrivals(ex: Experiment, rate_per_s: float, settings: ProbeSettings = ProbeSettings(),
                   window: str = "peak") -> tuple[list[tuple], float]:
    """The probe's normal traffic at ``rate_per_s`` (the PEAK window's rate) and its
    length: the run's own arrival process (``ex.normal``) on one instance, the
    probe seed for Poisson; a replay lasts ``warmup_s`` plus at least one pass of
    the scaled window. ``window`` other than peak: that window at its load."""
    normal = ex.normal
    measure = settings.measure_s
    if normal.kind == "trace":
        measure = max(measure, normal.peak_window_requests() / rate_per_s)  # one whole pass of the window
    end = settings.warmup_s + measure
    return normal.peak_arrivals(rate_per_s, end, settings.seed, 0, 1, window=window), end


def attainment(ex: Experiment, model: str, rate_per_s: float, settings: ProbeSettings = ProbeSettings(),
               window: str = "peak") -> float:
    """Share of normal requests after the warm-up meeting both SLOs at ``rate_per_s``
    (:func:`probe_arrivals`)."""
    arrivals, end = probe_arrivals(ex, rate_per_s, settings, window)
    sc = SimScenario.from_dict({**_probe_scenario(ex, model), "duration_s": end, "warmup_s": settings.warmup_s})
    run = NormalOnlyRun(sc, ShadowConfig(PluginRef("no-shadow")), arrivals=arrivals)
    run.run()
    met = [ok for arrival, ok in run.normal if arrival >= settings.warmup_s]
    return float(np.mean(met)) if met else 1.0


@attrs.frozen
class Promise:
    """The normal SLO attainment calibration promises a run: per model, the
    probe's attainment at the run's rate (``rho`` x capacity) and window, and
    their mean weighted by each model's normal request rate."""

    arrivals: str  # "poisson" or "replay-peak"
    rho: float
    window: str
    per_model: dict[str, float]
    attainment: float

    def line(self, got: dict[str, float], width: int = 120) -> str:
        """The promise and what each policy got, in lines of at most ``width`` characters."""
        import textwrap

        how = "peak window replayed, time-scaled" if self.arrivals == "replay-peak" else "Poisson arrivals"
        head = f"normal SLO promised by calibration: {self.attainment:.1%} ({how}; rho {self.rho:g}, {self.window})"
        cells = ", ".join(f"{p} {a:.1%}" for p, a in got.items())
        return "\n".join([head, *textwrap.wrap(f"normal SLO got: {cells}", width, subsequent_indent="  ",
                                                break_on_hyphens=False)])


def promise(ex: Experiment, capacity: dict[str, float], window: str = "peak",
            settings: ProbeSettings = ProbeSettings(), *, use_cache: bool = True) -> Promise:
    """What calibration promises the run of ``ex`` at ``capacity`` (see
    :class:`Promise`); cached beside the capacities."""
    per_model = {}
    for model in ex.models:
        rate = ex.normal.rho * capacity[model]
        key = hashlib.sha256(f"{_key(ex, model, settings)}:{rate!r}:{window}".encode()).hexdigest()[:20]
        path = cache_dir() / f"promise-{key}.json"
        if use_cache and path.exists():
            per_model[model] = float(json.loads(path.read_text())["attainment"])
            continue
        per_model[model] = attainment(ex, model, rate, settings, window)
        if use_cache:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"model": model, "rate_per_s": rate, "window": window,
                                        "attainment": per_model[model]}))
    weights = {m: capacity[m] for m in ex.models}  # the same instances per model: requests ~ capacity
    total = sum(weights.values())
    overall = sum(per_model[m] * weights[m] for m in ex.models) / total if total else float("nan")
    kind = "replay-peak" if ex.normal.kind == "trace" else "poisson"
    return Promise(kind, ex.normal.rho, window, per_model, overall)


def _capacity(data: dict) -> Capacity:
    return Capacity(**{k: data[k] for k in ("model", "capacity_per_s", "fail_per_s", "attainment",
                                            "fail_attainment")}, probes=tuple(tuple(p) for p in data["probes"]))


def shipped() -> dict[str, dict]:
    """The shipped capacities by key (empty when the file is absent)."""
    return json.loads(SHIPPED.read_text()) if SHIPPED.exists() else {}


def calibrate(ex: Experiment, model: str, settings: ProbeSettings = ProbeSettings(), *,
              use_cache: bool = True, on_probe: Callable[[float, float], None] | None = None) -> Capacity:
    """The capacity of one instance of ``model`` (see the module docstring); with
    ``use_cache``, from the user cache or the shipped capacities when they hold its key."""
    key = _key(ex, model, settings)
    path = cache_dir() / f"{key}.json"
    if use_cache and path.exists():
        return _capacity(json.loads(path.read_text()))
    if use_cache and key in (ship_data := shipped()):
        return _capacity(ship_data[key])
    probes: list[tuple[float, float]] = []

    def probe(rate: float) -> float:
        if len(probes) >= settings.max_probes:
            raise ConfigError("calibration", model, f"no bracket within {settings.max_probes} probes: {probes}")
        a = attainment(ex, model, rate, settings)
        probes.append((rate, a))
        if on_probe is not None:
            on_probe(rate, a)
        return a

    lo, lo_att, hi, hi_att = 0.0, 1.0, settings.start_per_s, 0.0
    while (a := probe(hi)) >= TARGET:
        lo, lo_att, hi = hi, a, hi * 2
    hi_att = a
    while lo == 0.0 or (hi - lo) > settings.rel_tol * hi:
        mid = (lo + hi) / 2 if lo > 0 else hi / 2
        a = probe(mid)
        if a >= TARGET:
            lo, lo_att = mid, a
        else:
            hi, hi_att = mid, a
    result = Capacity(model, lo, hi, lo_att, hi_att, tuple(probes))
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(attrs.asdict(result)))
    return result


def capacities(ex: Experiment, settings: ProbeSettings = ProbeSettings(), *, use_cache: bool = True,
               progress: bool = False) -> dict[str, Capacity]:
    """Capacity of every model of the experiment (with a rich status line when
    ``progress``). Also builds (or loads) every model's latency tables here first,
    so that worker processes started afterwards only load them instead of each
    training the same Vidur tables (shipped capacities need no probe run to build them)."""
    sc = ex.sim_scenario(0)
    for model in ex.models:
        latency_model(model, sc.device, sc.tp_of(model), kind=sc.latency)
    out = {}
    for model in ex.models:
        if progress:
            from rich.console import Console

            console = Console(stderr=True)
            with console.status(f"calibrating {model} capacity ...") as status:
                def show(rate: float, a: float, m: str = model) -> None:
                    status.update(f"calibrating {m}: {rate:.2f} req/s -> {a:.1%} meet both SLOs")
                out[model] = calibrate(ex, model, settings, use_cache=use_cache, on_probe=show)
            c = out[model]
            console.print(f"capacity {model}: {c.capacity_per_s:.2f} req/s per instance "
                          f"({c.attainment:.1%} meet both SLOs; {c.fail_per_s:.2f} req/s: {c.fail_attainment:.1%})")
        else:
            out[model] = calibrate(ex, model, settings, use_cache=use_cache)
    return out


def ship(models: list[str], experiment: Experiment | None = None, settings: ProbeSettings = ProbeSettings(),
         *, use_cache: bool = False) -> dict[str, dict]:
    """Calibrate ``models`` on ``experiment`` (default: the embedded ``simulate``
    default) and add them to :data:`SHIPPED`, writing the file after each model.
    ``use_cache`` takes a result this calibration already cached (same key)."""
    if experiment is None:
        experiment = Experiment.from_dict(SIMULATE_DEFAULT)
    data = shipped()
    for model in models:
        key = _key(experiment, model, settings)
        path = cache_dir() / f"{key}.json"
        c = (_capacity(json.loads(path.read_text())) if use_cache and path.exists()
             else calibrate(experiment, model, settings, use_cache=False))
        sc = experiment.sim_scenario(0)
        data[key] = {**attrs.asdict(c), "device": sc.device, "tp": sc.tp_of(model), "latency": sc.latency,
                     "lengths": experiment.normal.lengths.source}
        print(f"{model}: {c.capacity_per_s:.3f} req/s ({c.attainment:.1%}); {c.fail_per_s:.3f}: "
              f"{c.fail_attainment:.1%}", flush=True)
        SHIPPED.write_text(json.dumps(dict(sorted(data.items())), indent=1) + "\n")
    return data


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="calibrate and ship capacities for the embedded default")
    parser.add_argument("--ship", nargs="+", required=True, metavar="MODEL")
    parser.add_argument("--from-cache", action="store_true", help="take results this calibration already cached")
    args = parser.parse_args()
    ship(args.ship, use_cache=args.from_cache)
