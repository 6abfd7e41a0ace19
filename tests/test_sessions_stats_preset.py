"""``shadowprefill sessions stats --preset``: a preset's statistics next to the
paper's Table 1 and Table 5 rows and its switch/same-call cost next to Figure 2d's."""

from __future__ import annotations

import json
import re

import pytest

from shadow_traces import command


def test_preset_stats_print_table1_table5_and_the_cost_ratio(capsys) -> None:
    assert command.main(["stats", "--preset", "fusionbench-testbed", "--pair", "Q7/L70", "--num-sessions", "300",
                         "--latency", "roofline"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0] + " " + line.split()[1]: line.split() for line in out.splitlines() if line[:1].isalpha()}
    assert rows["switch rate"][-2:] == ["26%", "20%"]  # Table 1 FusionBench, Table 5 Q7/L70
    assert rows["mean output"][-2:] == ["unpubl.", "52"]
    ours = float(rows["mean output"][2])
    assert 45 <= ours <= 60  # fitted to Table 5's 52
    ratio = re.search(r"ours ([0-9.]+)x \(isolated: ([0-9.]+) s / ([0-9.]+) s\), Figure 2d 2.0x", out)
    assert ratio is not None, out
    assert float(ratio.group(1)) > 1.0  # a switch call prefills what a same-model call finds cached
    assert abs(float(ratio.group(2)) / float(ratio.group(3)) - float(ratio.group(1))) < 0.01


def test_preset_stats_json_and_a_pair_without_table5(capsys) -> None:
    assert command.main(["stats", "--preset", "router-r1", "--pair", "Qwen2.5-7B,Llama-3.1-70B", "--num-sessions",
                         "200", "--latency", "none", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["num_sessions"] == 200 and "switch_cost_s" not in data and data["mean_output"] > 0
    assert command.main(["stats", "--preset", "router-r1", "--num-sessions", "200", "--latency", "none"]) == 0
    out = capsys.readouterr().out
    assert "Table 5" in out and "switch / same-model" not in out  # no pair: no Table 5 row, no latency


@pytest.mark.parametrize("argv, field", [
    (["stats"], "file"),
    (["stats", "x.jsonl", "--pair", "Q7/L70"], "--pair"),
    (["stats", "x.jsonl", "--preset", "fusionbench"], "file"),
    (["stats", "--preset", "fusionbench", "--pair", "Q7/X"], "--pair"),
    (["stats", "--preset", "nope"], "preset"),
])
def test_preset_stats_errors_name_the_flag(argv, field, capsys) -> None:
    assert command.main(argv) == 2
    assert field in capsys.readouterr().err
