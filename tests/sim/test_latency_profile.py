"""Latency profiles in the simulator: the identity profile changes nothing (bit
for bit), a slower profile slows the run and lowers the calibrated capacity,
the calibration cache keys on the profile, and `shadowprefill latency
calibrate` recovers a profile from measured steps."""

from __future__ import annotations

import json

import pytest
from shadow_sim import latency_cli
from shadow_sim.experiments import calibrate as cal
from shadow_sim.experiments.spec import Experiment
from shadow_sim.latency import latency_model, resolve_profile, shipped_profiles
from shadow_sim.simulator import SimRun, SimScenario

from shadowcore.calibration import LatencyProfile, MeasuredStep, write_steps
from shadowcore.config import PluginRef, ShadowConfig
from shadowcore.errors import ConfigError
from shadowcore.latency import BatchShape, PrefillChunk

SMALL = {"latency": "roofline", "instances_per_model": 1, "duration_s": 40.0, "warmup_s": 5.0,
         "session_rate_per_s": 0.3, "normal_rate_per_s": 2.0}
TINY = {"latency": "roofline", "instances_per_model": 1, "duration_s": 30.0, "warmup_s": 5.0, "drain_s": 5.0,
        "session_rate_per_s": 0.4, "models": ["Llama-3.1-8B", "Qwen2.5-7B"]}


def _run(**extra):
    return SimRun(SimScenario.from_dict({**SMALL, **extra}), ShadowConfig(PluginRef("harvest-slo-host"))).run()


def test_identity_profile_is_bit_identical_and_a_slow_one_is_slower(tmp_path):
    plain = _run()
    path = tmp_path / "identity.json"
    LatencyProfile().write(path)
    assert _run(latency_profile=str(path)).metrics == plain.metrics
    slow = tmp_path / "slow.json"
    LatencyProfile("slow", prefill_scale=2.0, iteration_overhead_s=0.005).write(slow)
    slower = _run(latency_profile=str(slow))
    assert slower.metrics["call_latency_s"] > plain.metrics["call_latency_s"]
    assert slower.metrics["switch_ttft_s"] > plain.metrics["switch_ttft_s"]


def test_bad_profile_is_one_error_before_anything_runs(tmp_path):
    with pytest.raises(ConfigError, match="latency_profile = 'no-such'.*shipped profile"):
        SimScenario.from_dict({**SMALL, "latency_profile": "no-such"})
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"decode_scale": 0.9}))
    with pytest.raises(ConfigError, match="bad.json.decode_scale = 0.9"):
        Experiment.from_dict({**TINY, "latency_profile": str(bad)})


def test_shipped_profiles_load():
    for name in shipped_profiles():
        p = resolve_profile(name)
        assert not p.is_identity and p.source


def test_calibration_keys_on_the_profile_and_a_slower_engine_has_less_capacity(tmp_path, monkeypatch):
    monkeypatch.setenv("SHADOWPREFILL_CACHE", str(tmp_path))
    slow = tmp_path / "slow.json"
    LatencyProfile("slow", prefill_scale=3.0, iteration_overhead_s=0.01).write(slow)
    settings = cal.ProbeSettings(warmup_s=2.0, measure_s=12.0, start_per_s=4.0, rel_tol=0.2)
    plain = Experiment.from_dict(TINY)
    calibrated = Experiment.from_dict({**TINY, "latency_profile": str(slow)})
    identity = tmp_path / "identity.json"
    LatencyProfile().write(identity)
    assert cal._key(plain, "Llama-3.1-8B", settings) == cal._key(
        Experiment.from_dict({**TINY, "latency_profile": str(identity)}), "Llama-3.1-8B", settings)
    assert cal._key(plain, "Llama-3.1-8B", settings) != cal._key(calibrated, "Llama-3.1-8B", settings)
    fast = cal.calibrate(plain, "Llama-3.1-8B", settings)
    slowed = cal.calibrate(calibrated, "Llama-3.1-8B", settings)
    assert slowed.capacity_per_s < fast.capacity_per_s


def test_latency_calibrate_command_recovers_a_profile(tmp_path, capsys):
    truth = LatencyProfile("truth", prefill_scale=1.6, decode_scale=1.1, iteration_overhead_s=0.003)
    engine = truth.apply(latency_model("Llama-3.1-8B", "H100-80GB", 1, kind="roofline"))
    shapes = [BatchShape((PrefillChunk(q, c),), ()) for q in (256, 1024, 2048) for c in (0, 4096)]
    shapes += [BatchShape((), (ctx,) * b) for b in (1, 8, 64) for ctx in (512, 4096)]
    shapes += [BatchShape((PrefillChunk(512, 0),), (2048,) * 16)]
    steps = tmp_path / "steps.jsonl"
    write_steps(steps, [MeasuredStep(b, engine.predict_s(b)) for b in shapes])
    out = tmp_path / "fit.json"
    assert latency_cli.main(["calibrate", "--steps", str(steps), "--model", "Llama-3.1-8B", "--latency",
                             "roofline", "-o", str(out)]) == 0
    fit = LatencyProfile.from_file(out)
    assert fit.prefill_scale == pytest.approx(1.6, rel=1e-6) and fit.decode_scale == pytest.approx(1.1, rel=1e-6)
    assert fit.iteration_overhead_s == pytest.approx(0.003, rel=1e-6) and fit.name == "fit"
    text = capsys.readouterr().out
    assert "with the fitted profile:  median 0.0%" in text
    linear = tmp_path / "linear.json"
    assert latency_cli.main(["calibrate", "--steps", str(steps), "--base", "linear", "-o", str(linear)]) == 0
    assert json.loads(linear.read_text())["name"] == "linear"
    assert latency_cli.main(["calibrate", "--steps", str(tmp_path / "missing.jsonl"), "--base", "linear"]) == 2
