"""The paper's published numbers that ``reproduce`` puts next to ours, each with
the section it comes from (arXiv 2611.13176). Fractions, not percent."""

from __future__ import annotations

import math

#: key -> (value, where, what). Benchmarks = the 16 xRouteBench/FusionBench/Router-R1 pairs.
PAPER: dict[str, tuple[float, str, str]] = {
    "switch_latency_red": (0.104, "§5.2", "Harvest-SLO+Host switch-call latency reduction, benchmark pairs"),
    "switch_latency_red_oracle": (0.193, "§5.2", "Oracle switch-call latency reduction bound, benchmark pairs"),
    "oracle_gain_switch": (0.54, "§5.2", "share of the oracle's switch-call gain captured, benchmark pairs"),
    "switch_ttft_red": (0.441, "§5.2", "Harvest-SLO+Host switch-call TTFT reduction, benchmark pairs"),
    "call_latency_red": (0.050, "§5.2", "Harvest-SLO+Host LLM-call latency reduction, benchmark pairs"),
    "call_latency_red_oracle": (0.096, "§5.2", "Oracle LLM-call latency reduction bound, benchmark pairs"),
    "hit_rate_base": (0.750, "§5.2", "token-weighted hit rate, No Shadow, benchmark pairs"),
    "hit_rate": (0.821, "§5.2", "token-weighted hit rate, Harvest-SLO+Host, benchmark pairs"),
    "hit_rate_oracle": (0.844, "§5.2", "token-weighted hit rate, Oracle+Host, benchmark pairs"),
    "task_time_red": (0.049, "§5.2", "LLM time per task reduction, benchmark pairs"),
    "token_cost_red": (0.285, "§5.2", "routed token cost reduction, benchmark pairs"),
    "harvest_switch_latency_red": (0.069, "§5.2", "Harvest (fixed credit) switch-call latency reduction"),
    "harvest_slo_switch_latency_red": (0.088, "§5.2", "Harvest-SLO switch-call latency reduction"),
    "prefill_tput_inc": (0.038, "§5.4", "total prefill throughput incl. shadow tokens, Harvest-SLO+Host"),
    "energy_inc": (0.004, "§5.4", "energy per good request, Harvest-SLO+Host"),
    "normal_slo_pp_low": (0.0010, "§5.4", "normal-traffic SLO attainment change, low end (points/100)"),
    "normal_slo_pp_high": (0.0040, "§5.4", "normal-traffic SLO attainment change, high end (points/100)"),
    "unused_shadow_share": (0.63, "Appendix E", "shadow tokens never used, Harvest-SLO+Host, N=2"),
    "load_harvest_slo_rho02": (0.044, "§5.5 / Fig. 9e", "Harvest-SLO LLM-call reduction at rho=0.2"),
    "load_harvest_slo_rho09": (0.007, "§5.5 / Fig. 9e", "Harvest-SLO LLM-call reduction at rho=0.9"),
    "load_hsh_rho09": (0.152, "§5.5 / Fig. 9e", "Harvest-SLO+Host LLM-call reduction at rho=0.9"),
    "switchrate_hsh_low": (-0.002, "Appendix C / Fig. 15a", "Harvest-SLO+Host LLM-call reduction, 0.5 switches/session"),
    "switchrate_hsh_high": (0.058, "Appendix C / Fig. 15a", "Harvest-SLO+Host LLM-call reduction, 5 switches/session"),
    "n5_all_call_red": (0.063, "Appendix C / Fig. 16d", "N=5, shadow to all targets: LLM-call reduction"),
    "n5_top1_call_red": (0.046, "Appendix C / Fig. 16d", "N=5, top-1 target: LLM-call reduction"),
    "n5_all_unused": (0.890, "Appendix C / Fig. 16e", "N=5, all targets: unused shadow tokens"),
    "n5_top1_unused": (0.730, "Appendix C / Fig. 16e", "N=5, top-1 target: unused shadow tokens"),
    "n2_unused": (0.686, "Appendix C / Fig. 16e", "N=2: unused shadow tokens"),
}

#: Appendix D.1: capacity per instance (requests/s) on the H100 testbed.
TESTBED_CAPACITY: dict[str, float] = {
    "Qwen2.5-7B": 12.8, "Llama-3.1-8B": 11.0, "Llama-3.1-70B": 3.8,
    "SWE-agent-LM-7B": 13.3, "SWE-agent-LM-32B": 4.8, "Qwen2.5-72B": 3.8,
}

#: The GPU testbed's numbers (Section 6, Appendix D; ``reproduce --testbed``): key -> (paper value,
#: where, what); fractions. "dir" rows compare a sign only.
PAPER_TESTBED: dict[str, tuple[float, str, str]] = {
    "switch_ttft_red": (0.619, "§6 / Fig. 10", "switch-call TTFT reduction, mean over pairs"),
    "task_time_red_fb": (0.121, "§6", "LLM time per task reduction, FusionBench pairs"),
    "task_time_red_all": (0.070, "§6", "LLM time per task reduction, all pairs"),
    "token_cost_red": (0.204, "§6 / Fig. 12", "routed token cost reduction, mean over pairs"),
    "energy_inc": (0.014, "§6 / Fig. 13", "energy per SLO-compliant request, change"),
    "call_latency_red_q7": (0.137, "Fig. 11 / 17", "LLM-call latency reduction, Q7/L70, rho 0.3"),
    "call_latency_red_l8": (0.106, "Fig. 11 / 17", "LLM-call latency reduction, L8/L70, rho 0.3"),
    "rho05_fb_keeps": (1.0, "App. D / Fig. 17", "rho 0.5: FusionBench pairs keep a reduction (sign)"),
    "rho05_s32_slows": (-1.0, "App. D / Fig. 17", "rho 0.5: S7/S32 slows (sign; paper -35.1%)"),
}

# -- judging ours against the paper's (shared by ``reproduce`` and ``reproduce --testbed``) --

#: Issue 16's bar: ours within +-30% of the paper's number, relative to the paper's.
TOLERANCE = 0.30


def verdict(paper: float, value: float, sign_only: bool = False, tolerance: float = TOLERANCE) -> str:
    """``value`` judged against ``paper``: "within 30%" when ``|value - paper| <= tolerance x
    |paper|`` (so a paper number of 0 needs ours exactly 0), else "outside 30%"; with
    ``sign_only`` (rows that publish a direction) "same direction" or "opposite" by sign; a NaN
    ``value`` (not measured) is "not run". The percent in the text is ``tolerance``'s."""
    if value is None or math.isnan(value):
        return "not run"
    if sign_only:
        return "same direction" if math.copysign(1.0, value) == math.copysign(1.0, paper) else "opposite"
    word = "within" if abs(value - paper) <= tolerance * abs(paper) else "outside"
    return f"{word} {100 * tolerance:.0f}%"
