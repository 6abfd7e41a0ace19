"""One seeded P/D scenario through the simulator's P/D cluster
(:class:`shadow_sim.disagg.PDRun`) and through vLLM virtual time
(:class:`~shadow_vllm.virtual.pd.PDVirtualRun`: the P/D shadow schedulers of
:mod:`shadow_vllm.pd` with the real ``NixlConnector`` scheduler side), with
the same policy, the same workload (the simulator's, played again), the same
pools, budgets, SLOs and H100 roofline latency per model.

:func:`run_both` returns both runs with their records: the P engines' planned
steps (:class:`shadowcore.testing.agreement.PlanRecorder`) and every question
to the push policy on each D (:class:`PushRecorder` on the simulator's
fabric, ``scheduler.shadow_push_decisions`` on vLLM's);
:func:`compare_pushes` matches push decisions by their inputs;
:func:`summary` gives the transfer figures of the simulator's P/D finding
side by side. Used by ``tests/vllm/test_pd_agreement.py`` and
``benchmarks/vllm_pd.py``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import attrs

from shadow_vllm.pd import DecodeShadowScheduler, PrefillShadowScheduler, PushDecision
from shadow_vllm.virtual.config import VirtualEngineConfig
from shadow_vllm.virtual.feeder import TaggedShadowFeeder
from shadow_vllm.virtual.pd import PDVirtualRun
from shadowcore.config import PluginRef, ShadowConfig
from shadowcore.testing import agreement


@attrs.define(eq=False)
class PushRecorder:
    """Wraps the simulator fabric's push policy: records each question and answer."""

    policy: Any
    loop: Any
    decisions: dict[str, list[PushDecision]] = attrs.Factory(dict)

    def pull(self, link: Any, candidates: Sequence[Any]) -> Any:
        grant = self.policy.pull(link, candidates)
        cands = tuple(sorted((c.job.session_id, c.job.target_model, c.num_prefill_held_tokens,
                              c.num_decode_held_tokens, round(c.switch_probability, 12)) for c in candidates))
        g = None if grant is None else (grant.job.session_id, grant.job.target_model, grant.start_token,
                                        grant.num_tokens)
        self.decisions.setdefault(link.decode_instance_id, []).append(PushDecision(
            link.decode_instance_id, self.loop.now_s, link.link_busy, link.num_free_tokens, cands, g))
        return grant


@attrs.frozen
class PushAgreement:
    decode_id: str
    num_decisions: tuple[int, int]  # (simulator, vLLM)
    num_grants: tuple[int, int]
    num_matched: int  # vLLM decisions whose inputs the simulator also saw
    num_matched_with_grants: int
    mismatches: tuple[tuple[PushDecision, PushDecision], ...]  # same inputs, different grant
    num_same_grant_sequence: int  # leading grants identical in both (job, start, tokens)


def compare_pushes(decode_id: str, sim: Sequence[PushDecision], vllm: Sequence[PushDecision]) -> PushAgreement:
    by_inputs: dict[tuple, PushDecision] = {}
    for d in sim:
        by_inputs.setdefault(d.inputs, d)
    matched = [(by_inputs[d.inputs], d) for d in vllm if d.inputs in by_inputs]
    sim_grants = [d.grant for d in sim if d.grant is not None]
    vllm_grants = [d.grant for d in vllm if d.grant is not None]
    lead = 0
    for a, b in zip(sim_grants, vllm_grants, strict=False):
        if a != b:
            break
        lead += 1
    return PushAgreement(
        decode_id, (len(sim), len(vllm)), (len(sim_grants), len(vllm_grants)), len(matched),
        sum(1 for a, b in matched if a.grant or b.grant), tuple((a, b) for a, b in matched if a.grant != b.grant),
        lead)


def _pd_run_cls(decode_latency: Any) -> type:
    """The simulator's ``PDRun``, its D instances on ``decode_latency`` when given."""
    from shadow_sim.disagg import DecodeInstance, PDRun

    if decode_latency is None:
        return PDRun

    @attrs.define(eq=False)
    class _PDRun(PDRun):
        def build_instance(self, instance_id: str, model: str, kv_policy: Any, engine_cls: type = DecodeInstance
                           ) -> Any:
            inst = super().build_instance(instance_id, model, kv_policy, engine_cls)
            if engine_cls is DecodeInstance:
                inst.latency = decode_latency
            return inst

    return _PDRun


