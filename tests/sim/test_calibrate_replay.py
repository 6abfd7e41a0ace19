"""Calibrate as you replay (issue 14 item 5): a bursty trace calibrated by
replaying its peak window, time-scaled, runs at the normal SLO attainment the
calibration promised (within 3 points), where Poisson calibration of the same
trace promises far more than the replay gets. The run reports both."""

from __future__ import annotations

import json

from shadow_sim.experiments import calibrate as cal
from shadow_sim.experiments.runner import (
    compare,
    format_table,
    run_comparison_records,
    summary_json,
    tasks_for,
    with_progress,
)
from shadow_sim.experiments.spec import Experiment

from shadowcore.config import PluginRef

BURST, PERIOD_MS, BURSTS = 24, 10_000, 12  # 24 requests within 0.1 s every 10 s
SETTINGS = cal.ProbeSettings(warmup_s=5.0, measure_s=40.0, start_per_s=2.0, rel_tol=0.05)
BASE = {"latency": "roofline", "instances_per_model": 1, "warmup_s": 10.0, "drain_s": 10.0,
        "session_rate_per_s": 0.01, "models": ["Llama-3.1-8B", "Qwen2.5-7B"], "preset": "",
        "scenario": {"calls_per_session": 3, "input_tokens_median": 300, "output_tokens_median": 30}}
RHO = 0.9


def bursty_trace(path):
    rows = [{"timestamp": b * PERIOD_MS + k * 5, "input_length": 800 + 97 * ((b * BURST + k) % 13),
             "output_length": 40 + 7 * ((b + k) % 9)} for b in range(BURSTS) for k in range(BURST)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def _experiment(source: str, kind: str, duration_s: float = 60.0) -> Experiment:
    return Experiment.from_dict({**BASE, "duration_s": duration_s,
                                 "normal": {"kind": kind, "source": source, "rho": RHO}})


def test_a_bursty_trace_calibrated_by_replay_runs_at_its_promised_attainment(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SHADOWPREFILL_CACHE", str(tmp_path / "cache"))
    source = bursty_trace(tmp_path / "bursty.jsonl")
    replay = _experiment(source, "trace")
    caps = cal.capacities(replay, SETTINGS)
    poisson_caps = cal.capacities(_experiment(source, "poisson"), SETTINGS)
    assert cal._key(replay, "Llama-3.1-8B", SETTINGS) != cal._key(_experiment(source, "poisson"), "Llama-3.1-8B",
                                                                  SETTINGS)  # the arrival process is in the key
    for m, c in caps.items():  # the bursts bind: replay calibration provisions for them
        assert c.capacity_per_s < 0.8 * poisson_caps[m].capacity_per_s, (m, c, poisson_caps[m])
    # measure two whole passes of the scaled window, so the run sees every burst as the probe did
    span = BURST * BURSTS / (RHO * min(c.capacity_per_s for c in caps.values()))
    ex = _experiment(source, "trace", duration_s=2 * span)
    c, _tasks, _records = run_comparison_records(ex, ["no-shadow"], settings=SETTINGS)
    promise = c.promise
    assert promise is not None and promise["arrivals"] == "replay-peak"
    got = c.summary["no-shadow"]["normal_slo_attainment"][0]
    assert promise["got"]["no-shadow"] == got
    assert abs(got - promise["promised"]) <= 0.03, promise
    assert promise["line"] in format_table(c) and summary_json(c)["normal_slo_promise"]["promised"] == \
        promise["promised"]

    # Poisson calibration of the same trace promises more than the replay at its capacity gets, by far
    pcaps = {m: x.capacity_per_s for m, x in poisson_caps.items()}
    pois = cal.promise(_experiment(source, "poisson"), pcaps, settings=SETTINGS)
    pspan = BURST * BURSTS / (RHO * min(pcaps.values()))
    tasks = tasks_for(_experiment(source, "trace", duration_s=2 * pspan), [PluginRef("no-shadow")], [0], ["peak"],
                      pcaps)
    pc = compare(with_progress(tasks, 1, False), tasks)[""]
    assert pc.summary["no-shadow"]["normal_slo_attainment"][0] < pois.attainment - 0.1
