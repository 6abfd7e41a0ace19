"""Shadow chunks reach vLLM's KV connector (issue 5, item 4: host tier through
an offloading connector), on the real CPU engine with a real connector.

vLLM builds a step's connector metadata inside ``schedule()``; the shadow
scheduler admits shadow chunks after vLLM's scheduling, so it defers that build
(vLLM's ``_build_kv_connector_meta`` seam) and makes it once over the whole
output. The connector here is vLLM's own ``ExampleConnector`` (shared storage:
it writes stored KV to a folder), which runs on the CPU build; its
``build_connector_meta`` is wrapped to record what it saw. A shadow whose
prefix the connector holds loads it (a synchronous load) and computes only the
rest. Native CPU offloading (``OffloadingConnector``) refuses the CPU build;
its scheduler side is checked in virtual time
(``tests/vllm/test_offloading_virtual.py``); see docs/vllm.md.
"""

from __future__ import annotations

import os

import pytest
from shadow_vllm.engine_config import engine_args
from vllm import SamplingParams
from vllm.config import KVTransferConfig

from shadowcore.wire import ShadowTag, TagKind


def _seen(builds: list[dict], external_id: str) -> list[tuple[int, int]]:
    """(tokens, num_computed_tokens) of one request in every build that scheduled it (vLLM adds a
    suffix to the external request id)."""
    return [n for b in builds for rid, n in b["scheduled"].items() if rid.startswith(f"{external_id}-")]


def _ids(n: int, salt: int) -> list[int]:
    return [10 + (i * 7 + salt * 131) % 300 for i in range(n)]


@pytest.fixture()
def connector_engine(engines, tmp_path):
    store = tmp_path / "kv-store"
    store.mkdir()
    config = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                              kv_connector_extra_config={"shared_storage_path": str(store)})
    llm = engines.start(**engine_args("eager"), kv_transfer_config=config)
    sched = engines.scheduler(llm)
    builds: list[dict] = []
    inner = sched.connector.build_connector_meta

    def recording(out):
        # What the connector sees of each scheduled request: tokens this step and num_computed_tokens.
        meta = inner(out)
        builds.append({
            "scheduled": {rid: (n, sched.requests[rid].num_computed_tokens)
                          for rid, n in out.num_scheduled_tokens.items()},
            "stores": [len(r.token_ids) for r in meta.requests if r.is_store],
            "loads": [len(r.token_ids) for r in meta.requests if not r.is_store],
        })
        return meta

    sched.connector.build_connector_meta = recording
    yield llm, sched, builds, store
    engines.stop(llm)


def test_shadow_chunks_reach_the_connector_metadata_as_vllm_builds_it(connector_engine):
    llm, sched, builds, store = connector_engine
    prompt = _ids(1000, 1)  # 31 full blocks: two chunks of the 512-token budget (512 + 480)
    tag = ShadowTag(TagKind.SHADOW, "s1", "tiny", 0, 1.0)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, extra_args=tag.to_extra_args()),
                       use_tqdm=False)[0]
    assert out.outputs[0].stop_reason == "shadowprefill:prefilled"
    assert sched.shadow_stats.num_chunks == 2 and sched.shadow_stats.num_shadow_tokens == 992

    # Every shadow chunk is in the output the connector saw, with num_computed_tokens as at vLLM's
    # own build (before _update_after_schedule): the chunks start at 0 and at 512.
    assert _seen(builds, out.request_id) == [(512, 0), (480, 512)]
    # The connector planned a store of the shadow's prompt (its first, new-request chunk) and the
    # worker side wrote it.
    assert [992] in [b["stores"] for b in builds]  # its full blocks
    assert os.listdir(store), "the connector's worker stored nothing"


