"""``reproduce``'s side-by-side table: each paper number, ours, +-1 SE over pairs and the
+-30% verdict (one helper, shared with ``--testbed``), and the flags that run part of the
grid. Fed synthetic comparisons; nothing is simulated."""

from __future__ import annotations

import math

import pytest
from shadow_sim.experiments import reproduce
from shadow_sim.experiments.paper_numbers import PAPER, verdict
from shadow_sim.experiments.runner import COLUMNS, Comparison

from shadowcore.errors import ConfigError


def test_verdict_is_relative_to_the_paper() -> None:
    assert verdict(0.104, 0.104 * 1.29) == "within 30%" and verdict(0.104, 0.104 * 0.71) == "within 30%"
    assert verdict(0.104, 0.104 * 1.31) == "outside 30%" and verdict(0.104, -0.104) == "outside 30%"
    assert verdict(0.0, 0.0) == "within 30%" and verdict(0.0, 1e-9) == "outside 30%"
    assert verdict(0.104, math.nan) == "not run"
    assert verdict(-1.0, -0.5, sign_only=True) == "same direction" and verdict(1.0, -2.0, True) == "opposite"
    assert verdict(0.1, 0.115, tolerance=0.1) == "outside 10%"


def _comparison(label: str, values: dict[str, dict[str, tuple[float, float]]]) -> Comparison:
    names = ("no-shadow", *values)
    summary = {n: {**{key: (0.0, 0.0) for key, _t, _k in COLUMNS}, "calls": (100.0, 0.0),
                   "switch_calls": (25.0, 0.0)} for n in names}
    for name, metrics in values.items():
        summary[name].update(metrics)
    return Comparison(label, names, "no-shadow", "oracle-host", (), summary)


def _results() -> dict[str, tuple[str, Comparison]]:
    a = _comparison("A", {"harvest-slo-host": {"switch_latency_red": (0.12, 0.01), "switch_ttft_red": (0.10, 0.02),
                                               "oracle_gain_switch": (0.8, 0.0), "energy_inc": (0.0, 0.0)},
                          "oracle-host": {"switch_latency_red": (0.19, 0.01)}})
    b = _comparison("B", {"harvest-slo-host": {"switch_latency_red": (0.10, 0.02), "switch_ttft_red": (0.12, 0.02),
                                               "oracle_gain_switch": (0.7, 0.0), "energy_inc": (0.0, 0.0)},
                          "oracle-host": {"switch_latency_red": (0.21, 0.01)}})
    return {"main:A": ("main", a), "main:B": ("main", b)}


