"""Where the request-level baseline's switch-call TTFT lead on the testbed's quick check comes from
(issue 16 item 7): one seed of ``reproduce --testbed --quick`` (L8/L70, rho 0.3), every arm in vLLM
virtual time, and per arm:

* switch calls by direction (to the 8B or to the 70B): count, mean TTFT, and the share of the
  prompt cached on arrival (``hit``), with ``complete``: the share of switch calls whose cached
  prefix reached the previous call's whole context (prompt + output, whole blocks): the shadow was
  complete when the call came;
* shadow tokens computed per instance (from the engines' steps);
* engine-level arms: planned iterations of each instance by budget reason (idle / slo-slack /
  routed-credit / gated) and by what came of them (``EngineHook.step_counts``), shadow-block
  evictions (``ShadowKVBridge.eviction_count``) and the shadow stats.

``--gaps``: per switch call whose shadow was incomplete, the missing tokens, the tool gap
(previous call's end to this call's arrival), its planned iterations on the instance by budget
cause (``(routed<=0)``: the routed decodes' Eq. 1 slack gone at the margin that applied;
``[batch<=0]``: the batch's too), in how many of them the session had a job pending on the target
(``own-job-pending``; 0: no job to prefill, e.g. the targeting's gate left it out), whether the first
pending job was imminent, and the tokens granted to that session and to others.

Usage: ``python benchmarks/testbed_diag.py --seed 100 --policy idle-first-host
--policy 'idle-first-host:{"routed_decode_margin":0.4}'``. Prints a table per arm; a diagnostic,
not a result (the testbed's results are ``reproduce --testbed``'s).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import sys

import attrs


def run(seed: int, arm: str, policy) -> dict:
    from shadow_vllm.virtual import testbed as tb

    ex = tb.experiment(tb.PAIRS["L8/L70"], 0.3, tb.QUICK)
    sim = tb.draw(ex, seed)
    engine_level = policy is not None
    vr = tb.build_arm(sim, ex, arm, policy, seed)
    reasons: dict[str, collections.Counter] = {}
    timeline: dict[str, list] = {}
    last: dict[str, dict] = {}
    if engine_level:
        for name, engine in vr.cluster.by_id.items():
            hook = engine.scheduler.shadow_hook
            counter = reasons.setdefault(name, collections.Counter())
            seen = last.setdefault(name, {})
            slack = hook.slack
            orig = slack.budget

            def budget(snapshot, lat, orig=orig, counter=counter, slack=slack, last=seen, **imminence):
                b = orig(snapshot, lat, **imminence)  # imminent= for a controller that reads_imminence
                kind = "routed-prefill" if snapshot.has_routed and _prefilling(snapshot) else \
                    "routed-decode" if snapshot.has_routed else "no-routed"
                why = b.reason.value
                if b.reason.value == "slo-slack" and b.budget_s <= 0 and kind == "routed-decode":
                    from shadowcore.slack import min_batch_slack_s, routed_decode_slack_s

                    rm = slack.imminent_margin if imminence.get("imminent") else slack.routed_decode_margin
                    routed = routed_decode_slack_s(snapshot, max(slack.margin, rm or slack.margin))
                    batch = min_batch_slack_s(snapshot, lat, slack.margin, slack.chunk_tokens)
                    why += "(routed<=0)" if routed <= 0 else "(batch<=0)" if batch <= 0 else "(small)"
                    if routed <= 0 and batch <= 0:
                        why += "[batch<=0]"
                counter[(why, kind, b.budget_s > 0)] += 1
                last["why"], last["imminent"] = why, bool(imminence.get("imminent"))
                return b
            slack.budget = budget
            hook.observers.add(_Timeline(timeline.setdefault(name, []), vr, last[name], hook))
    vr.run()
    measured = {p.session_id for p in sim.workload.sessions if ex.warmup_s <= p.arrival_s < ex.end_s}
    prev_ctx = {}
    outputs = {(p.session_id, i): c.num_output_tokens for p in sim.workload.sessions for i, c in enumerate(p.calls)}
    ends = {(c.session_id, c.call_index): c.arrival_s + c.latency_s for c in vr.calls}
    for c in vr.calls:
        prev_ctx[(c.session_id, c.call_index)] = c.num_prompt_tokens + outputs[(c.session_id, c.call_index)]
    out = {"timeline": timeline, "switch": {}, "shadow_tokens": {}, "reasons": reasons, "hook": {}, "evictions": {}, "stats": {}}
    for c in vr.calls:
        if not c.is_switch or c.session_id not in measured:
            continue
        ctx = prev_ctx.get((c.session_id, c.call_index - 1), 0) // 16 * 16
        key = c.model
        d = out["switch"].setdefault(key, [])
        prev = ends.get((c.session_id, c.call_index - 1), math.nan)
        d.append((c.ttft_s, c.num_cached_tokens, c.num_prompt_tokens, ctx, c.session_id, c.call_index,
                  prev, c.arrival_s))
    for name, engine in vr.cluster.by_id.items():
        out["shadow_tokens"][name] = sum(r.num_scheduled_tokens for s in engine.steps for r in s.batch
                                         if tb._is_shadow(r.request_id))
        if engine_level:
            sch = engine.scheduler
            out["hook"][name] = dict(sch.shadow_hook.step_counts)
            out["evictions"][name] = sch.shadow_bridge.eviction_count
            out["stats"][name] = attrs.asdict(sch.shadow_stats)
    return out


class _Timeline:
    """An observer of one hook's plans: (virtual time, budget reason, routed kind, granted tokens,
    budget why (with the zero-slack cause), whether the first job was imminent, budget s, base s,
    decode-only, {session: tokens granted}, sessions with a pending job on the instance)."""

    def __init__(self, rows: list, vr, last: dict, hook) -> None:
        self.rows, self.vr, self.last, self.hook = rows, vr, last, hook

    def on_plan(self, snapshot, plan) -> None:
        kind = "routed-prefill" if snapshot.has_routed and _prefilling(snapshot) else \
            "routed-decode" if snapshot.has_routed else "no-routed"
        per: dict[str, int] = {}
        for g in plan.grants:
            per[g.job.session_id] = per.get(g.job.session_id, 0) + g.num_tokens
        decode_only = snapshot.aggregate is None and snapshot.batch_shape.is_decode_only
        self.rows.append((self.vr.loop.now_s, plan.budget.reason.value, kind, sum(g.num_tokens for g in plan.grants),
                          self.last.get("why", plan.budget.reason.value), self.last.get("imminent", False),
                          plan.budget.budget_s, plan.predicted_base_s, decode_only, per,
                          frozenset(j.key.session_id for j in self.hook.manager.pending_jobs(self.hook.instance_id))))


def _gaps(r: dict) -> None:
    """Print one line per incomplete switch call (engine-level arms) and a summary of the causes."""
    totals: collections.Counter = collections.Counter()
    for model, rows in sorted(r["switch"].items()):
        inst = next((n for n in r["timeline"] if n.startswith(model) or model in n), None)
        tl = r["timeline"].get(inst, [])
        for ttft, cached, prompt, ctx, sid, idx, prev, arrival in rows:
            if cached >= ctx:
                continue
            gap = [x for x in tl if prev <= x[0] < arrival]
            whys = collections.Counter((x[4], x[2]) for x in gap)
            own = sum(x[9].get(sid, 0) for x in gap)
            other = sum(x[3] for x in gap) - own
            imm = sum(1 for x in gap if x[5])
            zero_do = sum(1 for x in gap if x[3] == 0 and x[8] and x[2] != "no-routed")
            with_job = sum(1 for x in gap if sid in x[10])  # 0: no job of this session pending on the target
            totals.update({"calls": 1, "missing": ctx - cached, "gap_iters": len(gap), "own": own, "other": other,
                           "calls_without_a_pending_job": with_job == 0})
            totals.update({f"{w}/{k}": v for (w, k), v in whys.items()})
            print(f"    miss {model} {sid}#{idx}: missing={ctx - cached} of ctx={ctx} gap={arrival - prev:.2f}s "
                  f"iters={len(gap)} own-job-pending={with_job} first-imminent={imm} decode-only-zero={zero_do} granted own={own} "
                  f"other={other} ttft={ttft:.2f}s by cause: "
                  + ", ".join(f"{w}/{k}={v}" for (w, k), v in sorted(whys.items())))
    print("    miss totals: " + ", ".join(f"{k}={v}" for k, v in sorted(totals.items())))


def _prefilling(snapshot) -> bool:
    from shadowcore.slack import routed_prefilling

    return routed_prefilling(snapshot)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=100)
    ap.add_argument("--policy", action="append", default=[])
    ap.add_argument("--no-baselines", action="store_true")
    ap.add_argument("--json", help="write the per-switch-call rows here")
    ap.add_argument("--gaps", action="store_true",
                    help="per switch call whose shadow was incomplete: missing tokens, the tool gap's length, its "
                         "iterations on the target instance by budget cause, and tokens granted to that session")
    a = ap.parse_args(argv)
    from shadowcore.config import parse_ref

    arms = ([] if a.no_baselines else [("no-shadow", None), ("request-level", None)]) + \
        [(p, parse_ref(p)) for p in a.policy]
    dump = {}
    for arm, pol in arms:
        r = run(a.seed, arm, pol)
        dump[arm] = r["switch"]
        dump.setdefault("_timeline", {})[arm] = r["timeline"]
        print(f"== seed {a.seed} {arm}")
        for model, rows in sorted(r["switch"].items()):
            n = len(rows)
            hit = sum(x[1] for x in rows) / sum(x[2] for x in rows)
            comp = sum(1 for x in rows if x[1] >= x[3]) / n
            print(f"  switch to {model}: n={n} ttft={sum(x[0] for x in rows) / n:.3f}s hit={hit:.3f} "
                  f"complete={comp:.2f} missing_tokens={sum(max(0, x[3] - x[1]) for x in rows)}")
        print(f"  shadow tokens: {r['shadow_tokens']}")
        for name, c in r["reasons"].items():
            print(f"  {name} budgets: " + ", ".join(f"{k[0]}/{k[1]}/{'pos' if k[2] else 'zero'}={v}"
                                                    for k, v in sorted(c.items())))
            print(f"  {name} outcome: {r['hook'][name]} evictions={r['evictions'][name]}")
            print(f"  {name} stats: {r['stats'][name]}")
        if a.gaps and pol is not None:
            _gaps(r)
        sys.stdout.flush()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dump, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
