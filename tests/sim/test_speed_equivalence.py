"""Speed work must not change results: seeded runs pinned to a golden file.

Each case runs a seeded scenario (fake backend with linear latency, or the
simulator with roofline latency) under one policy and records everything a
result is made of: the summary (every metric, exact floats), every routed
call's record, every normal request's arrival / first token / finish, per
instance its iteration count, busy time (the sum of every iteration's
duration, in order), shadow tokens, preemptions, evictions and final KV
state, per hook the slack controller's credit, and the simulated end time.
The golden values were computed with the engine before its per-iteration
fast paths existed; equality is exact (NaN equals NaN).

Regenerate (only for a deliberate semantic change, stated in the commit)::

    python tests/sim/test_speed_equivalence.py --regenerate
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
from shadow_sim.disagg import PDRun
from shadow_sim.simulator import SimRun, SimScenario

from shadowcore.config import PluginRef, ShadowConfig
from shadowcore.testing.scenario import FakeRun, FakeScenario

GOLDEN = Path(__file__).parent / "golden" / "speed_equivalence.json"

_SIM = {
    "models": ["Qwen2.5-7B", "Llama-3.1-8B"],
    "latency": "roofline",
    "instances_per_model": 2,
    "duration_s": 40.0,
    "warmup_s": 5.0,
    "session_rate_per_s": 0.3,
    "calls_per_session": 5,
    "switch_probability": 0.4,
    "input_tokens_median": 1500,
    "output_tokens_median": 150,
    "normal_rate_per_s": 4.0,
    "seed": 7,
}
_FAKE = {"duration_s": 60.0, "warmup_s": 5.0, "session_rate_per_s": 0.25, "calls_per_session": 6,
         "switch_probability": 0.4, "normal_rate_per_s": 2.5, "seed": 3}

#: name -> (backend, scenario fields, policy, policy args)
CASES: dict[str, tuple[str, dict, str, dict]] = {
    "fake-no-shadow": ("fake", _FAKE, "no-shadow", {}),
    "fake-harvest-slo-host": ("fake", _FAKE, "harvest-slo-host", {}),
    "fake-eager": ("fake", _FAKE, "eager", {}),
    "fake-harvest-tight-kv": ("fake", {**_FAKE, "num_blocks": 700}, "harvest", {}),  # preemptions, evictions
    "sim-no-shadow": ("sim", _SIM, "no-shadow", {}),
    "sim-harvest-slo-host": ("sim", _SIM, "harvest-slo-host", {}),
    "sim-eager": ("sim", _SIM, "eager", {}),
    "sim-dedicated": ("sim", {**_SIM, "duration_s": 30.0}, "dedicated", {}),
    "sim-pd-harvest-slo": ("pd", {**_SIM, "duration_s": 30.0, "pd": {"num_prefill": 2, "num_decode": 1}},
                           "harvest-slo", {}),
}


def _capture(cls: type) -> type:
    """``cls`` keeping every normal request's times."""

    @attrs.define(eq=False)
    class Captured(cls):
        normal_records: list = attrs.field(init=False, factory=list)

        def _normal_done(self, req: Any, now_s: float) -> None:
            super()._normal_done(req, now_s)
            self.normal_records.append([req.request_id, req.arrival_s, req.first_token_s, req.finish_s, req.rejected,
                                        req.num_cached_tokens])

    return Captured


def run_case(name: str) -> dict:
    backend, fields, policy, args = CASES[name]
    shadow = ShadowConfig(PluginRef(policy, args), seed=11)
    if backend == "fake":
        run = _capture(FakeRun)(FakeScenario.from_dict(fields), shadow)
    else:
        cls = PDRun if backend == "pd" else SimRun
        run = _capture(cls)(SimScenario.from_dict(fields), shadow)
    result = run.run()
    instances = {
        i.instance_id: [i.num_iterations_run, i.iteration, i.busy_s, i.num_shadow_tokens, i.num_preemptions,
                        i.num_rejected, i.kv.eviction_count, i.kv.num_free_blocks, i.kv.num_cached_blocks,
                        i.kv.num_shadow_blocks, i.kv.num_reloaded_blocks, i.kv.num_host_blocks]
        for i in run.cluster.by_id.values()
    }
    credit = {}
    for inst_id, hook in sorted(run.runtime.hooks.items()):
        c = getattr(hook.slack, "credit", None)
        if c is not None:
            credit[inst_id] = [c.balance_s, c.earned_s, c.spent_s]
    return {
        "summary": dict(result.metrics),
        "calls": [list(attrs.astuple(c)) for c in result.calls],
        "normal": sorted(run.normal_records),
        "instances": instances,
        "credit": credit,
        "end_s": run.loop.now_s,
        "num_events": run.loop.num_events,
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _normalise(value: Any) -> Any:
    return json.loads(json.dumps(value))  # tuples -> lists, same floats (repr round-trips)


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("name", sorted(CASES))
def test_results_identical_to_golden(name: str, golden: dict) -> None:
    want = golden[name]
    got = _normalise(run_case(name))
    # Metrics added after the golden file was written are not pinned; every pinned one must match exactly.
    extra = set(got["summary"]) - set(want["summary"])
    got["summary"] = {k: v for k, v in got["summary"].items() if k not in extra}
    for key in want:
        if key == "num_events":  # inline-processed iteration ends still count as events
            continue
        assert _same(got[key], want[key]), f"{name}: {key} differs"


def test_cases_exercise_what_they_claim(golden: dict) -> None:
    """The pinned runs are not trivial: work ran, shadows ran, KV pressure preempted."""
    for name, case in golden.items():
        assert case["summary"]["calls"] > 10 and case["normal"], name
        assert sum(v[0] for v in case["instances"].values()) > 1000, name
    assert golden["fake-harvest-tight-kv"]["summary"]["shadow_tokens"] > 0
    assert sum(v[4] for v in golden["fake-harvest-tight-kv"]["instances"].values()) > 0  # preemptions
    for name in ("fake-harvest-slo-host", "sim-harvest-slo-host", "sim-eager", "sim-dedicated", "sim-pd-harvest-slo"):
        assert golden[name]["summary"]["shadow_tokens"] > 0, name
    assert golden["sim-no-shadow"]["summary"]["shadow_tokens"] == 0


def test_same_seed_same_result() -> None:
    a, b = _normalise(run_case("fake-harvest-slo-host")), _normalise(run_case("fake-harvest-slo-host"))
    assert _same(a, b)


if __name__ == "__main__":
    if "--regenerate" not in sys.argv:
        sys.exit(__doc__)
    GOLDEN.parent.mkdir(exist_ok=True)
    data = {name: _normalise(run_case(name)) for name in sorted(CASES)}
    GOLDEN.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size} bytes)")
