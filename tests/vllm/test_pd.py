"""P/D on vLLM's scheduler in virtual time (``shadow_vllm.pd``): a prefill-role
and a decode-role shadow scheduler with the real ``NixlConnector`` scheduler
side and the fake transfer worker of ``shadow_vllm.virtual.pd`` (it moves no
data; every decision is vLLM's, its connector's and the schedulers').

The assertions read what vLLM and the connector report: the P request's
``kv_transfer_params`` (the handle), the reads the connector's metadata
listed (blocks per read), vLLM's prefill stats of the switch call on D.
"""

from __future__ import annotations

import itertools

import pytest
from shadow_vllm import virtual
from shadow_vllm.engine_config import engine_args
from shadow_vllm.pd import PREFILL_KV_PARAMS, DecodeShadowScheduler, PrefillShadowScheduler
from shadow_vllm.virtual.pd import PDFabric, nixl_config, pd_engine

from shadowcore.errors import ConfigError
from shadowcore.latency import LinearLatencyModel
from shadowcore.slack import PrefillInstanceController
from shadowcore.wire import ShadowTag, TagKind

BLOCK = 16
BYTES_PER_BLOCK = 2 * 2 * 32 * 4 * BLOCK  # the virtual model's layer group: (K, V) x 2 heads x 32 x fp32


def _config(policy: str | dict = "harvest-slo", num_blocks: int = 256) -> virtual.VirtualEngineConfig:
    extra = engine_args(policy, slo={"ttft_s": 1.0, "tpot_s": 0.05})["additional_config"]
    return virtual.VirtualEngineConfig(block_size=BLOCK, num_blocks=num_blocks, max_num_batched_tokens=512,
                                       additional_config=extra)


def _pair(push_tokens: int = 128, link_bytes_per_s: float = 1e8, max_iteration_s: float = 0.05,
          classes: tuple = (PrefillShadowScheduler, DecodeShadowScheduler), **kw):
    from shadowcore.events import EventLoop

    fabric, loop, clock = PDFabric(), EventLoop(), virtual.VirtualClock()
    lat = LinearLatencyModel()
    p = pd_engine("prefill", "p", "m", lat, _config(**kw), fabric, loop, clock, classes[0],
                  max_iteration_s=max_iteration_s)
    d = pd_engine("decode", "d", "m", lat, _config(**kw), fabric, loop, clock, classes[1],
                  link_bytes_per_s=link_bytes_per_s, push_tokens=push_tokens)
    return fabric, p, d


def _tokens(n: int, salt: int) -> list[int]:
    return [7 + (i * 13 + salt * 101) % 997 for i in range(n)]


def _offer(d, p, rid: str, prompt: list[int], session: str = "s", p_switch: float = 0.9):
    """Offer P's handle of shadow ``rid`` to D, as the gateway does."""
    tag = ShadowTag(TagKind.SHADOW, session, "m", 0, p_switch).to_extra_args()
    return d.add_request(f"push:{rid}", prompt, 1, extra_args={**tag, "kv_transfer_params": p.kv_params[rid]})


def test_the_prefill_engine_runs_the_policys_prefill_controller_and_hands_shadow_kv_to_the_connector() -> None:
    _fabric, p, _ = _pair(max_iteration_s=0.006, policy={"name": "harvest-slo", "args": {"n_min": 0}})
    slack = p.scheduler.shadow_hook.slack
    assert isinstance(slack, PrefillInstanceController) and slack.max_iteration_s == 0.006
    prompt = _tokens(330, 1)  # 20 full blocks + 10 tokens
    tag = ShadowTag(TagKind.SHADOW, "s", "m", 0, 0.9).to_extra_args()
    shadow = p.add_request("sh", prompt, 1, extra_args=tag)
    p.loop.run()
    assert shadow.finish_reason == "stop" and p.scheduler.shadow_stats.num_shadow_tokens == 320
    handle = p.kv_params["sh"]  # NixlConnector's request_finished: the blocks are held for D
    assert handle["do_remote_prefill"] and handle["remote_request_id"] == "sh" and handle["remote_num_tokens"] == 320
    assert len(handle["remote_block_ids"][0]) == 20
    assert p.scheduler.requests["sh"].is_finished()  # delay-freed: still held by the connector
    # The 6 ms iteration cap of the policy's prefill controller split the shadow: every step within it.
    shadow_steps = [s for s in p.steps if any(r.request_id == "sh" for r in s.batch)]
    assert len(shadow_steps) >= 3 and all(s.duration_s <= 0.006 + 1e-12 for s in shadow_steps)


