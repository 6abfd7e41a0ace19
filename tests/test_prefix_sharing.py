"""Prefix sharing in normal traffic (issue 14 item 4): a Mooncake-shaped trace's
``hash_ids`` give normal requests that share cached blocks in the simulator's KV
model, with a hit rate that matches the trace's reuse exactly on a hand-made case
(tests/mooncake_fixture.py; vLLM virtual time: tests/vllm/test_prefix_sharing_virtual.py)."""

from __future__ import annotations

import attrs
import mooncake_fixture as fx
import pytest

from shadowcore.config import PluginRef, ShadowConfig
from shadowcore.engine.scenario import FakeRun, FakeScenario
from shadowcore.engine.workload import NormalRequest, Workload
from shadowcore.errors import ConfigError
from shadowcore.job import SessionHistory
from shadowcore.workloads.prefix import PrefixHistory, PromptPrefix, prefix_reuse_tokens, trace_prefix
from shadowcore.workloads.traces import load_mooncake

SCENARIO = FakeScenario(models=("small", "large"), instances_per_model=1, duration_s=200.0, warmup_s=0.0,
                        normal_rate_per_s=0.0, block_size=fx.BLOCK_SIZE, num_blocks=4096)


def fixture_requests(tmp_path, instance: str = "small/0") -> tuple[NormalRequest, ...]:
    trace = load_mooncake(fx.write(tmp_path / "mooncake.jsonl"))
    return tuple(NormalRequest(instance, r.arrival_s, r.num_prompt_tokens, r.num_output_tokens, trace_prefix(r))
                 for r in trace.requests)


def test_the_fixture_reuse_is_what_the_reference_finds(tmp_path) -> None:
    reqs = fixture_requests(tmp_path)
    assert prefix_reuse_tokens(((r.num_prompt_tokens, r.prefix) for r in reqs), fx.BLOCK_SIZE) == list(fx.CACHED)


def test_simulator_normal_hit_rate_matches_the_trace_reuse_exactly(tmp_path) -> None:
    run = FakeRun(SCENARIO, ShadowConfig(PluginRef("no-shadow")), workload=Workload((), fixture_requests(tmp_path)))
    result = run.run()
    got = [c for _, _, c in sorted(run.normal_tokens)]
    assert got == list(fx.CACHED)
    assert result.metrics["normal_hit_rate"] == pytest.approx(fx.HIT_RATE, abs=0) and fx.HIT_RATE > 0


def test_without_hashes_normal_requests_share_nothing(tmp_path) -> None:
    plain = tuple(attrs.evolve(r, prefix=None) for r in fixture_requests(tmp_path))
    run = FakeRun(SCENARIO, ShadowConfig(PluginRef("no-shadow")), workload=Workload((), plain))
    assert run.run().metrics["normal_hit_rate"] == 0.0


@pytest.mark.parametrize("block_size", [16, 24, 512, 1000])
def test_prefix_blocks_are_shared_exactly_where_the_hash_lists_agree(block_size) -> None:
    """Any engine block size (dividing the trace's block or not): a block is shared
    when it ends inside both requests' hashed tokens, in trace blocks of equal hash lists."""
    a = PrefixHistory.for_prompt("a", 1500, PromptPrefix((7, 8, 9), 512))
    b = PrefixHistory.for_prompt("b", 2100, PromptPrefix((7, 8, 5, 6), 512))
    ha, hb = a.block_hashes(block_size), b.block_hashes(block_size)
    common = sum(1 for x, y in zip(ha, hb) if x == y)
    assert common == 1024 // block_size  # blocks ending inside [7, 8]
    assert ha[:common] == hb[:common] and not set(ha[common:]) & set(hb)
    fresh = SessionHistory("a")
    fresh.append(1500)
    tail = fresh.block_hashes(block_size)[1500 // block_size:]  # past the hashed tokens: a fresh history's
    assert ha[1500 // block_size:] == tail


def test_prefix_token_ids_are_equal_exactly_for_equal_hashes() -> None:
    a = PromptPrefix((1, 2, 3), 512).token_ids(1400, 32000)
    b = PromptPrefix((1, 2, 4), 512).token_ids(1536, 32000)
    assert len(a) == 1400 and len(b) == 1536 and all(3 <= t < 32000 for t in a + b)
    assert a[:1024] == b[:1024] and a[1024:1030] != b[1024:1030]
    assert PromptPrefix((1,), 512).token_ids(512, 32000) == a[:512]  # a pure function of the hash


def test_bad_prefixes_are_named() -> None:
    with pytest.raises(ConfigError, match="hash_ids"):
        PromptPrefix((), 512)
    with pytest.raises(ConfigError, match="hash_ids"):
        PromptPrefix((1, -2), 512)
    with pytest.raises(ConfigError, match="block_tokens"):
        PromptPrefix((1,), 0)
    with pytest.raises(ConfigError, match="prefix"):
        NormalRequest("i", 0.0, 10, 1, prefix=(1, 2))


@pytest.mark.parametrize("block_size", [16, 24])
def test_a_random_sequential_trace_hits_exactly_its_reuse(block_size) -> None:
    """Random hash lists with shared heads and partial last blocks, one request at
    a time on an unbounded pool: every request's cached tokens are the reference's."""
    import numpy as np

    rng = np.random.default_rng(7)
    heads = [list(map(int, rng.integers(0, 50, rng.integers(1, 5)))) for _ in range(6)]
    reqs = []
    for k in range(40):
        ids = heads[int(rng.integers(len(heads)))] + list(map(int, rng.integers(0, 50, rng.integers(0, 3))))
        prompt = max(1, len(ids) * 512 - int(rng.integers(0, 700)))  # a partial last block, or tokens past the hashes
        reqs.append(NormalRequest("small/0", 20.0 * k, prompt, 3, PromptPrefix(tuple(ids), 512)))
    scenario = attrs.evolve(SCENARIO, block_size=block_size, duration_s=900.0)
    run = FakeRun(scenario, ShadowConfig(PluginRef("no-shadow")), workload=Workload((), tuple(reqs)))
    run.run()
    want = prefix_reuse_tokens(((r.num_prompt_tokens, r.prefix) for r in reqs), block_size)
    assert [c for _, _, c in sorted(run.normal_tokens)] == want and sum(want) > 0
