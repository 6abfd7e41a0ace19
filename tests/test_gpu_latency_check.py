"""benchmarks/gpu_latency_check.py in its dry mode (tiny shapes on the CPU):
every step runs, the two-phase path (predict here, measure there) gives the
same rows, and bad input is one clear error."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def check():
    pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("gpu_latency_check", ROOT / "benchmarks" / "gpu_latency_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dry_run_measures_every_shape_of_every_model(check, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert check.main(["--dry", "--models", "Qwen2.5-7B,Llama-3.1-70B", "--repeats", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    keys = {check.shape_key(s) for s in check.shapes(dry=True)}
    assert set(report["models"]) == {"Qwen2.5-7B", "Llama-3.1-70B"}
    for r in report["models"].values():
        assert set(r["measured_s"]) == keys
        assert all(v > 0 and math.isfinite(v) for v in r["measured_s"].values())
        assert all(math.isfinite(e) for e in r["error_iter"].values())
    assert report["models"]["Llama-3.1-70B"]["tp"] == 4
    text = capsys.readouterr().out
    assert "errors are meaningless" in text and "all-reduce" in text
    assert text.count("|error| median / p90") == 2


def test_predictions_file_round_trip_and_mode_mismatch(check, tmp_path):
    preds = tmp_path / "preds.json"
    assert check.main(["--dry", "--models", "Qwen2.5-7B", "--predict", str(preds)]) == 0
    assert check.main(["--dry", "--predictions", str(preds), "--repeats", "1"]) == 0
    with pytest.raises(SystemExit, match="made with --dry"):
        check.main(["--predictions", str(preds)])


def test_relative_errors_and_quantiles(check):
    errs = check.relative_errors({"a": 1.5, "b": 0.5, "c": None}, {"a": 1.0, "b": 1.0, "c": 2.0})
    assert errs == {"a": 0.5, "b": -0.5, "c": None}
    assert check.abs_quantiles([0.1, -0.2, 0.3, -0.4, 0.5, 0.6, 0.7, 0.8, 0.9, -1.0]) == (pytest.approx(0.55), 0.9)
    with pytest.raises(SystemExit, match="no entry for shape"):
        check.relative_errors({"a": 1.0}, {"a": 1.0, "z": 2.0})
