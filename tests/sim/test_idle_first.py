"""Our idle-first-host policy: it loads with its defaults (one-block n_min, one
LRU over both KV classes, host tier, no routed-step credit, benefit-host's
targeting and predictor) and clear argument errors; it conforms (with and
without routed_decode_margin); it completes a shadow's sub-n_min tail that
benefit-host defers; it never puts shadow work on an iteration that carries a
routed call, and with routed_decode_margin only next to routed calls that all
decode, within the batch's slack."""

from __future__ import annotations

import itertools

import pytest
from shadow_policies.benefit import ExpectedBenefitTargets, PopulationBackoffPredictor
from shadow_policies.idle import N_MIN_TOKENS

from shadowcore.config import PluginRef, ShadowConfig
from shadowcore.engine.scenario import FakeRun, FakeScenario
from shadowcore.engine.workload import session as scripted_session
from shadowcore.errors import ConfigError
from shadowcore.policy import load_policy
from shadowcore.slack import SloSlackController
from shadowcore.types import Phase, RequestKind


def test_policy_loads_with_its_defaults_and_names_bad_arguments() -> None:
    spec = load_policy(PluginRef("idle-first-host"))
    assert spec.name == "idle-first-host" and spec.kv.host is not None and spec.kv.eviction_order == "lru"
    assert spec.slack.cls is SloSlackController
    assert spec.slack.kwargs["delta"] == 0.0 and spec.slack.kwargs["n_min"] == N_MIN_TOKENS == 16
    assert spec.targeting == ExpectedBenefitTargets(0.1, 2) and spec.predictor.cls is PopulationBackoffPredictor
    assert load_policy(PluginRef("idle-first-host", {"eviction_order": "shadow-first"})).kv.eviction_order \
        == "shadow-first"
    for bad, field in (({"n_min": -1}, "n_min"), ({"gate": 2.0}, "gate"), ({"beta": 0}, "beta"), ({"beta": 1.5}, "beta"),
                       ({"shadow_cap": 0}, "shadow_cap"), ({"top_k": 1}, "top_k"),
                       ({"routed_decode_margin": 1.0}, "routed_decode_margin"),
                       ({"imminent_margin": -0.1}, "imminent_margin"),
                       ({"imminent_stretch": 0}, "imminent_stretch")):
        with pytest.raises(ConfigError) as info:
            load_policy(PluginRef("idle-first-host", bad))
        assert info.value.field == f"policy.args.{field}", info.value


@pytest.mark.parametrize("args", [{}, {"routed_decode_margin": 0.1}, {"imminent_margin": 0.1},
                                  {"imminent_stretch": 1.0, "imminent_first": True}])
def test_conforms(args: dict) -> None:
    from shadowcore.testing.conformance import check_policy

    report = check_policy(PluginRef("idle-first-host", args))
    assert report.policy == "idle-first-host" and report.num_shadow_plans > 0


def _ab_run(policy: PluginRef) -> FakeRun:
    """One session A -> B -> A -> B whose calls end with outputs below the paper's n_min (256) and
    whose inputs are above it; no normal traffic. ``idle-first-host``'s targeting needs a switch
    probability of at least its gate (1/2 before anything is learnt, then the session's own A<->B
    transitions)."""
    s = scripted_session("s0", 1.0, ("A", "B", "A", "B", "A"), (1000, 600, 500, 400, 300), (120, 90, 100, 80, 60),
                         gap_s=3.0)
    scenario = {"models": ["A", "B"], "latency_scale": [1.0, 1.0], "instances_per_model": 1,
                "normal_rate_per_s": 0.0, "duration_s": 30.0, "warmup_s": 0.0}
    run = FakeRun(FakeScenario.from_dict(scenario), ShadowConfig(policy, seed=0), sessions=(s,))
    run.run()
    return run


def test_completes_the_tail_that_the_paper_n_min_defers() -> None:
    """Each switch call finds the whole history before it cached (block-aligned) under idle-first-host;
    under the same policy with the paper's n_min the completed call's output (< 256 tokens) is
    deferred, so the switch calls miss it."""
    def missed(run: FakeRun) -> list[int]:
        calls = sorted(run.calls, key=lambda c: c.call_index)
        bs = run.scenario.block_size
        out = []
        for prev, call in itertools.pairwise(calls):
            history = prev.num_prompt_tokens + run.workload.sessions[0].calls[prev.call_index].num_output_tokens
            out.append(history - history % bs - call.num_cached_tokens)
        return out

    ours = missed(_ab_run(PluginRef("idle-first-host")))
    paper_n_min = missed(_ab_run(PluginRef("idle-first-host", {"n_min": 256})))
    assert len(ours) == 4 and all(m <= 0 for m in ours), ours
    # the first shadow is the first prompt plus its output (more than 256 together); after it, each
    # switch call's missing tokens are the previous call's output alone
    assert all(m > 0 for m in paper_n_min[1:]), paper_n_min


