"""The paper's GPU testbed (Section 6, Appendix D) in vLLM virtual time.

One vLLM scheduler per model (the models' TP on H100-80GB: the simulator's
half-of-HBM rule, which gives Table 4's 1/1/4/1/2/4), the simulator's latency
model with the shipped ``paper-testbed-h100`` profile timing every batch, the
paper's sessions (FusionBench sessions from the ``fusionbench-testbed`` preset
at 0.05/s, SWE-bench from ``swe-bench`` at 0.01/s, both pinned per pair to
Table 5), Poisson normal traffic with Azure-conversation lengths at ``rho``
times the PUBLISHED per-instance capacities (Appendix D.1: 12.8, 11.0, 3.8,
13.3, 4.8, 3.8 req/s; not recalibrated here), and arms:

* ``no-shadow``: vLLM's stock ``Scheduler``, no shadow requests;
* ``request-level``: the paper's prototype (Appendix D.1,
  :class:`~shadow_vllm.effects.RequestLevelFeeder`), stock
  scheduler with priority scheduling: what the paper's testbed numbers measure;
* engine-level policies (default ``harvest-slo``, the paper's, and ``imminent-host``, issue 16 item 7's):
  :class:`~shadow_vllm.scheduler.ShadowScheduler` with the router side's jobs as tagged shadow requests.

Besides the paper's numbers, the report judges every engine-level arm by issue
16 item 7's testbed bar (:func:`item7_table`): its switch-call TTFT reduction
at least request-level's, its same-model TTFT at most :data:`SAME_TTFT_BOUND`
times no-shadow's, and normal SLO attainment not below no-shadow's.

Each arm replays the same workload (drawn once per seed by the simulator's
experiment runner) and is compared with no-shadow on matched calls by the
simulator's metrics (:mod:`shadow_sim.experiments.metrics`). Energy per good
request uses the simulator's power model over the virtual engines' busy time;
shadow tokens used are not tracked in vLLM (NaN).

Invariants: every arm sees identical sessions, normal requests, latency
models and KV pools; nothing reads wall time; vLLM is imported only when a
run is built.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from shadow_sim.experiments.paper_numbers import PAPER_TESTBED, TESTBED_CAPACITY
from shadow_sim.experiments.paper_numbers import verdict as _judged

from shadowcore.config import PluginRef, ShadowConfig
from shadowcore.latency import chunked_prefill_s


@attrs.frozen
class TestbedPair:
    """A testbed pair: its preset, session rate and run length (Appendix D.1)."""

    label: str
    models: tuple[str, str]
    preset: str
    session_rate_per_s: float
    length_s: float  # the run, warm-up included
    benchmark: str


PAIRS: dict[str, TestbedPair] = {
    "Q7/L70": TestbedPair("Q7/L70", ("Qwen2.5-7B", "Llama-3.1-70B"), "fusionbench-testbed", 0.05, 900.0,
                          "fusionbench"),
    "L8/L70": TestbedPair("L8/L70", ("Llama-3.1-8B", "Llama-3.1-70B"), "fusionbench-testbed", 0.05, 900.0,
                          "fusionbench"),
    "S7/S32": TestbedPair("S7/S32", ("SWE-agent-LM-7B", "SWE-agent-LM-32B"), "swe-bench", 0.01, 1320.0,
                          "swe-bench"),
    "S7/Q72": TestbedPair("S7/Q72", ("SWE-agent-LM-7B", "Qwen2.5-72B"), "swe-bench", 0.01, 1320.0, "swe-bench"),
}

BASELINE = "no-shadow"
REQUEST_LEVEL = "request-level"
#: Issue 16 item 7: an engine-level arm's same-model TTFT at most this times no-shadow's.
SAME_TTFT_BOUND = 1.05


@attrs.frozen
class TestbedSettings:
    """What to run: pairs x rhos x seeds x arms. ``length_scale`` shortens every
    run (warm-up included) and ``session_rate_scale`` raises the session rate to
    keep enough calls in a short run (the quick mode); 1.0 is the paper's."""

    pairs: tuple[str, ...] = ("Q7/L70", "L8/L70", "S7/S32", "S7/Q72")
    rhos: tuple[float, ...] = (0.3, 0.5)
    seeds: tuple[int, ...] = (0,)
    policies: tuple[PluginRef, ...] = (PluginRef("harvest-slo"), PluginRef("imminent-host"))
    warmup_s: float = 120.0
    length_scale: float = 1.0
    session_rate_scale: float = 1.0
    latency: str = "vidur"
    latency_profile: str = "paper-testbed-h100"

    @property
    def arms(self) -> tuple[str, ...]:
        from shadowcore.config import policy_label

        return (BASELINE, REQUEST_LEVEL, *(policy_label(p) for p in self.policies))


