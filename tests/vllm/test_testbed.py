"""``shadowprefill reproduce --testbed --quick``: the paper's GPU testbed (Section 6,
Appendix D) on vLLM's scheduler in virtual time, one FusionBench pair at 5% of
the run length, end to end through the command."""

from __future__ import annotations

import json

from shadow_sim.experiments import reproduce
from shadow_vllm.virtual import testbed


def test_quick_testbed_prints_the_side_by_side_table(tmp_path, capsys) -> None:
    assert reproduce.main(["--testbed", "--quick", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    text = (tmp_path / "testbed.md").read_text()
    for _value, _where, what in testbed.PAPER_TESTBED.values():
        assert what in text and what in printed
    assert "REDUCED" in text  # the quick mode says what it shortened
    data = json.loads((tmp_path / "testbed.json").read_text())
    point = data["L8/L70@0.3"]
    assert set(point) == {"no-shadow", "request-level", "harvest-slo", "imminent-host"}
    assert "## Issue 16 item 7" in text and "| L8/L70 | 0.3 | imminent-host |" in text  # item 7's bar, judged
    base, rl = point["no-shadow"], point["request-level"]
    assert base["switch_calls"] >= 10 and rl["switch_calls"] == base["switch_calls"]  # matched calls
    assert base["switch_ttft_red"] == 0.0
    assert rl["switch_ttft_red"] > 0.3  # the request-level shadows warm switch calls (paper: 61.9%)
    assert rl["shadow_tokens"] > 0 and base["shadow_tokens"] == 0
    assert point["harvest-slo"]["shadow_tokens"] > 0 and point["imminent-host"]["shadow_tokens"] > 0


def test_testbed_flags_are_checked(capsys) -> None:
    assert reproduce.main(["--testbed", "--pairs", "Q7/X"]) == 2
    assert "--pairs" in capsys.readouterr().err
    assert reproduce.main(["--length-scale", "0.5"]) == 2
    assert "needs --testbed" in capsys.readouterr().err