def test_decode_pulls_an_offer_in_pushes_then_a_switch_call_sends_only_what_d_lacks() -> None:
    fabric, p, d = _pair(push_tokens=128)
    prompt = _tokens(330, 2)
    tag = ShadowTag(TagKind.SHADOW, "s", "m", 0, 0.9).to_extra_args()
    p.add_request("sh", prompt, 1, extra_args=tag)
    p.loop.run()
    offer = _offer(d, p, "sh", prompt)
    d.loop.run()
    # NixlConnector: a read spends P's handle, so the offer served one push of push_tokens (of 320).
    (push,) = [r for r in fabric.reads if r.is_push]
    assert (push.num_blocks, push.num_tokens) == (8, 128)
    assert push.end_s - push.start_s == pytest.approx(8 * BYTES_PER_BLOCK / 1e8)
    stats = d.scheduler.shadow_push_stats
    assert (stats.num_pushes, stats.num_pushed_tokens, stats.num_dropped_push_tokens) == (1, 128, 0)
    assert offer.finish_reason == "stop" and stats.num_ended == {"pushed": 1}
    assert d.cached_prefix_tokens(prompt) == 128
    bridge = d.scheduler.shadow_bridge
    assert bridge.num_shadow_blocks == 8  # the reclaim-first class
    assert fabric.num_stale_reads == 0
    decisions = d.scheduler.shadow_push_decisions
    assert [x.grant[2:] for x in decisions if x.grant] == [(0, 128)]
    assert "sh" in p.scheduler.requests  # P frees the handle's blocks at its next step after the read

    # The switch call: P prefills only the tail after the shadow's prefix; D loads only what it lacks.
    call = [*prompt, *_tokens(40, 3)]
    routed = ShadowTag(TagKind.ROUTED, "s").to_extra_args()
    pre = p.add_request("c", call, 1, extra_args={**routed, "kv_transfer_params": dict(PREFILL_KV_PARAMS)})
    p.loop.run()
    assert pre.num_cached_tokens == 320  # the shadow's blocks on P
    assert "sh" not in p.scheduler.requests  # that step's connector output released the read handle
    num_reads = len(fabric.reads)
    dec = d.add_request("c@d", call, 4, extra_args={**routed, "kv_transfer_params": p.kv_params["c"]})
    d.loop.run()
    (read,) = fabric.reads[num_reads:]
    assert not read.is_push and (read.num_blocks, read.num_tokens) == (16, 242)  # tokens 128..369 of 370
    assert dec.prefill_stats.num_local_cached_tokens == 128  # vLLM's own breakdown on D: the pushed prefix
    assert dec.finish_reason == "length" and len(dec.output_token_ids) == 4
    assert bridge.num_promoted_blocks == 8  # the pushed blocks were used: promoted out of the shadow class


def test_an_offer_longer_than_a_push_is_pulled_in_pushes_when_reads_do_not_spend_the_handle() -> None:
    fabric, p, d = _pair(push_tokens=128)
    d.scheduler.shadow_one_read = False  # a connector whose reads leave P's blocks held (not NixlConnector)
    prompt = _tokens(330, 7)
    p.add_request("sh", prompt, 1, extra_args=ShadowTag(TagKind.SHADOW, "s", "m", 0, 0.9).to_extra_args())
    p.loop.run()
    offer = _offer(d, p, "sh", prompt)
    d.loop.run()
    pushes = [r for r in fabric.reads if r.is_push]
    assert [r.num_blocks for r in pushes] == [8, 8, 4]  # 128-token pushes, the last one the rest (320 in all)
    assert all(a.end_s <= b.start_s for a, b in itertools.pairwise(pushes))  # one at a time
    assert [x.grant[2:] for x in d.scheduler.shadow_push_decisions if x.grant] == [(0, 128), (128, 128), (256, 64)]
    assert offer.finish_reason == "stop" and d.scheduler.shadow_push_stats.num_ended == {"prefilled": 1}
    assert d.cached_prefix_tokens(prompt) == 320 and d.scheduler.shadow_bridge.num_shadow_blocks == 20
    # The fake worker is NixlConnector's: P let the handle go after the first read, so the two later
    # reads found its blocks freed. That is why, with NixlConnector, an offer serves one push.
    assert fabric.num_stale_reads == 2