def experiment(pair: TestbedPair, rho: float, settings: TestbedSettings) -> Any:
    """The pair's testbed run as a simulator :class:`~shadow_sim.experiments.spec.Experiment`."""
    from shadow_sim.experiments.spec import Experiment

    length = pair.length_s * settings.length_scale
    warmup = min(settings.warmup_s * settings.length_scale, length / 2)
    return Experiment.from_dict({
        "models": list(pair.models), "preset": pair.preset, "instances_per_model": 1,
        "duration_s": length - warmup, "warmup_s": warmup, "drain_s": 60.0 * settings.length_scale,
        "session_rate_per_s": pair.session_rate_per_s * settings.session_rate_scale,
        "normal": {"kind": "poisson", "source": "azure-conv", "rho": rho, "window": "peak"},
        "latency": settings.latency, "latency_profile": settings.latency_profile,
    })


def draw(ex: Any, seed: int) -> Any:
    """The simulator's run of ``ex`` (not started): its workload, latency models, KV pools and SLOs."""
    from shadow_sim.experiments.spec import ExperimentRun

    capacity = {m: TESTBED_CAPACITY[m] for m in ex.models}
    return ExperimentRun(ex.sim_scenario(seed), ShadowConfig(PluginRef(BASELINE), seed=seed), experiment=ex,
                         capacity=capacity)


def _engine_configs(sim: Any, ex: Any, arm: str, shadow: ShadowConfig | None) -> dict[str, Any]:
    from shadow_vllm import virtual

    configs = {}
    for model in ex.models:
        inst = sim.cluster.by_model[model][0]
        extra: dict[str, Any] = {}
        if shadow is not None:  # the engine rebuilds the policy, the SLOs and the same latency model
            extra = {"shadowprefill": {
                "shadow": json.loads(shadow.to_json()),
                "slo": {"ttft_s": sim.scenario.slo.ttft_s, "tpot_s": inst.tpot_slo_s},
                "latency": {"name": "shadow_sim.latency:latency_model",
                            "args": {"name": model, "kind": ex.latency, "device": ex.device}},
                **({"latency_profile": ex.latency_profile} if ex.latency_profile else {}),
            }}
        configs[model] = virtual.VirtualEngineConfig(
            block_size=inst.kv.block_size, num_blocks=inst.kv.num_blocks + 1,  # + vLLM's null block
            max_num_batched_tokens=inst.limits.token_budget, max_num_seqs=inst.limits.max_num_seqs,
            max_model_len=ex.window_tokens, scheduling_policy="priority" if arm == REQUEST_LEVEL else "fcfs",
            additional_config=extra)
    return configs


def run_arm(sim: Any, ex: Any, arm: str, policy: PluginRef | None, seed: int) -> Any:
    """One arm in vLLM virtual time over ``sim``'s workload; the run, finished."""
    return build_arm(sim, ex, arm, policy, seed).run()


