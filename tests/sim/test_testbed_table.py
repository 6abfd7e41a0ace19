"""The testbed table's arithmetic (:mod:`shadow_vllm.virtual.testbed`): the paper's
averages over pairs, the +-30% verdict and the rho 0.5 directions. No vLLM run."""

from __future__ import annotations

import math

from shadow_vllm.virtual import testbed


def _point(switch_ttft: float, task: float, cost: float, energy: float, call: float) -> dict:
    m = {"switch_ttft_red": switch_ttft, "task_time_red": task, "token_cost_red": cost, "energy_inc": energy,
         "call_latency_red": call}
    return {"request-level": m}


def test_ours_averages_pairs_as_the_paper_does() -> None:
    results = {("Q7/L70", 0.3): _point(0.6, 0.10, 0.2, 0.01, 0.12), ("L8/L70", 0.3): _point(0.7, 0.14, 0.3, 0.02, 0.1),
               ("S7/S32", 0.3): _point(0.5, 0.0, 0.1, 0.03, 0.0), ("Q7/L70", 0.5): _point(0, 0, 0, 0, 0.05),
               ("L8/L70", 0.5): _point(0, 0, 0, 0, 0.02), ("S7/S32", 0.5): _point(0, 0, 0, 0, -0.3)}
    o = testbed.ours(results, "request-level")
    assert math.isclose(o["switch_ttft_red"], 0.6) and math.isclose(o["task_time_red_fb"], 0.12)
    assert math.isclose(o["task_time_red_all"], 0.08) and math.isclose(o["energy_inc"], 0.02)
    assert o["call_latency_red_q7"] == 0.12 and o["rho05_fb_keeps"] == 1.0 and o["rho05_s32_slows"] == -1.0
    results[("L8/L70", 0.5)] = _point(0, 0, 0, 0, -0.01)  # one FusionBench pair slows: not kept
    assert testbed.ours(results, "request-level")["rho05_fb_keeps"] == -1.0
    assert math.isnan(testbed.ours(results, "harvest-slo")["rho05_fb_keeps"])  # an arm not run at 0.5: no sign
    assert "harvest-slo" not in testbed.per_point_table(results, ("no-shadow", "request-level", "harvest-slo"))


def test_verdict_is_thirty_percent_relative() -> None:
    assert testbed.verdict(0.619, 0.619 * 1.29, False) == "within 30%"
    assert testbed.verdict(0.619, 0.619 * 0.69, False) == "outside 30%"
    assert testbed.verdict(0.014, -0.004, False) == "outside 30%"
    assert testbed.verdict(-1.0, -1.0, True) == "same direction" and testbed.verdict(-1.0, 1.0, True) == "opposite"
    assert testbed.verdict(0.1, math.nan, False) == "not run"
    table = testbed.table({("L8/L70", 0.3): _point(0.5, 0.1, 0.2, 0.01, 0.1)}, ("no-shadow", "request-level"))
    assert "| 61.9% | 50.0% | within 30% |" in table and "not run" in table


def test_switch_ttft_share_bounds_the_task_time_reduction() -> None:
    m = {"calls": 10.0, "call_latency_s": 2.0, "switch_calls": 2.0, "switch_ttft_s": 1.5}
    assert math.isclose(testbed.switch_ttft_share(m), 3.0 / 20.0)
    assert math.isnan(testbed.switch_ttft_share({}))
    table = testbed.per_point_table({("L8/L70", 0.3): {"no-shadow": m}}, ("no-shadow",))
    assert "| 15.0% |" in table


def test_item7_table_judges_each_engine_level_arm_against_request_level() -> None:
    """Item 7's testbed bar: switch-call TTFT reduction at least request-level's, same-model TTFT (summed,
    from the means over all and over switch calls) at most 1.05x no-shadow's, normal SLO not lower."""
    def arm(ttft: float, switch_ttft: float, switch_red: float, slo_pp: float = 0.0) -> dict:
        return {"calls": 10.0, "switch_calls": 4.0, "ttft_s": ttft, "switch_ttft_s": switch_ttft,
                "switch_ttft_red": switch_red, "normal_slo_pp": slo_pp}

    # same-model TTFT: no-shadow (10 - 6.4) / 6 = 0.6, request-level (6 - 1.6) / 6 = 0.733; "ok" 0.6; "slow" 0.8
    seed = {"no-shadow": arm(1.0, 1.6, 0.0), "request-level": arm(0.6, 0.4, 0.5),
            "ok": arm(0.52, 0.4, 0.5), "slow": arm(0.64, 0.4, 0.6), "short": arm(0.52, 0.4, 0.49, -0.01)}
    derived = testbed.with_same_ttft_sum(seed)
    assert math.isclose(derived["slow"]["same_ttft_sum"], 4.8)
    table = testbed.item7_table({("L8/L70", 0.3): derived}, tuple(seed))
    assert "| L8/L70 | 0.3 | ok | 50.0% (50.0%) | 1.000 (1.222) | +0.00 | met |" in table
    assert "| slow | 60.0% (50.0%) | 1.333 (1.222) | +0.00 | not met (same-model TTFT) |" in table
    assert "| short | 49.0% (50.0%) | 1.000 (1.222) | -1.00 | not met (switch TTFT, normal SLO) |" in table
    assert "request-level |" not in table.split("\n", 2)[2]  # only engine-level arms are judged
