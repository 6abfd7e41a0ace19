"""Latency profiles (shadowcore.calibration): the wrapped model keeps the
LatencyModel invariants, fits recover known profiles exactly, files and step
logs give one error naming file, line and field."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shadowcore.calibration import (
    CalibratedLatencyModel,
    LatencyProfile,
    MeasuredStep,
    fit_linear,
    fit_profile,
    nnls,
    prediction_errors,
    read_steps,
    write_steps,
)
from shadowcore.errors import ConfigError
from shadowcore.latency import BatchShape, LinearLatencyModel, PrefillChunk
from shadowcore.testing import strategies as sst

PROFILE = LatencyProfile("t", prefill_scale=1.8, decode_scale=1.2, iteration_overhead_s=0.004, per_sequence_s=3e-5)
profiles = st.builds(LatencyProfile, st.just("p"), st.floats(1, 4), st.floats(1, 4), st.floats(0, 0.02),
                     st.floats(0, 1e-4))


def _steps(model, n=40, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prefills = tuple(PrefillChunk(int(rng.integers(1, 2048)), int(rng.integers(0, 8192)))
                         for _ in range(int(rng.integers(0, 3))))
        decodes = tuple(int(c) for c in rng.integers(1, 4096, size=int(rng.integers(0 if prefills else 1, 64))))
        b = BatchShape(prefills, decodes)
        out.append(MeasuredStep(b, model.predict_s(b)))
    return out


def test_identity_profile_is_the_base_model_itself():
    base = LinearLatencyModel()
    assert LatencyProfile().apply(base) is base
    assert isinstance(PROFILE.apply(base), CalibratedLatencyModel)


@settings(max_examples=200, deadline=None)
@given(sst.latency_models(), profiles, sst.batch_shapes(), sst.prefill_chunks(), st.integers(0, 4096))
def test_calibrated_model_is_monotone_and_empty_is_zero(base, profile, batch, chunk, ctx):
    m = profile.apply(base)
    assert m.predict_s(BatchShape()) == 0.0
    t = m.predict_s(batch)
    assert m.predict_s(batch.with_prefills((chunk,))) >= t
    assert m.predict_s(BatchShape(batch.prefills, batch.decode_context_tokens + (ctx,))) >= t


@settings(max_examples=100, deadline=None)
@given(sst.latency_models(), profiles, st.integers(1, 64), st.integers(1, 4096))
def test_decode_fast_path_is_bit_identical(base, profile, n, ctx):
    m = profile.apply(base)
    decodes = tuple(ctx + i for i in range(n))
    assert m.predict_decodes_s(n, sum(decodes), max(decodes)) == m.predict_s(BatchShape((), decodes))


def test_fit_profile_recovers_a_known_profile():
    base = LinearLatencyModel()
    fitted = fit_profile(base, _steps(PROFILE.apply(base)))
    for f in ("prefill_scale", "decode_scale", "iteration_overhead_s", "per_sequence_s"):
        assert getattr(fitted, f) == pytest.approx(getattr(PROFILE, f), rel=1e-6, abs=1e-12), f
    assert np.max(np.abs(prediction_errors(fitted.apply(base), _steps(PROFILE.apply(base), seed=1)))) < 1e-9


def test_fit_never_goes_below_the_kernels():
    base = LinearLatencyModel()
    faster = [MeasuredStep(s.batch, 0.5 * s.duration_s) for s in _steps(base)]
    fitted = fit_profile(base, faster)
    assert fitted.prefill_scale == 1.0 and fitted.decode_scale == 1.0 and fitted.iteration_overhead_s == 0.0


def test_fit_linear_recovers_a_known_model():
    truth = LinearLatencyModel(0.002, 3e-5, 2e-9, 7e-5, 3e-8)
    fitted = fit_linear(_steps(truth))
    for f in ("overhead_s", "prefill_s_per_token", "attention_s_per_token_pair", "decode_s_per_seq",
              "decode_s_per_context_token"):
        assert getattr(fitted, f) == pytest.approx(getattr(truth, f), rel=1e-5), f


def test_nnls_matches_the_unconstrained_fit_when_feasible_and_clips_otherwise():
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert nnls(a, a @ np.array([2.0, 3.0])) == pytest.approx([2.0, 3.0])
    x = nnls(a, np.array([-1.0, 2.0, 1.0]))
    assert x[0] == 0.0 and x[1] > 0


def test_profile_file_round_trip_and_errors(tmp_path):
    p = tmp_path / "profile.json"
    PROFILE.write(p)
    assert LatencyProfile.from_file(p) == PROFILE
    p.write_text(json.dumps({"prefill_scale": 0.5}))
    with pytest.raises(ConfigError, match=r"profile.json.prefill_scale = 0.5: must be a finite number >= 1"):
        LatencyProfile.from_file(p)
    p.write_text(json.dumps({"prefil_scale": 2}))
    with pytest.raises(ConfigError, match=r"prefil_scale.*unknown field"):
        LatencyProfile.from_file(p)
    p.write_text('{"prefill_scale": 2,\n  oops}')
    with pytest.raises(ConfigError, match=r"profile.json:2:3.*not JSON"):
        LatencyProfile.from_file(p)


def test_steps_file_round_trip_and_errors(tmp_path):
    steps = _steps(LinearLatencyModel(), n=5)
    f = tmp_path / "steps.jsonl"
    write_steps(f, steps)
    assert read_steps(f) == steps
    f.write_text('{"decodes": [10], "duration_s": 0.01}\n{"decodes": [10], "duration_s": -1}\n')
    with pytest.raises(ConfigError, match=r"steps.jsonl:2:duration_s = -1"):
        read_steps(f)
    f.write_text('{"prefills": [[10]], "duration_s": 0.01}\n')
    with pytest.raises(ConfigError, match=r"steps.jsonl:1:prefills"):
        read_steps(f)
    f.write_text('{"decodes": [], "duration_s": 0.01}\n')
    with pytest.raises(ConfigError, match=r"steps.jsonl:1.*no tokens"):
        read_steps(f)