def build_arm(sim: Any, ex: Any, arm: str, policy: PluginRef | None, seed: int) -> Any:
    """:func:`run_arm`'s :class:`~shadow_vllm.virtual.VirtualScenarioRun`, not started (a diagnostic
    may observe its engines' hooks before ``run()``: ``benchmarks/testbed_diag.py``)."""
    from shadow_vllm import virtual
    from shadow_vllm.effects import RequestLevelFeeder
    from shadow_vllm.scheduler import ShadowScheduler

    engine_level = policy is not None
    shadow = ShadowConfig(policy if engine_level else PluginRef(BASELINE), seed=seed)
    latency = {m: sim.cluster.by_model[m][0].latency for m in ex.models}
    feeder = (virtual.TaggedShadowFeeder(wake=True) if engine_level
              else RequestLevelFeeder() if arm == REQUEST_LEVEL else None)
    return virtual.VirtualScenarioRun(sim.scenario, shadow, latency,
                                     _engine_configs(sim, ex, arm, shadow if engine_level else None),
                                     scheduler_cls=ShadowScheduler if engine_level else None,
                                     shadow_feeder=feeder, workload=sim.workload,
                                     placement_window_tokens=sim.cluster.window_tokens)


def _is_shadow(request_id: str) -> bool:
    return request_id.startswith(("shadow:", "shadow-"))  # engine-level (TaggedShadowFeeder), request-level


def record(sim: Any, ex: Any, run: Any, arm: str, seed: int) -> Any:
    """The arm's :class:`~shadow_sim.experiments.metrics.RunRecord` (the simulator's metric inputs)."""
    from shadow_sim.experiments.metrics import Call, RunRecord

    workload = sim.workload
    outputs = {(p.session_id, i): c.num_output_tokens for p in workload.sessions for i, c in enumerate(p.calls)}
    measured = frozenset(p.session_id for p in workload.sessions if ex.warmup_s <= p.arrival_s < ex.end_s)
    calls = tuple(Call(c.session_id, c.call_index, c.model, c.is_switch, c.ttft_s, c.latency_s, c.num_prompt_tokens,
                       c.num_cached_tokens, outputs[(c.session_id, c.call_index)]) for c in run.calls)
    met_all = [(r.arrival_s, _normal_met(sim, run, r)) for r in run.normal]
    wall = run.loop.now_s
    energy = shadow_tokens = 0.0
    for name, engine in run.cluster.by_id.items():
        inst = sim.cluster.by_id[name]
        busy = sum(step.duration_s for step in engine.steps)
        energy += inst.num_gpus * (inst.idle_power_w * wall + (inst.busy_power_w - inst.idle_power_w) * busy)
        shadow_tokens += sum(r.num_scheduled_tokens for step in engine.steps for r in step.batch
                             if _is_shadow(r.request_id))
    good = sum(1 for _, met in met_all if met) + len(calls)
    return RunRecord(
        arm, seed, ex.normal.window, calls, measured,
        tuple(met for arrival, met in met_all if ex.warmup_s <= arrival < ex.end_s),
        sum(r.num_prompt_tokens for r in workload.normal), shadow_tokens, math.nan, energy,
        energy / good if good else math.nan, wall,
    )


def _normal_met(sim: Any, run: Any, r: Any) -> bool:
    """Both SLOs of a normal request, by the simulator's rule (TTFT within max(slo, 5x isolated
    prefill), TPOT within the instance's); an unfinished request is a miss."""
    if r.first_token_s is None or r.finish_s is None:
        return False
    instance = r.request_id.split(":", 1)[1]
    inst = sim.cluster.by_id[instance]
    isolated = chunked_prefill_s(inst.latency, len(r.prompt_token_ids), inst.limits.token_budget)
    tpot = (r.finish_s - r.first_token_s) / max(1, len(r.output_token_ids) - 1)
    return r.ttft_s <= max(sim.scenario.slo.ttft_s, 5 * isolated) and tpot <= inst.tpot_slo_s


