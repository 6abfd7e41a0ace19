"""The host tier on the vLLM backend in virtual time: vLLM's real scheduler with
the real ``OffloadingConnector`` scheduler side (``CPUOffloadingManager``, the
same config ``--kv-offloading-size`` builds) and a fake transfer worker
(:class:`shadow_vllm.virtual.OffloadTransferWorker`) that only moves no data.

The CPU build refuses the connector's worker side ("CPU Offloading is currently
only supported on CUDA-alike and XPU GPUs"), so the device<->host copies are
not run here; every scheduling decision is vLLM's and the connector's, and the
assertions read what vLLM reports (prefill stats, scheduled batches, the
connector's load jobs).
"""

from __future__ import annotations

import logging

import pytest
from shadow_vllm import virtual
from shadow_vllm.engine_config import engine_args
from shadow_vllm.scheduler import ShadowScheduler

from shadowcore.errors import ConfigError
from shadowcore.kv import KVClass
from shadowcore.latency import LinearLatencyModel
from shadowcore.wire import ShadowTag, TagKind

BLOCK = 16
BYTES_PER_BLOCK = 2 * 2 * 32 * 4 * BLOCK  # the virtual model's one layer group: (K, V) x 2 heads x 32 x fp32


def _engine(policy: str = "eager", bytes_per_s: float | None = None, **limits) -> virtual.VirtualEngine:
    extra = engine_args(policy, slo={"ttft_s": 1.0, "tpot_s": 0.05})["additional_config"]
    config = virtual.VirtualEngineConfig(**{
        "block_size": BLOCK, "num_blocks": 128, "max_num_batched_tokens": 256, "additional_config": extra,
        "kv_offloading_bytes": 256 * BYTES_PER_BLOCK, "kv_transfer_bytes_per_s": bytes_per_s, **limits})
    eng = virtual.VirtualEngine(virtual.build_scheduler(ShadowScheduler, config), LinearLatencyModel(),
                                transfer_bytes_per_s=bytes_per_s)
    assert type(eng.scheduler.connector).__name__ == "OffloadingConnector"
    return eng


def _tokens(n: int, salt: int) -> list[int]:
    return [7 + (i * 13 + salt * 101) % 997 for i in range(n)]


def _shadow(eng, rid: str, prompt: list[int], session: str = "s", **kwargs) -> virtual.VirtualRequest:
    return eng.add_request(rid, prompt, 1, extra_args=ShadowTag(TagKind.SHADOW, session, "m", 0, 0.9).to_extra_args(),
                           **kwargs)


def _chunks(eng, rid: str) -> list[tuple[int, int]]:
    """(scheduled tokens, context) of ``rid`` in every step vLLM scheduled it."""
    return [(r.num_scheduled_tokens, r.num_context_tokens) for s in eng.steps for r in s.batch if r.request_id == rid]


def _prefill_then_evict(eng, prompt: list[int], rid: str = "sh1", session: str = "s", reset: bool = False) -> None:
    """A shadow prefills ``prompt`` (its blocks stored to the host tier), then normal traffic evicts
    them from the device pool (or, with ``reset``, vLLM's prefix cache reset drops them)."""
    shadow = _shadow(eng, rid, prompt, session)
    eng.loop.run()
    assert eng.scheduler.requests.get(rid) is None and shadow.finish_reason is not None
    assert _chunks(eng, rid) == [(256, 0), (len(prompt) - 256, 256)]  # computed on the device, two chunks
    assert eng.cached_prefix_tokens(prompt) == len(prompt)
    stored = eng.offload.num_stored_blocks
    assert stored >= len(prompt) // BLOCK  # the connector stored the shadow's blocks; the worker ran the jobs
    if reset:  # every device block is free and hash-less: a later load allocates without evicting
        assert eng.scheduler.reset_prefix_cache()
        assert eng.cached_prefix_tokens(prompt) == 0
        return
    for k in range(14):  # 14 x 10 blocks of other prompts through a 127-block pool
        eng.add_request(f"n{session}{k}", _tokens(150, 50 + k), 2)
    eng.loop.run()
    assert eng.cached_prefix_tokens(prompt) == 0  # gone from the device
    assert eng.scheduler.shadow_bridge.num_evicted_blocks[KVClass.SHADOW] >= len(prompt) // BLOCK


def test_a_switch_call_loads_the_shadows_blocks_from_the_host_tier_instead_of_prefilling() -> None:
    eng = _engine()
    prompt = _tokens(320, 1)  # 20 blocks
    _prefill_then_evict(eng, prompt)
    loaded_before = eng.offload.num_loaded_blocks

    switch = eng.add_request("switch", [*prompt, *_tokens(40, 2)], 2,
                             extra_args=ShadowTag(TagKind.ROUTED, "s").to_extra_args())
    eng.loop.run()
    stats = switch.prefill_stats  # vLLM's own breakdown of the call's prefill
    assert (stats.num_local_cached_tokens, stats.num_external_cached_tokens, stats.num_computed_tokens) == (0, 320, 40)
    assert switch.num_cached_tokens == 320
    # Prefill tokens were scheduled only for the 40-token tail (after the load), then one decode.
    assert _chunks(eng, "switch") == [(40, 320), (1, 360)]
    assert eng.offload.num_loaded_blocks - loaded_before == 20
    assert switch.output_token_ids and switch.finish_reason == "length"