def _row(text: str, what: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(f"| {what} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_table_has_ours_se_and_verdict_per_paper_number() -> None:
    text = reproduce.markdown(_results(), quick=False)
    assert "| what | where | paper | ours | ±1 SE | within ±30%? |" in text
    sw = _row(text, PAPER["switch_latency_red"][2])
    assert sw[2:] == ["10.4%", "11.0%", f"±{100 * math.sqrt(0.01 ** 2 + 0.02 ** 2) / 2:.1f}", "within 30%"]
    ttft = _row(text, PAPER["switch_ttft_red"][2])
    assert ttft[2:4] == ["44.1%", "11.0%"] and ttft[5] == "outside 30%"
    bound = _row(text, PAPER["switch_latency_red_oracle"][2])  # read from oracle-host, the gain's oracle
    assert bound[2:4] == ["19.3%", "20.0%"] and bound[5] == "within 30%"
    assert _row(text, PAPER["hit_rate_base"][2])[5] == "outside 30%"  # 0 against 75%
    assert _row(text, PAPER["load_hsh_rho09"][2])[3:] == ["n/a", "–", "not run"]  # no load study here
    policy = _row(text, "harvest-slo-host")
    assert policy[1] == "11.0% ±1.1" and policy[-1] == "met"  # gain 75%, SLO 0, energy 0


def test_item7_bar_names_what_it_misses() -> None:
    assert reproduce.item7(0.75, 0.0, 0.01) == "met"
    assert reproduce.item7(0.74, -0.001, 0.02) == "not met (gain, SLO, energy)"
    assert reproduce.item7(math.nan, 0.0, 0.0) == "n/a"


def test_grid_cuts_studies_pairs_and_policies() -> None:
    grid = reproduce.Grid(studies=("main",), pairs=("Q7/L70",), seeds=(3, 4), windows=("trough",),
                          only=("no-shadow", "oracle-host"))
    chosen = reproduce.selected(False, None, (), grid)
    assert [(s, label) for s, label, _f, _r in chosen] == [("main", "Q7/L70")]
    assert [r.name for r in chosen[0][3]] == ["no-shadow", "oracle-host"]
    assert chosen[0][2]["instances_per_model"] == 4 and chosen[0][2]["duration_s"] == 600.0
    assert grid.seeds_for(False) == (3, 4) and grid.windows_for(True) == ("trough",)
    assert reproduce.Grid().seeds_for(False) == (0, 1, 2) and reproduce.Grid().windows_for(True) == ("peak",)
    assert "REDUCED grid: studies main; main pairs Q7/L70" in grid.describe(False)
    with pytest.raises(ConfigError, match="no-shadow"):
        reproduce.selected(False, None, (), reproduce.Grid(only=("oracle-host",)))
    with pytest.raises(ConfigError, match="unknown here: benefit-host"):
        reproduce.selected(False, None, (), reproduce.Grid(studies=("load",), only=("no-shadow", "benefit-host")))


@pytest.mark.parametrize("argv, message", [
    (["--pairs", "Q7/L70,X/Y"], "--pairs"), (["--seeds", "0,a"], "--seeds"), (["--windows", "noon"], "--windows"),
    (["--studies", ""], "--studies"), (["--latency-profile", "no-such"], "--latency-profile"),
    (["--only-policies", "harvest-slo-host"], "--only-policies"), (["--rhos", "0.3"], "--rhos needs --testbed"),
    (["--testbed", "--windows", "peak"], "--windows is for the simulator grid"),
    (["--latency-profile", "none", "--set", '{"latency_profile": ""}'], "give one"),
])
def test_bad_flags_fail_before_anything_runs(argv, message, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(reproduce, "run_all", lambda *a, **k: pytest.fail("ran"))
    assert reproduce.main([*argv, "--out", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err


def test_latency_profile_reaches_every_study(tmp_path, monkeypatch) -> None:
    seen = {}

    def stop(quick, jobs, override=None, **kwargs):
        seen.update(override=override, grid=kwargs["grid"])
        raise ConfigError("stop", 0, "here")

    monkeypatch.setattr(reproduce, "run_all", stop)
    reproduce.main(["--latency-profile", "paper-testbed-h100", "--studies", "main", "--seeds", "1",
                    "--out", str(tmp_path)])
    assert seen["override"] == {"latency_profile": "paper-testbed-h100"}
    assert seen["grid"].studies == ("main",) and seen["grid"].seeds == (1,)


def test_bounds_table_reads_the_baseline_runs() -> None:
    m = {"calls": 100.0, "switch_calls": 25.0, "call_latency_s": 1.25, "switch_latency_s": 2.0, "switch_ttft_s": 0.5}
    c = _comparison("A", {"oracle-host": {"switch_latency_red": (0.2, 0.0), "call_latency_red": (0.05, 0.0)}})
    c = Comparison("A", c.policies, "no-shadow", "oracle-host", ((0, "peak", {"no-shadow": m}),), c.summary)
    assert "| A | 25.0% | 25.0% | 20.0% | 5.0% | 1 |" in reproduce.markdown({"main:A": ("main", c)}, quick=True)


def test_testbed_takes_the_latency_profile(tmp_path, monkeypatch) -> None:
    testbed = pytest.importorskip("shadow_vllm.virtual.testbed")
    seen = []

    def stop(settings, **kwargs):
        seen.append(settings.latency_profile)
        raise ConfigError("stop", 0, "here")

    monkeypatch.setattr(testbed, "run_all", stop)
    for flag, want in ((["--latency-profile", "none"], ""), ([], "paper-testbed-h100")):
        assert reproduce.main(["--testbed", "--quick", *flag, "--out", str(tmp_path)]) == 2
        assert seen.pop() == want