def run_point(pair: TestbedPair, rho: float, seed: int, settings: TestbedSettings,
              progress: Any = None) -> dict[str, dict[str, float]]:
    """Every arm at one (pair, rho, seed): :func:`~shadow_sim.experiments.metrics.compare_runs`'s
    metrics per arm (relative ones against no-shadow on matched calls)."""
    from shadow_sim.experiments.metrics import compare_runs

    from shadowcore.config import policy_label

    ex = experiment(pair, rho, settings)
    records = []
    for arm, policy in ((BASELINE, None), (REQUEST_LEVEL, None),
                        *((policy_label(p), p) for p in settings.policies)):
        sim = draw(ex, seed)  # a fresh draw per arm: the same seed gives the same workload
        run = run_arm(sim, ex, arm, policy, seed)
        records.append(record(sim, ex, run, arm, seed))
        if progress is not None:
            progress(f"{pair.label} rho={rho} seed {seed} {arm}: {len(run.calls)} calls, {len(run.normal)} normal")
    return compare_runs(records, BASELINE, None)


# -- the paper's numbers and the side-by-side table ---------------------------------------


def _mean(xs: Sequence[float]) -> float:
    v = [x for x in xs if not math.isnan(x)]
    return sum(v) / len(v) if v else math.nan


def ours(results: Mapping[tuple[str, float], Mapping[str, Mapping[str, float]]], arm: str) -> dict[str, float]:
    """Our numbers for :data:`PAPER_TESTBED` from ``results[(pair, rho)][arm][metric]`` (seed means)."""
    at = [p for p, rho in results if rho == 0.3 and arm in results[(p, rho)]]
    get = lambda pair, rho, m: results.get((pair, rho), {}).get(arm, {}).get(m, math.nan)
    fb = [p for p in at if PAIRS[p].benchmark == "fusionbench"]
    over = lambda m, pairs: _mean([get(p, 0.3, m) for p in pairs])
    out = {
        "switch_ttft_red": over("switch_ttft_red", at),
        "task_time_red_fb": over("task_time_red", fb),
        "task_time_red_all": over("task_time_red", at),
        "token_cost_red": over("token_cost_red", at),
        "energy_inc": over("energy_inc", at),
        "call_latency_red_q7": get("Q7/L70", 0.3, "call_latency_red"),
        "call_latency_red_l8": get("L8/L70", 0.3, "call_latency_red"),
    }
    fb05 = [v for v in (get(p, 0.5, "call_latency_red") for p in ("Q7/L70", "L8/L70")) if not math.isnan(v)]
    out["rho05_fb_keeps"] = math.nan if not fb05 else (1.0 if min(fb05) > 0 else -1.0)
    s32 = get("S7/S32", 0.5, "call_latency_red")
    out["rho05_s32_slows"] = math.nan if math.isnan(s32) else (1.0 if s32 > 0 else -1.0)
    return out


def verdict(paper: float, value: float, sign_only: bool) -> str:
    """The +-30% judgement ``reproduce`` uses too (one helper:
    :func:`shadow_sim.experiments.paper_numbers.verdict`)."""
    return _judged(paper, value, sign_only)