def test_no_push_starts_while_a_normal_transfer_is_in_flight_or_waits() -> None:
    fabric, p, d = _pair(push_tokens=4096, link_bytes_per_s=1e7)
    shadow_prompt, normal_prompt = _tokens(320, 4), _tokens(640, 5)
    p.add_request("sh", shadow_prompt, 1, extra_args=ShadowTag(TagKind.SHADOW, "s", "m", 0, 0.9).to_extra_args())
    p.add_request("n", normal_prompt, 1, extra_args={"kv_transfer_params": dict(PREFILL_KV_PARAMS)})
    p.loop.run()
    d.add_request("x", _tokens(32, 6), 64)  # decodes on D meanwhile: D keeps scheduling during the transfer
    d.add_request("n@d", normal_prompt, 2, extra_args={"kv_transfer_params": p.kv_params["n"]}, kick=False)
    _offer(d, p, "sh", shadow_prompt)
    d.loop.run()
    normal = next(r for r in fabric.reads if not r.is_push)
    push = next(r for r in fabric.reads if r.is_push)
    assert push.start_s >= normal.end_s  # the push waited for the normal transfer
    busy = [x for x in d.scheduler.shadow_push_decisions if x.link_busy]
    assert busy and all(x.grant is None for x in busy)


def test_p_and_d_schedulers_need_their_connector_role_and_pd_role() -> None:
    cfg = _config()
    with pytest.raises(ConfigError, match="kv_transfer_config"):
        virtual.build_scheduler(PrefillShadowScheduler, cfg)
    with pytest.raises(ConfigError, match="kv_transfer_config"):
        virtual.build_scheduler(DecodeShadowScheduler, cfg, nixl_config("kv_producer", "x"))
    extra = engine_args("harvest-slo", pd={"role": "decode"})
    assert extra["scheduler_cls"] == "shadow_vllm.pd.DecodeShadowScheduler"
    bad = virtual.VirtualEngineConfig(block_size=BLOCK, num_blocks=64, additional_config=extra["additional_config"])
    with pytest.raises(ConfigError, match="pd.role"):
        virtual.build_scheduler(PrefillShadowScheduler, bad, nixl_config("kv_producer", "x"))
    with pytest.raises(ConfigError, match="pd.push_tokens"):
        engine_args("harvest-slo", pd={"role": "decode", "push_tokens": 0})
    assert engine_args("harvest-slo", pd={"role": "prefill"}, asynchronous=True)["scheduler_cls"] == \
        "shadow_vllm.pd.AsyncPrefillShadowScheduler"


def test_the_prefill_scheduler_runs_in_a_real_cpu_engine_with_a_producer_connector(engines, tmp_path) -> None:
    """The real engine (tiny model, ExampleConnector as kv_producer): the P scheduler is built by vLLM's
    engine core, runs a shadow with the policy's prefill controller, and the switch call finds it cached."""
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig

    store = tmp_path / "kv"
    store.mkdir()
    config = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_producer",
                              kv_connector_extra_config={"shared_storage_path": str(store)})
    llm = engines.start(**engine_args("harvest-slo", pd={"role": "prefill"}), kv_transfer_config=config)
    sched = engines.scheduler(llm)
    assert type(sched).__name__ == "PrefillShadowScheduler"
    assert isinstance(sched.shadow_hook.slack, PrefillInstanceController)
    prompt = [10 + (i * 7 + 3) % 300 for i in range(300)]  # within the tiny model's vocabulary
    shadow = SamplingParams(max_tokens=1, extra_args=ShadowTag(TagKind.SHADOW, "s", "m", 0, 0.9).to_extra_args())
    (out,) = llm.generate([{"prompt_token_ids": prompt}], shadow, use_tqdm=False)
    assert out.outputs[0].stop_reason.startswith("shadowprefill:prefilled")
    assert sched.shadow_stats.num_shadow_tokens == 288  # 9 full blocks of 32
    routed = SamplingParams(max_tokens=1, extra_args=ShadowTag(TagKind.ROUTED, "s").to_extra_args())
    (call,) = llm.generate([{"prompt_token_ids": [*prompt, *range(20, 40)]}], routed, use_tqdm=False)
    assert call.num_cached_tokens == 288
    engines.stop(llm)