class RoutedGrants:
    """Shadow tokens planned on iterations that carry a routed call, split by whether a routed call
    of the batch is prefilling."""

    def __init__(self) -> None:
        self.prefilling = 0  # shadow tokens next to a routed prefill
        self.decoding = 0  # shadow tokens next to routed calls that all decode
        self.plans = 0

    def on_plan(self, snapshot, plan) -> None:
        self.plans += bool(plan.grants)
        if not snapshot.has_routed:
            return
        if any(r.kind is RequestKind.ROUTED and r.phase is Phase.PREFILL for r in snapshot.batch):
            self.prefilling += plan.num_shadow_tokens
        else:
            self.decoding += plan.num_shadow_tokens


def _routed_grants(args: dict) -> RoutedGrants:
    from shadowcore.testing.conformance import SMALL_SCENARIO

    scenario = {**SMALL_SCENARIO, "normal_rate_per_s": 6.0, "duration_s": 30.0}
    run = FakeRun(FakeScenario.from_dict(scenario), ShadowConfig(PluginRef("idle-first-host", args), seed=0))
    log = RoutedGrants()
    run.runtime.observers.add(log)
    run.run()
    assert log.plans > 0
    return log


@pytest.mark.parametrize(("args", "next_to_prefill", "next_to_decode"), [
    ({}, False, False),  # delta = 0: never a shadow token next to a routed call
    ({"routed_decode_margin": 0.1}, False, True),  # next to routed decodes only (their SLO slack)
    ({"imminent_margin": 0.1}, False, True),  # the same, while the first pending job is imminent
    ({"imminent_stretch": 0.5}, False, True),  # the same, up to 1.5x the iteration, decodes' pace aside
    ({"delta": 0.1}, True, True),  # a credit: the check does see shadow work next to routed prefills
])
def test_shadow_work_next_to_routed_calls(args: dict, next_to_prefill: bool, next_to_decode: bool) -> None:
    log = _routed_grants(args)
    assert (log.prefilling > 0, log.decoding > 0) == (next_to_prefill, next_to_decode), vars(log)


@pytest.mark.parametrize("first", [False, True])
def test_imminent_margin_grants_next_to_routed_decodes_only_to_an_imminent_first_job(first: bool) -> None:
    """imminent_margin alone (no routed_decode_margin): every plan next to a routed call starts its
    grant with a job whose session is in its tool gap (the manager's imminence, end to end); with
    imminent_first every plan is made so and keeps the contract's order rule, imminent grants first."""
    from shadowcore.testing.conformance import SMALL_SCENARIO
    from shadowcore.testing.contracts import plan_problems

    class Lead(RoutedGrants):
        def __init__(self, manager) -> None:
            super().__init__()
            self.manager, self.imminent, self.not_imminent = manager, 0, 0

        def on_plan(self, snapshot, plan) -> None:
            super().on_plan(snapshot, plan)
            assert plan.imminent_first is first
            assert not [p for p in plan_problems(snapshot, plan) if p.startswith("order")]
            if snapshot.has_routed and plan.grants:
                job = self.manager.job(plan.grants[0].job)
                assert plan.grants[0].imminent is job.imminent
                self.imminent += job.imminent
                self.not_imminent += not job.imminent

    scenario = {**SMALL_SCENARIO, "normal_rate_per_s": 6.0, "duration_s": 30.0}
    args = {"imminent_margin": 0.1, **({"imminent_first": True} if first else {})}
    run = FakeRun(FakeScenario.from_dict(scenario), ShadowConfig(PluginRef("idle-first-host", args), seed=0))
    log = Lead(run.runtime.manager)
    run.runtime.observers.add(log)
    run.run()
    assert run.runtime.manager.track_imminence
    assert log.imminent > 0 and log.not_imminent == 0 and log.prefilling == 0, vars(log)


def test_routed_decode_margin_keeps_every_slo_slack_budget_within_the_batch_slack() -> None:
    """With routed_decode_margin, an iteration next to routed decodes is budgeted by the batch's
    Eq. 1 slack (routed decodes included) and beta * T, never more (the core's slack rule)."""
    from shadowcore.testing.contracts import plan_problems

    class Strict(RoutedGrants):
        def __init__(self) -> None:
            super().__init__()
            self.problems: list[str] = []

        def on_plan(self, snapshot, plan) -> None:
            super().on_plan(snapshot, plan)
            self.problems.extend(plan_problems(snapshot, plan, strict=True))

    from shadowcore.testing.conformance import SMALL_SCENARIO

    scenario = {**SMALL_SCENARIO, "normal_rate_per_s": 6.0, "duration_s": 30.0}
    run = FakeRun(FakeScenario.from_dict(scenario),
                  ShadowConfig(PluginRef("idle-first-host", {"routed_decode_margin": 0.1}), seed=0))
    log = Strict()
    run.runtime.observers.add(log)
    run.run()
    assert log.decoding > 0 and not log.problems, log.problems[:3]