@pytest.mark.parametrize("reset", [False, True], ids=["evicted", "cache-reset"])
def test_a_resumed_shadow_loads_its_host_prefix_and_computes_only_the_rest(reset: bool) -> None:
    bytes_per_s = 1e8  # the 20-block load takes 1.64 ms of virtual time
    eng = _engine(bytes_per_s=bytes_per_s)
    first = _tokens(320, 3)
    _prefill_then_evict(eng, first, "q1", "t", reset)
    evictions = eng.scheduler.shadow_bridge.eviction_count
    sched = eng.scheduler
    stats_before = (sched.shadow_stats.num_chunks, sched.shadow_stats.num_dropped_chunks)

    # Six seconds later (the idle blocks are cold: a shadow may take them) the session has grown: the
    # gateway sends the job again with the longer context (a new request of the same (session,
    # target)); a normal request decodes meanwhile.
    num_transfers = len(eng.offload.transfers)
    longer = [*first, *_tokens(160, 4)]
    held_at_finish = []
    eng.loop.at(eng.loop.now_s + 6.0, virtual.ARRIVAL, lambda t: (
        eng.add_request("d", _tokens(40, 5), 12),
        _shadow(eng, "q2", longer, "t", on_finish=lambda r: held_at_finish.append(eng.cached_prefix_tokens(longer)))))
    eng.loop.run()
    decode, shadow = eng.requests["d"], eng.requests["q2"]

    # The connector's load job (vLLM's metadata) brought the shadow's 20 stored blocks back ...
    loads = [t for t in eng.offload.transfers[num_transfers:] if t[1] is not None]
    ((_, rid, num_blocks, start_s, done_s),) = loads
    assert (rid, num_blocks) == ("q2", 20)
    assert done_s - start_s == pytest.approx(20 * BYTES_PER_BLOCK / bytes_per_s)
    # ... and the shadow computed only the rest, once the load was done: one chunk from token 320.
    assert _chunks(eng, "q2") == [(160, 320)]
    (chunk_step,) = [s for s in eng.steps if any(r.request_id == "q2" for r in s.batch)]
    assert chunk_step.start_s >= done_s
    # The load did not hold the engine up: the normal request decoded while it ran.
    assert any(s.start_s < done_s and any(r.request_id == "d" for r in s.batch) for s in eng.steps)
    assert decode.finish_reason == "length" and len(decode.output_token_ids) == 12
    stats = sched.shadow_stats
    assert (stats.num_loads, stats.num_loaded_tokens) == (1, 320)
    # The job learnt what the load brought: no chunk was dropped, the next plan started at 320.
    assert (stats.num_chunks - stats_before[0], stats.num_dropped_chunks - stats_before[1]) == (1, 0)
    assert shadow.finish_reason is not None and not sched.shadow_loading and not sched.shadow_parked
    assert held_at_finish == [480]  # loaded and computed blocks stay cached on the device
    if reset:  # nothing was evicted meanwhile: the job learnt the load's prefix from the load itself
        assert eng.scheduler.shadow_bridge.eviction_count == evictions


def test_a_host_tier_policy_warns_only_without_a_connector(caplog) -> None:
    extra = engine_args("harvest-slo-host")["additional_config"]
    with caplog.at_level(logging.WARNING, logger="shadow_vllm.scheduler"):
        virtual.build_scheduler(ShadowScheduler, virtual.VirtualEngineConfig(
            additional_config=extra, kv_offloading_bytes=64 * BYTES_PER_BLOCK))
    assert not [r for r in caplog.records if "host tier" in r.getMessage()]
    with caplog.at_level(logging.WARNING, logger="shadow_vllm.scheduler"):
        virtual.build_scheduler(ShadowScheduler, virtual.VirtualEngineConfig(additional_config=extra))
    assert [r for r in caplog.records if "needs a KV offloading connector" in r.getMessage()]


def test_offloading_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="kv_offloading_block_size"):
        virtual.VirtualEngineConfig(block_size=16, kv_offloading_bytes=1 << 20, kv_offloading_block_size=24)
    with pytest.raises(ConfigError, match="kv_offloading_bytes"):
        virtual.VirtualEngineConfig(kv_transfer_bytes_per_s=1e9)
    with pytest.raises(ValueError, match="kv_transfer_bytes_per_s"):
        virtual.VirtualEngineConfig(kv_offloading_bytes=1 << 20, kv_transfer_bytes_per_s=0)