def test_a_push_policy_that_breaks_the_rules_is_logged_and_dropped_not_obeyed(caplog) -> None:
    from shadowcore.pd import PushGrant

    fabric, p, d = _pair(push_tokens=128)

    class Greedy:  # ignores push_tokens and the block size
        def pull(self, link, candidates):
            c = candidates[0]
            return PushGrant(c.job, c.num_decode_held_tokens, c.num_pushable_tokens - 1)

    d.scheduler.shadow_push_policy = Greedy()
    prompt = _tokens(330, 10)
    p.add_request("sh", prompt, 1, extra_args=ShadowTag(TagKind.SHADOW, "s", "m", 0, 0.9).to_extra_args())
    p.loop.run()
    _offer(d, p, "sh", prompt)
    d.loop.run()
    assert not [r for r in fabric.reads if r.is_push]
    assert d.scheduler.shadow_push_stats.num_pushes == 0
    assert "push policy Greedy on d: push of 319 tokens" in caplog.text


def test_the_async_twins_run_the_same_p_and_d_path() -> None:
    from shadow_vllm.pd import AsyncDecodeShadowScheduler, AsyncPrefillShadowScheduler

    fabric, p, d = _pair(push_tokens=4096, classes=(AsyncPrefillShadowScheduler, AsyncDecodeShadowScheduler))
    from shadow_vllm.vllm_internals import AsyncScheduler

    assert isinstance(p.scheduler, AsyncScheduler) and isinstance(d.scheduler, AsyncScheduler)
    assert isinstance(p.scheduler.shadow_hook.slack, PrefillInstanceController)
    prompt = _tokens(330, 11)
    p.add_request("sh", prompt, 1, extra_args=ShadowTag(TagKind.SHADOW, "s", "m", 0, 0.9).to_extra_args())
    p.loop.run()
    assert p.kv_params["sh"]["remote_num_tokens"] == 320
    offer = _offer(d, p, "sh", prompt)
    d.loop.run()
    assert [r.num_tokens for r in fabric.reads if r.is_push] == [320]
    assert offer.finish_reason == "stop" and d.cached_prefix_tokens(prompt) == 320
    assert fabric.num_stale_reads == 0


def test_a_newer_offer_supersedes_the_older_which_says_what_d_holds_and_gives_its_handle_back() -> None:
    fabric, p, d = _pair(push_tokens=128, link_bytes_per_s=1e7)
    prompt = _tokens(330, 12)
    tag = ShadowTag(TagKind.SHADOW, "s", "m", 0, 0.9).to_extra_args()
    longer = [*prompt, *_tokens(320, 13)]  # 20 more blocks: above n_min, so P computes them
    for rid, tokens in (("sh", prompt), ("sh2", longer)):  # two shadows of the session, two handles
        p.add_request(rid, tokens, 1, extra_args=tag)
        p.loop.run()
    first = d.add_request("push:sh", prompt, 1, extra_args={**tag, "kv_transfer_params": p.kv_params["sh"]},
                          kick=False)
    second = _offer(d, p, "sh2", longer)  # arrives before D scheduled the first
    d.loop.run()
    assert first.finish_reason == "abort" and d.scheduler.shadow_push_stats.num_ended["superseded"] == 1
    assert [r.remote_request_id for r in fabric.reads if r.is_push] == ["sh2"]
    assert second.finish_reason == "stop" and d.scheduler.shadow_push_stats.num_pushes == 1
    assert fabric.num_stale_reads == 0
    p.add_request("later", _tokens(40, 14), 1)
    p.loop.run()  # P's next step: both handles released (one unread, one read)
    assert "sh" not in p.scheduler.requests and "sh2" not in p.scheduler.requests
