"""One seeded P/D scenario through the simulator's P/D cluster
(:class:`shadow_sim.disagg.PDRun`) and through vLLM virtual time
(:class:`~shadow_vllm.virtual.pd.PDVirtualRun`: the P/D shadow schedulers of
:mod:`shadow_vllm.pd` with the real ``NixlConnector`` scheduler side), with
the same policy, the same workload (the simulator's, played again), the same
pools, budgets, SLOs and H100 roofline latency per model.

:func:`sim_run` and :func:`virtual_run` build and run the two (the caller may
attach recorders: the agreement harness's ``PlanRecorder`` on P hooks and
``PushRecorder`` on the simulator's push policy; vLLM's D schedulers record
their push decisions themselves, ``scheduler.shadow_push_decisions``);
:func:`summary` gives the transfer figures of the simulator's P/D finding
side by side. Used by ``tests/vllm/test_pd_agreement.py`` and
``benchmarks/vllm_pd.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from shadow_vllm.pd import DecodeShadowScheduler, PrefillShadowScheduler
from shadow_vllm.virtual.config import VirtualEngineConfig
from shadow_vllm.virtual.feeder import TaggedShadowFeeder
from shadow_vllm.virtual.pd import PDVirtualRun
from shadowcore.config import PluginRef, ShadowConfig


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


def sim_run(scenario: dict, policy: str = "harvest-slo", observers: tuple = (), decode_latency: Any = None,
            push_wrapper: Callable[[Any, Callable[[], float]], Any] | None = None, run: bool = True,
            **policy_args: Any) -> Any:
    """The simulator's ``PDRun`` of ``scenario`` (its fields, ``pd`` included), run (unless ``run``
    is false: then the caller runs it, e.g. once its observers can reach the run).

    ``decode_latency``: the latency model of every D instance (default: the model's, as P). The
    agreement test gives D (in both runs) a model whose step time does not depend on context:
    vLLM's D recomputes the last prompt token after a remote prefill (context one shorter than the
    simulator's first D decode, which computes P's first token), and with a context-dependent
    model that one-token shift moves every later call by microseconds. ``push_wrapper(policy,
    clock)`` replaces the fabric's push policy (a recorder)."""
    from shadow_sim.simulator import SimScenario

    sc = SimScenario.from_dict(scenario)
    sim = _pd_run_cls(decode_latency)(sc, ShadowConfig(PluginRef(policy, policy_args)), observers)
    if push_wrapper is not None:
        sim.fabric.push_policy = push_wrapper(sim.fabric.push_policy, lambda: sim.loop.now_s)
    if run:
        sim.run()
    return sim


def virtual_run(sim: Any, decode_latency: Any = None, charge_tokens: bool = True,
                observer: Callable[[PDVirtualRun], Any] | None = None) -> PDVirtualRun:
    """The same workload (``sim.workload``), policy, pools, budgets, SLOs and latency models (D's:
    ``decode_latency`` as in :func:`sim_run`) on vLLM's P/D schedulers in virtual time, run.
    ``charge_tokens``: the fake link charges a read by its tokens, as the simulator charges a
    transfer (False: by whole blocks, as ``NixlConnector`` moves them). ``observer(vrun)``, when
    given, is added to every P engine's hook before the run."""
    sc, shadow = sim.scenario, sim.shadow
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
    if observer is not None:
        obs = observer(vrun)
        for engine in vrun.cluster.by_id.values():
            engine.scheduler.shadow_hook.observers.add(obs)
    vrun.run()
    return vrun


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


__all__ = ["sim_run", "summary", "virtual_run"]
