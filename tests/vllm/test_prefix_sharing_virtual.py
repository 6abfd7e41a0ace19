"""Prefix sharing in normal traffic on vLLM's own prefix cache (issue 14 item 4):
the hand-made Mooncake-shaped trace (tests/mooncake_fixture.py) replayed in
virtual time gives each normal request exactly the cached tokens the trace's
reuse says, the same as the simulator's KV model (tests/test_prefix_sharing.py)."""

from __future__ import annotations

import mooncake_fixture as fx
from shadow_vllm import virtual  # vLLM itself is imported lazily; conftest guards the folder
from test_prefix_sharing import SCENARIO, fixture_requests

from shadowcore.config import PluginRef, ShadowConfig
from shadowcore.engine.scenario import FakeRun
from shadowcore.engine.workload import Workload


def test_vllm_virtual_time_normal_hit_rate_matches_the_trace_reuse_exactly(tmp_path) -> None:
    shadow = ShadowConfig(PluginRef("no-shadow"))
    workload = Workload((), fixture_requests(tmp_path))
    sim = FakeRun(SCENARIO, shadow, workload=workload)
    sim.run()
    configs = {m: virtual.VirtualEngineConfig(block_size=fx.BLOCK_SIZE, num_blocks=SCENARIO.num_blocks + 1,
                                              max_num_batched_tokens=SCENARIO.token_budget, max_num_seqs=256)
               for m in SCENARIO.models}
    vrun = virtual.VirtualScenarioRun(SCENARIO, shadow, {m: sim.cluster.by_model[m][0].latency
                                                         for m in SCENARIO.models}, configs, workload=workload)
    vrun.run()
    got = [r.num_cached_tokens for r in sorted(vrun.normal, key=lambda r: r.arrival_s)]
    assert got == list(fx.CACHED)  # vLLM's own hits on token ids derived from the hashes
    assert vrun.normal_hit_rate == fx.HIT_RATE > 0
    assert [c for _, _, c in sorted(sim.normal_tokens)] == got  # the simulator's KV model agrees