def table(results: Mapping[tuple[str, float], Mapping[str, Mapping[str, float]]], arms: Sequence[str]) -> str:
    """Markdown: each paper number, ours per shadow arm, and whether it is within +-30% relative."""
    shown = [a for a in arms if a != BASELINE]
    values = {a: ours(results, a) for a in shown}
    head = "| what | where | paper | " + " | ".join(f"{a} | ±30%?" for a in shown) + " |"
    lines = [head, "|" + "---|" * (3 + 2 * len(shown))]
    for key, (paper, where, what) in PAPER_TESTBED.items():
        sign = key.startswith("rho05")
        cells = []
        for a in shown:
            v = values[a][key]
            shown_v = ("n/a" if math.isnan(v) else ("reduction" if v > 0 else "slowdown")) if sign \
                else ("n/a" if math.isnan(v) else f"{100 * v:.1f}%")
            cells += [shown_v, verdict(paper, v, sign)]
        p = ("reduction" if paper > 0 else "slowdown") if sign else f"{100 * paper:.1f}%"
        lines.append(f"| {what} | {where} | {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def switch_ttft_share(m: Mapping[str, float]) -> float:
    """Switch calls' TTFT as a share of all matched calls' latency: what removing every switch
    call's TTFT could take off the LLM time per task at most (the bound of its reduction)."""
    total = m.get("calls", math.nan) * m.get("call_latency_s", math.nan)
    return m.get("switch_calls", math.nan) * m.get("switch_ttft_s", math.nan) / total if total else math.nan


def per_point_table(results: Mapping[tuple[str, float], Mapping[str, Mapping[str, float]]],
                    arms: Sequence[str]) -> str:
    """Per (pair, rho, arm): the reductions, and for no-shadow the switch-TTFT share of LLM time
    (:func:`switch_ttft_share`, the most a switch-TTFT cut can save)."""
    metrics = ("switch_ttft_red", "call_latency_red", "task_time_red", "token_cost_red", "energy_inc",
               "normal_slo_pp", "switch_calls", "calls", "switch TTFT share")
    lines = ["| pair | rho | arm | " + " | ".join(metrics) + " |", "|" + "---|" * (3 + len(metrics))]
    for (pair, rho), by_arm in sorted(results.items()):
        for a in (a for a in arms if a in by_arm):
            m = by_arm[a]
            cells = [f"{m.get(k, math.nan):.0f}" if k in ("switch_calls", "calls")
                     else f"{100 * switch_ttft_share(m):.1f}%" if k == "switch TTFT share"
                     else f"{100 * m.get(k, math.nan):.1f}%" for k in metrics]
            lines.append(f"| {pair} | {rho} | {a} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def point_name(label: str, rho: float, seed: int, settings: TestbedSettings) -> str:
    """The file name of one finished point in ``OUT/points``: every setting that changes it."""
    key = json.dumps([label, rho, seed, settings.arms, [attrs.asdict(p) for p in settings.policies],
                      settings.warmup_s, settings.length_scale, settings.session_rate_scale, settings.latency,
                      settings.latency_profile], sort_keys=True, default=str)
    import hashlib

    return f"{label.replace('/', '-')}@{rho:g}@{seed}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.json"


def run_all(settings: TestbedSettings, progress: Any = None, points: Any = None,
            ) -> dict[tuple[str, float], dict[str, dict[str, float]]]:
    """Seed means of every metric at every (pair, rho). With ``points`` (a folder), each finished
    (pair, rho, seed) is written there as it finishes and a rerun with the same settings reads it
    back instead of running it again (a stopped run keeps what it finished)."""
    out: dict[tuple[str, float], dict[str, dict[str, float]]] = {}
    for label in settings.pairs:
        pair = PAIRS[label]
        for rho in settings.rhos:
            per_seed = []
            for seed in settings.seeds:
                path = None if points is None else points / point_name(label, rho, seed, settings)
                if path is not None and path.exists():
                    per_seed.append(with_same_ttft_sum(_load(path)))
                    continue
                result = run_point(pair, rho, seed, settings, progress)
                if path is not None:
                    points.mkdir(parents=True, exist_ok=True)
                    path.write_text(json.dumps({"pair": label, "rho": rho, "seed": seed,
                                                "settings": describe(settings), "arms": _jsonable(result)}, indent=1))
                per_seed.append(with_same_ttft_sum(result))
            out[(label, rho)] = {a: {k: _mean([r[a][k] for r in per_seed]) for k in per_seed[0][a]}
                                 for a in per_seed[0]}
    return out


def same_model_ttft_s(m: Mapping[str, float]) -> float:
    """Mean TTFT of an arm's matched same-model calls, from its means over all calls and over switch calls."""
    same = m["calls"] - m["switch_calls"]
    return (m["ttft_s"] * m["calls"] - m["switch_ttft_s"] * m["switch_calls"]) / same if same else math.nan


def with_same_ttft_sum(result: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """One seed's arms with ``same_ttft_sum`` (the summed TTFT of its same-model calls) added: its seed
    mean over the no-shadow arm's is the same-model TTFT ratio with every call weighing the same."""
    return {a: {**m, "same_ttft_sum": same_model_ttft_s(m) * (m["calls"] - m["switch_calls"])}
            for a, m in result.items()}


def same_ttft_ratio(arm: Mapping[str, float], base: Mapping[str, float]) -> float:
    """The arm's same-model TTFT over no-shadow's (both with :func:`with_same_ttft_sum` applied)."""
    return arm["same_ttft_sum"] / base["same_ttft_sum"]


def item7_checks(arm: Mapping[str, float], request_level: Mapping[str, float],
                 base: Mapping[str, float]) -> dict[str, bool]:
    """Issue 16 item 7's testbed bar for one arm (seed means, :func:`with_same_ttft_sum` applied): which
    of its three conditions hold."""
    return {"switch TTFT": arm["switch_ttft_red"] >= request_level["switch_ttft_red"],
            "same-model TTFT": same_ttft_ratio(arm, base) <= SAME_TTFT_BOUND,
            "normal SLO": arm["normal_slo_pp"] >= 0}


def item7_table(results: Mapping[tuple[str, float], Mapping[str, Mapping[str, float]]],
                arms: Sequence[str]) -> str:
    """Markdown: per (pair, rho), each engine-level arm against request-level by item 7's bar."""
    lines = [("| pair | rho | arm | switch TTFT red (request-level) | same-model TTFT ratio (request-level) "
              "| normal SLO pp | item 7 |"), "|---|---|---|---|---|---|---|"]
    for (pair, rho), by_arm in sorted(results.items()):
        base, rl = by_arm.get(BASELINE), by_arm.get(REQUEST_LEVEL)
        if base is None or rl is None:
            continue
        for a in (a for a in arms if a not in (BASELINE, REQUEST_LEVEL) and a in by_arm):
            m = by_arm[a]
            missed = [what for what, ok in item7_checks(m, rl, base).items() if not ok]
            lines.append(f"| {pair} | {rho:g} | {a} | {100 * m['switch_ttft_red']:.1f}% "
                         f"({100 * rl['switch_ttft_red']:.1f}%) | {same_ttft_ratio(m, base):.3f} ({same_ttft_ratio(rl, base):.3f}) "
                         f"| {100 * m['normal_slo_pp']:+.2f} | "
                         + ("met" if not missed else f"not met ({', '.join(missed)})") + " |")
    return "\n".join(lines)


def _jsonable(result: Mapping[str, Mapping[str, float]]) -> dict:
    return {a: {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in m.items()}
            for a, m in result.items()}


def _load(path: Any) -> dict[str, dict[str, float]]:
    data = json.loads(path.read_text())["arms"]
    return {a: {k: (math.nan if v is None else v) for k, v in m.items()} for a, m in data.items()}


def load_points(paths: Sequence[Any]) -> dict[tuple[str, float], dict[str, dict[str, float]]]:
    """Seed means from point files (:func:`point_name`) of one or more runs, by (pair, rho). The
    runs must share their settings but the arms (each metric is against its own seed's no-shadow)."""
    by_seed: dict[tuple[str, float, int], dict[str, dict[str, float]]] = {}
    for path in paths:  # one (pair, rho, seed) from several runs: the arms of all, the first run's where both have one
        head = json.loads(path.read_text())
        arms = by_seed.setdefault((head["pair"], float(head["rho"]), int(head["seed"])), {})
        for arm, metrics in with_same_ttft_sum(_load(path)).items():
            arms.setdefault(arm, metrics)
    by_point: dict[tuple[str, float], list[dict[str, dict[str, float]]]] = {}
    for (pair, rho, _seed), arms in sorted(by_seed.items()):
        by_point.setdefault((pair, rho), []).append(arms)
    out = {}
    for key, runs in by_point.items():  # an arm's mean is over the runs (seeds) that have it
        arms = list(dict.fromkeys(a for r in runs for a in r))
        out[key] = {a: {k: _mean([r[a][k] for r in runs if a in r])
                        for k in next(r[a] for r in runs if a in r)} for a in arms}
    return out



#: ``reproduce --testbed --quick``: one FusionBench pair at rho 0.3, runs 5% of the paper's length
#: (45 s, 6 s warm-up) with 4x the session rate; under a minute on one core (a test runs it).
QUICK = TestbedSettings(pairs=("L8/L70",), rhos=(0.3,), length_scale=0.05, session_rate_scale=4.0)


def settings_from(quick: bool, pairs: str | None, rhos: str | None, seeds: str | None,
                  length_scale: float | None, session_rate_scale: float | None,
                  policies: Sequence[PluginRef], engine_level: bool = True) -> TestbedSettings:
    """The settings of ``reproduce --testbed``: the paper's (or :data:`QUICK`) with the flags given
    over them; a bad flag is one ConfigError naming it."""
    from shadowcore.errors import ConfigError

    base = QUICK if quick else TestbedSettings()
    changes: dict[str, Any] = {}
    if pairs:
        names = tuple(p.strip() for p in pairs.split(",") if p.strip())
        unknown = [p for p in names if p not in PAIRS]
        if unknown or not names:
            raise ConfigError("--pairs", pairs, f"testbed pairs are {', '.join(PAIRS)}")
        changes["pairs"] = names
    for flag, text, key, conv in (("--rhos", rhos, "rhos", float), ("--seeds", seeds, "seeds", int)):
        if text:
            try:
                changes[key] = tuple(conv(x) for x in text.split(",") if x.strip())
            except ValueError:
                raise ConfigError(flag, text, "must be a comma-separated list of numbers") from None
            if not changes[key]:
                raise ConfigError(flag, text, "is empty")
    for flag, value, key in (("--length-scale", length_scale, "length_scale"),
                             ("--session-rate-scale", session_rate_scale, "session_rate_scale")):
        if value is not None:
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(flag, value, "must be > 0")
            changes[key] = float(value)
    if policies and not engine_level:
        raise ConfigError("--no-engine-level", True, "and --policy/--policies: give one")
    if policies:
        changes["policies"] = tuple(policies)
    if not engine_level:
        changes["policies"] = ()
    return attrs.evolve(base, **changes)


def describe(settings: TestbedSettings) -> str:
    scaled = settings.length_scale != 1.0 or settings.session_rate_scale != 1.0
    return (f"pairs {', '.join(settings.pairs)}; rho {', '.join(str(r) for r in settings.rhos)}; seeds "
            f"{', '.join(str(s) for s in settings.seeds)}; arms {', '.join(settings.arms)}; "
            + (f"REDUCED: run length x{settings.length_scale:g} (the paper: 900 s FusionBench, 1,320 s SWE-bench, "
               f"120 s warm-up), session rate x{settings.session_rate_scale:g}" if scaled
               else "the paper's run lengths and session rates")
            + f"; latency {settings.latency} + profile {settings.latency_profile or 'none'}")


def write_report(results: Mapping[tuple[str, float], Mapping[str, Mapping[str, float]]],
                 settings: TestbedSettings, out: Any, wall_s: float) -> str:
    """``testbed.md`` and ``testbed.json`` in ``out``; returns the Markdown."""
    text = "\n".join([
        "# The paper's GPU testbed (Section 6, Appendix D) in vLLM virtual time", "",
        describe(settings) + f"; {wall_s:.0f} s wall.", "",
        ("Ours: each arm against no-shadow on matched calls, means over pairs (rho 0.3) as the paper averages; "
         "the paper's testbed numbers are its request-level prototype's (Appendix D.1)."), "",
        table(results, settings.arms), "",
        "## Issue 16 item 7: engine-level arms against request-level", "",
        (f"Met when the arm's switch-call TTFT reduction is at least request-level's, its same-model TTFT at most "
         f"{SAME_TTFT_BOUND}x no-shadow's (summed over seeds) and its normal SLO attainment not below no-shadow's."),
        "", item7_table(results, settings.arms), "",
        "## Per pair and load", "", per_point_table(results, settings.arms), ""])
    out.mkdir(parents=True, exist_ok=True)
    (out / "testbed.md").write_text(text)
    data = {f"{p}@{r}": {a: {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in m.items()}
                         for a, m in by_arm.items()} for (p, r), by_arm in results.items()}
    (out / "testbed.json").write_text(json.dumps(data, indent=1))
    return text