def test_normal_requests_keep_their_connector_view_beside_a_shadow(connector_engine):
    llm, _, builds, _ = connector_engine
    shadow = ShadowTag(TagKind.SHADOW, "s2", "tiny", 0, 1.0).to_extra_args()
    prompts = [{"prompt_token_ids": _ids(1000, 2)}, {"prompt_token_ids": _ids(200, 3)}]
    params = [SamplingParams(max_tokens=1, extra_args=shadow), SamplingParams(max_tokens=3, ignore_eos=True)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    # The normal request: its prefill and then one token per step, each seen before it counts as computed.
    assert _seen(builds, outs[1].request_id) == [(200, 0), (1, 200), (1, 201)]
    # The shadow ran beside it (eager: whole blocks of the budget left), also seen as vLLM's build
    # sees a request: each chunk starts where the ones before it ended, and all full blocks are there.
    chunks = _seen(builds, outs[0].request_id)
    assert len(chunks) >= 2 and chunks[0][0] <= 512 - 200
    assert [start for _, start in chunks] == [sum(n for n, _ in chunks[:i]) for i in range(len(chunks))]
    assert sum(n for n, _ in chunks) == 992


def test_a_shadow_loads_the_connectors_hit_and_computes_only_the_rest(connector_engine):
    llm, sched, builds, _ = connector_engine
    prompt = _ids(480, 4)  # 15 full blocks, one chunk of the 512-token budget
    # A normal request with this prompt: the ExampleConnector stores its first 448 tokens (it keeps
    # whole blocks below the prompt's last token), then the device prefix cache is emptied.
    normal = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert [448] in [b["stores"] for b in builds]
    assert llm.reset_prefix_cache()
    builds.clear()

    tag = ShadowTag(TagKind.SHADOW, "s-load", "tiny", 0, 1.0)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, extra_args=tag.to_extra_args()),
                       use_tqdm=False)[0]
    assert out.outputs[0].stop_reason == "shadowprefill:prefilled"
    # vLLM's own view: the connector was asked at the shadow's admission, planned a load of the
    # 448 stored tokens, and the chunk was scheduled from token 448 on: only the last block computed.
    assert [b["loads"] for b in builds if b["loads"]] == [[448]]
    assert _seen(builds, out.request_id) == [(32, 448)]
    assert sched.shadow_stats.num_loads == 1 and sched.shadow_stats.num_loaded_tokens == 448
    assert sched.shadow_stats.num_dropped_chunks == 0

    # What the shadow holds is real KV on the device: a routed call with the same context finds the
    # whole prompt's blocks cached (vLLM's num_cached_tokens), as it did after the normal request.
    routed = ShadowTag(TagKind.ROUTED, "s-load").to_extra_args()
    follow = llm.generate([{"prompt_token_ids": prompt + _ids(40, 5)}],
                          SamplingParams(max_tokens=1, extra_args=routed), use_tqdm=False)[0]
    assert follow.num_cached_tokens == 480
    assert normal.outputs[0].token_ids  # the stored KV came from a real forward pass


def test_a_shadows_next_chunk_does_not_ask_the_connector_again(connector_engine):
    """A shadow going on where its own last chunk ended is a running request's next chunk: vLLM asks
    no connector for those (only a waiting request's admission does)."""
    llm, sched, _, _ = connector_engine
    asked = []
    inner = sched.connector.get_num_new_matched_tokens
    sched.connector.get_num_new_matched_tokens = lambda request, n: asked.append(n) or inner(request, n)
    tag = ShadowTag(TagKind.SHADOW, "s-next", "tiny", 0, 1.0)
    out = llm.generate([{"prompt_token_ids": _ids(1000, 6)}],
                       SamplingParams(max_tokens=1, extra_args=tag.to_extra_args()), use_tqdm=False)[0]
    assert out.outputs[0].stop_reason == "shadowprefill:prefilled"
    assert sched.shadow_stats.num_chunks == 2 and asked == [0]  # asked at its admission only


def test_a_synchronous_load_never_rides_on_a_step_with_normal_work(connector_engine):
    """A sync load runs inside the step's forward pass: beside a normal request the shadow ignores the
    connector's hit and computes on the device, as without a connector."""
    llm, sched, builds, _ = connector_engine
    prompt = _ids(480, 7)
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)  # stored: 448
    assert llm.reset_prefix_cache()
    builds.clear()
    shadow = ShadowTag(TagKind.SHADOW, "s-busy", "tiny", 0, 1.0).to_extra_args()
    outs = llm.generate([{"prompt_token_ids": _ids(100, 8)}, {"prompt_token_ids": prompt}],
                        [SamplingParams(max_tokens=4, ignore_eos=True), SamplingParams(max_tokens=1, extra_args=shadow)],
                        use_tqdm=False)
    assert outs[1].outputs[0].stop_reason == "shadowprefill:prefilled"
    chunks = _seen(builds, outs[1].request_id)
    assert chunks[0][1] == 0 and sum(n for n, _ in chunks) == 480  # from token 0, every block computed
    assert not [b["loads"] for b in builds if b["loads"]] and sched.shadow_stats.num_loads == 0
