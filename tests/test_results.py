"""Results you can look at: ``simulate --out`` writes a result folder
(per-call Parquet, summary JSON, table, PNG plots), ``plot`` redraws it or
compares two, and the terminal table fits 120 columns with a legend,
reductions against no-shadow, variants named ``name(k=v)``, and a policy that
planned nothing marked."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("matplotlib")

import pyarrow.parquet as pq

from shadowcore.cli import main

PNG = b"\x89PNG\r\n\x1a\n"
PLOTS = ("cdf_switch_ttft.png", "cdf_switch_latency.png", "reductions.png")


def _simulate(out, capsys, *policies: str) -> tuple[str, str]:
    argv = ["simulate", "--backend", "fake", "--duration", "40", "--out", str(out)]
    for p in policies:
        argv += ["--policy", p]
    assert main(argv) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


def test_simulate_out_writes_the_folder_and_a_table_that_fits(tmp_path, capsys) -> None:
    out, err = _simulate(tmp_path / "a", capsys, 'harvest-slo:{"beta": 0.25}', "harvest-slo")
    assert "adding no-shadow" in err  # the baseline is added, and said so
    table = [line for line in out.splitlines() if not line.startswith(("warning:", "wrote"))]
    assert table[0].startswith("policy") and max(map(len, table)) <= 120
    rows = {line.split()[0]: line for line in table[2:5]}
    assert set(rows) == {"no-shadow", "harvest-slo(beta=0.25)!", "harvest-slo"}  # variant named, no-op marked
    assert any("reductions against no-shadow" in line for line in table)
    assert any(line.strip().startswith("sw TTFT red") and "against no-shadow" in line for line in table)
    assert "warning: policy 'harvest-slo'" in out and "n_min 256 predicted 9.4 ms > idle budget 6.25 ms" in out

    folder = tmp_path / "a"
    calls = pq.read_table(folder / "calls.parquet").to_pylist()
    summary = json.loads((folder / "summary.json").read_text())
    comp = summary["comparisons"][""]
    assert comp["baseline"] == "no-shadow" and comp["silent"] == ["harvest-slo(beta=0.25)"]
    assert summary["notices"] and "n_min 256" in summary["notices"][0]
    for policy, m in comp["policies"].items():
        mine = [c for c in calls if c["policy"] == policy and c["measured"]]
        assert len(mine) == m["calls"]["mean"], policy  # the records are the calls the metrics count
        switch = [c["ttft_s"] for c in mine if c["is_switch"]]
        assert sum(switch) / len(switch) == pytest.approx(m["switch_ttft_s"]["mean"])
    base, hs = comp["policies"]["no-shadow"], comp["policies"]["harvest-slo"]
    red = 1 - hs["switch_ttft_s"]["mean"] / base["switch_ttft_s"]["mean"]
    assert hs["switch_ttft_red"]["mean"] == pytest.approx(red) and red > 0
    assert comp["steps"]["harvest-slo(beta=0.25)"]["granted"] == 0 and comp["steps"]["harvest-slo"]["granted"] > 0
    assert "< n_min" in (folder / "table.txt").read_text()  # the file has every column
    for name in PLOTS:
        assert (folder / name).read_bytes()[:8] == PNG


def test_plot_redraws_and_compares_two_folders(tmp_path, capsys) -> None:
    _simulate(tmp_path / "a", capsys, "harvest-slo")
    _simulate(tmp_path / "b", capsys, "no-shadow", "eager")
    for name in PLOTS:
        (tmp_path / "a" / name).unlink()
    assert main(["plot", str(tmp_path / "a")]) == 0
    assert all((tmp_path / "a" / name).read_bytes()[:8] == PNG for name in PLOTS)
    assert main(["plot", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "cmp")]) == 0
    assert all((tmp_path / "cmp" / name).read_bytes()[:8] == PNG for name in PLOTS)
    assert (tmp_path / "cmp" / "compared.txt").read_text().splitlines() == [f"A: {tmp_path / 'a'}",
                                                                           f"B: {tmp_path / 'b'}"]


def test_plot_of_a_folder_that_is_not_a_result_is_one_error_line(tmp_path, capsys) -> None:
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a result folder: no calls.parquet" in err


def test_the_table_says_when_the_oracle_does_not_bound_a_policy() -> None:
    pytest.importorskip("shadow_sim")
    from shadow_sim.experiments.runner import Comparison, format_table, oracle_notes

    def run(hs: float, oracle: float) -> dict:
        base = {"switch_latency_red": 0.0, "calls": 10.0}
        return {"no-shadow": base, "harvest-slo-host": {**base, "switch_latency_red": hs},
                "oracle-host": {**base, "switch_latency_red": oracle}}

    per = ((0, "peak", run(0.02, -0.01)), (1, "peak", run(0.04, 0.03)))
    c = Comparison("", ("no-shadow", "harvest-slo-host", "oracle-host"), "no-shadow", "oracle-host", per,
                   {p: {"calls": (10.0, 0.0), "switch_ttft_s": (0.1, 0.01)} for p in per[0][2]})
    (line,) = oracle_notes(c)
    assert line.startswith("oracle-host does not bound harvest-slo-host: switch_latency_red +2.0 pp above it")
    assert "±1.0 (1 SE, 2 runs)" in line and len(line) <= 120
    assert line in format_table(c, columns=(("switch_ttft_s", "sw TTFT (s)", "abs"),))
    bounded = Comparison("", c.policies, "no-shadow", "oracle-host", ((0, "peak", run(0.01, 0.03)),), c.summary)
    assert oracle_notes(bounded) == []