def test_reproduce_reports_item7s_policy_against_the_oracle() -> None:
    """reproduce's main study runs idle-first-host and imminent-host (item 7's policy), the models-per-router
    study idle-first-host, and its paper-comparison table has the item 7 rows for imminent-host (fed
    synthetic comparisons, no simulation)."""
    from shadow_sim.experiments.reproduce import ITEM7_POLICY, markdown, studies
    from shadow_sim.experiments.runner import COLUMNS, Comparison, policy_label

    assert ITEM7_POLICY == "imminent-host"
    results = {}
    for study, label, _fields, refs in studies(True):
        names = tuple(policy_label(r) for r in refs)
        gain = {n: {"imminent-host": 0.8, "idle-first-host": 0.7}.get(n, 0.5) for n in names}
        summary = {n: {**{key: (0.0, 0.0) for key, _title, _kind in COLUMNS}, "oracle_gain_switch": (gain[n], 0.0),
                       "energy_inc": (0.004, 0.0), "normal_slo_pp": (0.001, 0.0), "calls": (120.0, 0.0),
                       "switch_calls": (30.0, 0.0)} for n in names}
        results[f"{study}:{label}"] = (study, Comparison(label, names, names[0], "oracle-host", (), summary))
    assert {"idle-first-host", "imminent-host"} <= set(results["main:Q7/L70"][1].policies)
    assert "idle-first-host" in results["nmodels:N=5"][1].policies
    table = markdown(results, quick=True)
    assert "| imminent-host (ours) share of the oracle's switch-call gain, main pairs (target >= 75%) | ours | – | 80.0% |" \
        in table
    assert "| imminent-host (ours) energy per good request change, main pairs (target <= +1%) | ours | – | 0.4% |" \
        in table


def test_testbed_verdict_reads_point_files(tmp_path, capsys) -> None:
    """benchmarks/idle_first.py --testbed-points: the same-model TTFT ratio from the arms' mean TTFTs
    (all calls and switch calls), each arm against request-level on the points both ran."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "idle_first.py"
    spec = importlib.util.spec_from_file_location("idle_first_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def arm(ttft: float, switch_ttft: float, switch_red: float, slo_pp: float = 0.0) -> dict:
        return {"calls": 10.0, "switch_calls": 4.0, "ttft_s": ttft, "switch_ttft_s": switch_ttft,
                "switch_ttft_red": switch_red, "call_latency_red": 0.01, "switch_latency_red": 0.02,
                "normal_slo_pp": slo_pp}

    # no-shadow: same-model TTFT (10 * 1.0 - 4 * 1.6) / 6 = 0.6; ours (10 * 0.64 - 4 * 0.4) / 6 = 0.8
    point = {"pair": "L8/L70", "rho": 0.3, "seed": 7, "arms": {
        "no-shadow": arm(1.0, 1.6, 0.0), "request-level": arm(0.6, 0.4, 0.5), "ours": arm(0.64, 0.4, 0.6)}}
    (tmp_path / "p.json").write_text(json.dumps(point))
    from shadow_vllm.virtual import testbed

    assert testbed.same_model_ttft_s(point["arms"]["ours"]) == pytest.approx(0.8)
    assert bench.SAME_TTFT_BOUND == testbed.SAME_TTFT_BOUND
    assert bench.main(["--testbed-points", str(tmp_path / "p.json")]) == 1  # 0.8 / 0.6 = 1.33 > 1.05
    out = capsys.readouterr().out
    assert "MET     switch TTFT reduction 0.600 >= request-level's 0.500" in out
    assert "NOT MET same-model TTFT ratio 1.333 <= 1.05" in out
    point["arms"]["ours"] = arm(0.52, 0.4, 0.6)  # same-model (5.2 - 1.6) / 6 = 0.6: ratio 1
    (tmp_path / "p.json").write_text(json.dumps(point))
    assert bench.main(["--testbed-points", str(tmp_path / "p.json")]) == 0


def test_imminent_stretch_same_on_the_lazy_cohort_path() -> None:
    """imminent_stretch answers an aggregate snapshot (the simulator's skip check) with an upper bound
    of the full snapshot's budget, so the lazy-cohort path plans what the per-request path plans: the
    same calls and shadow tokens (no observer here: one would turn the lazy path off)."""
    # the speed-equivalence suite's fake case (its lazy cohort carries most iterations)
    scenario = {"duration_s": 30.0, "warmup_s": 5.0, "session_rate_per_s": 0.25, "calls_per_session": 6,
                "switch_probability": 0.4, "normal_rate_per_s": 2.5, "seed": 3}
    results = []
    for lazy in (True, False):
        run = FakeRun(FakeScenario.from_dict(scenario), ShadowConfig(
            PluginRef("idle-first-host", {"imminent_stretch": 1.0, "imminent_first": True}), seed=0))
        for inst in run.cluster.by_id.values():
            inst.lazy_decodes = lazy
        result = run.run()
        agg = sum(i.num_agg_iterations for i in run.cluster.by_id.values())
        counts = [dict(h.step_counts) for _, h in sorted(run.runtime.hooks.items())]
        results.append((result.calls, {i.instance_id: i.num_shadow_tokens for i in run.cluster.by_id.values()},
                        agg, counts))
    assert results[0][2] > 300 and results[1][2] == 0, results[0][2]
    assert results[0][:2] == results[1][:2] and sum(results[0][1].values()) > 0
