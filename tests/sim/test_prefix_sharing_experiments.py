"""Prefix sharing through an experiment (issue 14 item 4): normal traffic replayed
from, or drawn by Poisson from, a Mooncake-shaped trace with shared ``hash_ids``
hits cached prefixes (``normal_hit_rate`` per run, in the summary and under the
table); ``normal.prefix_sharing: false`` and a source without hashes do not."""

from __future__ import annotations

import math

import mooncake_fixture as fx
from shadow_sim.experiments import calibrate as cal
from shadow_sim.experiments.runner import compare, format_table, summary_json, tasks_for, with_progress
from shadow_sim.experiments.spec import Experiment

from shadowcore.config import PluginRef

BASE = {"latency": "roofline", "instances_per_model": 1, "duration_s": 60.0, "warmup_s": 5.0, "drain_s": 5.0,
        "session_rate_per_s": 0.05, "models": ["Llama-3.1-8B", "Qwen2.5-7B"], "preset": "",
        "scenario": {"calls_per_session": 3, "input_tokens_median": 300, "output_tokens_median": 30}}
CAPS = {"Llama-3.1-8B": 2.0, "Qwen2.5-7B": 2.0}


def _compare(normal: dict):
    ex = Experiment.from_dict({**BASE, "normal": normal})
    tasks = tasks_for(ex, [PluginRef("no-shadow"), PluginRef("harvest-slo-host")], [0], ["peak"], CAPS)
    return ex, compare(with_progress(tasks, 1, False), tasks)[""]


def test_replayed_and_poisson_drawn_trace_requests_share_prefixes(tmp_path) -> None:
    source = str(fx.write(tmp_path / "mooncake.jsonl"))
    ex, c = _compare({"kind": "trace", "source": source, "rho": 1.0})
    assert ex.normal.shares_prefixes
    rates = {p: c.summary[p]["normal_hit_rate"][0] for p in c.policies}
    assert all(r > 0.2 for r in rates.values()), rates  # the window is tiled: repeats hit too
    assert "normal-traffic prefix hit rate" in format_table(c)
    assert summary_json(c)["policies"]["no-shadow"]["normal_hit_rate"]["mean"] == rates["no-shadow"]
    _, pois = _compare({"kind": "poisson", "source": source, "rho": 1.0})
    assert pois.summary["no-shadow"]["normal_hit_rate"][0] > 0.2
    off, c_off = _compare({"kind": "trace", "source": source, "rho": 1.0, "prefix_sharing": False})
    assert not off.normal.shares_prefixes and c_off.summary["no-shadow"]["normal_hit_rate"][0] == 0.0
    assert "normal-traffic prefix hit rate" not in format_table(c_off)
    assert cal._key(ex, "Llama-3.1-8B", cal.ProbeSettings()) != cal._key(off, "Llama-3.1-8B", cal.ProbeSettings())


def test_embedded_lengths_carry_no_prefixes() -> None:
    ex, c = _compare({"kind": "poisson", "source": "azure-conv", "rho": 0.3})
    assert not ex.normal.shares_prefixes
    assert c.summary["no-shadow"]["normal_hit_rate"][0] == 0.0 or math.isnan(c.summary["no-shadow"]["normal_hit_rate"][0])


def test_prefix_sharing_flag_and_bad_values(tmp_path) -> None:
    import pytest
    from shadow_sim.experiments.sweep import experiment_from_args, parser

    from shadowcore.errors import ConfigError

    args = parser().parse_args(["--normal-trace", "x.jsonl", "--no-prefix-sharing"])
    assert experiment_from_args(args)["normal"]["prefix_sharing"] is False
    with pytest.raises(ConfigError, match="normal.prefix_sharing"):
        Experiment.from_dict({**BASE, "normal": {"kind": "trace", "source": str(fx.write(tmp_path / "m.jsonl")),
                                                 "prefix_sharing": "yes"}})