def run_both(scenario: dict, policy: str = "harvest-slo", record: bool = True, decode_latency: Any = None,
             charge_tokens: bool = True, **policy_args: Any) -> tuple:
    """(sim run, vLLM virtual run, sim P recorder, vLLM P recorder, sim push recorder), both run.

    ``decode_latency``: the latency model of every D instance in both runs (default: the model's
    roofline, as P). The agreement test gives D a model whose step time does not depend on
    context: vLLM's D recomputes the last prompt token after a remote prefill (context one
    shorter than the simulator's first D decode, which computes P's first token), and with a
    context-dependent model that one-token shift moves every later call by microseconds.
    ``charge_tokens``: the fake link charges a read by its tokens, as the simulator charges a
    transfer (False: by whole blocks, as ``NixlConnector`` moves them)."""
    from shadow_sim.simulator import SimScenario

    sc = SimScenario.from_dict(scenario)
    shadow = ShadowConfig(PluginRef(policy, policy_args))
    sim_rec = agreement.PlanRecorder(lambda i: [j for j in sim.runtime.manager.jobs() if j.instance_id == i])
    sim = _pd_run_cls(decode_latency)(sc, shadow, (sim_rec,) if record else ())
    push_rec = PushRecorder(sim.fabric.push_policy, sim.loop)
    sim.fabric.push_policy = push_rec
    sim.run()
    configs, latency = {}, {}
    for m in sc.models:
        inst = sim.cluster.by_model[m][0]
        latency[m] = inst.latency
        extra = {"shadowprefill": {
            "shadow": json.loads(shadow.to_json()),
            "slo": {"ttft_s": sc.slo.ttft_s, "tpot_s": inst.tpot_slo_s},
            "latency": {"name": "shadow_sim.latency:latency_model", "args": {"name": m, "kind": "roofline"}},
            "keep_tails_below_n_min": True,
        }}
        configs[m] = VirtualEngineConfig(
            block_size=sc.block_size, num_blocks=inst.kv.num_blocks + 1,  # + vLLM's null block
            max_num_batched_tokens=sc.token_budget, max_num_seqs=sc.max_num_seqs,
            max_model_len=max(32768, 4 * sc.input_tokens_median * sc.calls_per_session), additional_config=extra)
    # The simulator's link is link_bytes_per_s per GPU of the D instance: per block, bytes per GPU.
    bytes_per_block = {m: int(sim.cluster.decode[m][0].kv.kv_bytes_per_token * sc.block_size
                              / sim.cluster.decode[m][0].num_gpus) for m in sc.models}
    vrun = PDVirtualRun(sc, shadow, sc.pd, latency, configs, PrefillShadowScheduler, DecodeShadowScheduler,
                        TaggedShadowFeeder(), workload=sim.workload, kv_bytes_per_block=bytes_per_block,
                        decode_latency=decode_latency, charge_tokens=charge_tokens)
    vllm_rec = agreement.PlanRecorder(
        lambda i: [e.job for e in vrun.cluster.by_id[i].scheduler.shadow_jobs.entries()])
    for engine in vrun.cluster.by_id.values():
        engine.scheduler.shadow_hook.observers.add(vllm_rec)
    vrun.run()
    return sim, vrun, sim_rec, vllm_rec, push_rec


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summary(sim: Any, vrun: PDVirtualRun, warmup_s: float = 0.0) -> dict[str, dict[str, float]]:
    """The simulator's P/D transfer figures, and vLLM virtual time's, per measured switch call."""
    per_token = {m: ds[0].kv.kv_bytes_per_token for m, ds in sim.cluster.decode.items()}
    sim_sw = [c for c in sim.calls if c.arrival_s >= warmup_s and c.is_switch]
    sim_recs = [sim.fabric.transfers.get(f"{c.session_id}#{c.call_index}") for c in sim_sw]
    sim_recs = [r for r in sim_recs if r is not None]
    reads = {r.request_id: r for r in vrun.fabric.reads if not r.is_push}
    v_sw = [c for c in vrun.calls if c.arrival_s >= warmup_s and c.is_switch]
    v_bytes = [0.0 if (r := reads.get(f"{c.session_id}#{c.call_index}@d")) is None
               else vrun.fabric.read_tokens(r) * per_token[c.model] for c in v_sw]
    sim_push = sum(float(s.num_pushed_tokens) for s in [sim.fabric])
    v_push = sum(e.scheduler.shadow_push_stats.num_pushed_tokens for ds in vrun.decode.values() for e in ds)
    v_dropped = sum(e.scheduler.shadow_push_stats.num_dropped_push_tokens for ds in vrun.decode.values() for e in ds)
    return {
        "simulator": {
            "switch_calls": len(sim_sw), "switch_transfer_MB": _mean([r.num_bytes for r in sim_recs]) / 1e6,
            "pushed_tokens": sim_push, "pushed_tokens_dropped": float(sim.fabric.num_dropped_push_tokens),
            "shadow_tokens_P": float(sum(i.num_shadow_tokens for ps in sim.cluster.by_model.values() for i in ps)),
        },
        "vllm_virtual": {
            "switch_calls": len(v_sw), "switch_transfer_MB": _mean(v_bytes) / 1e6,
            "pushed_tokens": float(v_push), "pushed_tokens_dropped": float(v_dropped),
            "shadow_tokens_P": float(sum(e.scheduler.shadow_stats.num_shadow_tokens
                                         for e in vrun.cluster.by_id.values())),
        },
    }


__all__ = ["PushAgreement", "PushRecorder", "compare_pushes", "run_both", "summary"]
