"""Break each invariant on purpose and check that its named test fails.

Each mutation is (test file, test name, source file, old text, new text
[, expected count]). The script copies the repository to a temporary folder,
applies one mutation there (the checkout is never edited), runs the named
test and reports whether it failed. Exit status 1 if any mutant survives.

    python tools/mutants.py            # all
    python tools/mutants.py cap topk   # some
    python tools/mutants.py --list     # names, source files, tests
    python tools/mutants.py --check    # every anchor still applies (no test run; tests/test_mutants_apply.py)

Anchors are exact source text: when a refactor moves them the script says
which mutation no longer applies.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UNIT = "tests/test_invariants_unit.py"
E2E = "tests/test_invariants_e2e.py"
AUTH = "tests/gateway/test_auth.py"
MALFORMED = "tests/gateway/test_malformed.py"
KV_EQ = "tests/sim/test_speed_equivalence_kv.py"
KV_PRIV = "tests/sim/test_kv_private_review.py"
KV_OWED = "tests/sim/test_kv_owed_reads.py"
KIT_IMM = "tests/test_kit_imminent_first.py"
DEFER = "tests/sim/test_deferred_instances.py"
EVICT_CLASSES = "_SHADOW_FIRST = (KVClass.SHADOW, KVClass.NORMAL)"

MUTATIONS: dict[str, tuple] = {
    "gate": (UNIT, "test_no_shadow_while_waiting_or_blocked", "shadowcore/slack.py",
             '    """Algorithm 1 line 1: nothing while anything waits or is blocked."""\n',
             '    """Algorithm 1 line 1: nothing while anything waits or is blocked."""\n    return None\n'),
    "budget-hook": (UNIT, "test_predicted_iteration_within_budget", "shadowcore/hook.py",
                    "used = t - base_s if budget.bounds_stretch else t", "used = t - base_s"),
    "budget-slo": (UNIT, "test_predicted_iteration_within_budget", "shadowcore/slack.py",
                   "return SlackBudget(max(0.0, min(cap, slack)), BudgetReason.SLO_SLACK)",
                   "return SlackBudget(cap, BudgetReason.SLO_SLACK)", 2),  # the routed-decode and the other return
    # idle: the hand-worked test (the slack machine's property test found it in 5 of 6 fresh runs in
    # session 11, and a full mutants run missed it once)
    "idle": ("tests/test_core_units.py", "test_line3_idle_instance_gets_beta_T", "shadowcore/slack.py",
             "return SlackBudget(cap, BudgetReason.IDLE)", "return SlackBudget(2 * cap, BudgetReason.IDLE)", 2),
    "credit-earn": (UNIT, "test_routed_stretch_bounded_by_delta_decode_time", "shadowcore/slack.py",
                    "and self.accrues(snapshot.batch_shape.is_decode_only, snapshot.has_routed,",
                    "and self.accrues(True, snapshot.has_routed,"),
    "credit-denominator": (UNIT, "test_routed_stretch_bounded_by_delta_decode_time", "shadowcore/slack.py",
                           "return decode_only and (routed or self.accrual is CreditAccrual.ALL_DECODE)",
                           "return decode_only"),  # the old reading: every decode-only iteration earns
    "credit-spend": (UNIT, "test_routed_stretch_bounded_by_delta_decode_time", "shadowcore/slack.py",
                     "self.balance_s -= cost", "pass"),
    # routed_decode_margin (idle-first-host's item 7 rule): a routed prefill in the batch leaves the iteration
    # to the credit; routed decodes' slack is taken at their own margin; the routed-prefill credit earns only there
    "routed-prefilling": ("tests/test_core_units.py", "test_routed_decode_margin_budget", "shadowcore/slack.py",
                          "return any(r.kind is RequestKind.ROUTED and r.phase is Phase.PREFILL for r in snapshot.batch)",
                          "return False"),
    "routed-decode-margin": ("tests/test_core_units.py", "test_routed_decode_margin_budget", "shadowcore/slack.py",
                             "slack = routed_decode_slack_s(snapshot, max(self.margin, routed_margin or self.margin))",
                             "slack = routed_decode_slack_s(snapshot, self.margin)"),
    # imminent_margin (idle-first-host's imminent-job rule, item 7): the looser margin only when the first
    # pending job is imminent (below the core margin it changes nothing: the batch's own slack counts every
    # decode at that margin, so that mutant would be equivalent); imminence tracked from call end to next arrival,
    # carried by the tag and the engine's job table, re-sent by the feeder when it changes
    "imminent-ignored": ("tests/test_core_units.py", "test_imminent_margin_budget", "shadowcore/slack.py",
                         "routed_margin = self.imminent_margin if imminent and self.imminent_margin is not None",
                         "routed_margin = self.imminent_margin if self.imminent_margin is not None"),
    "imminent-any-job": ("tests/test_core_units.py", "test_imminent_margin_budget", "shadowcore/hook.py",
                         "imminent=bool(jobs) and jobs[0].imminent", "imminent=any(j.imminent for j in jobs)"),
    "imminent-not-cleared": ("tests/test_session_end.py", "test_jobs_are_imminent_exactly_during_the_tool_gap",
                             "shadowcore/manager.py", "            job.imminent = False\n", "            pass\n"),
    "imminent-untracked": ("tests/test_session_end.py", "test_jobs_are_imminent_exactly_during_the_tool_gap",
                           "shadowcore/manager.py", "        if self.track_imminence:\n", "        if True:\n"),
    # imminent_first (item 7's grant order): imminent jobs before the others, each group in the source's
    # order, only under the option; the grants say so and the contract's order rule reads it
    # imminent_stretch (item 7's bounded request-level-like spend): (1 + x) * base, imminent jobs only,
    # within (1 - m) * T, decodes' slack at margin 0, normal prefills' TTFT slack and beta * T, never next to
    # a routed prefill
    "stretch-not-imminent": ("tests/test_core_units.py", "test_imminent_stretch_budget_by_hand", "shadowcore/slack.py",
                             "stretch = imminent and self.imminent_stretch is not None",
                             "stretch = self.imminent_stretch is not None"),
    "stretch-no-prefill-slack": ("tests/test_core_units.py", "test_imminent_stretch_budget_by_hand",
                                 "shadowcore/slack.py",
                                 "               normal_prefill_slack_s(snapshot, latency, margin, chunk_tokens))",
                                 "               math.inf)"),
    "stretch-agg-zero": ("tests/sim/test_idle_first.py", "test_imminent_stretch_same_on_the_lazy_cohort_path",
                         "shadowcore/slack.py", "base_s = math.inf if snapshot.aggregate is not None else",
                         "base_s = 0.0 if snapshot.aggregate is not None else"),
    "stretch-decodes-ignored": ("tests/test_core_units.py", "test_imminent_stretch_budget_by_hand",
                                "shadowcore/slack.py",
                                "(1.0 - margin) * snapshot.tpot_slo_s, decodes,",
                                "(1.0 - margin) * snapshot.tpot_slo_s,"),
    "stretch-no-pace-cap": ("tests/test_core_units.py", "test_imminent_stretch_budget_by_hand", "shadowcore/slack.py",
                            "(1.0 - margin) * snapshot.tpot_slo_s, decodes,", "math.inf, decodes,"),
    "stretch-uncapped": ("tests/test_core_units.py", "test_imminent_stretch_budget_by_hand", "shadowcore/slack.py",
                         "return SlackBudget(max(0.0, min(cap, slack)), BudgetReason.SLO_SLACK)  # routed decodes only",
                         "return SlackBudget(max(0.0, slack), BudgetReason.SLO_SLACK)"),
    "stretch-times-base": ("tests/test_core_units.py", "test_imminent_stretch_budget_by_hand", "shadowcore/slack.py",
                           "(1.0 + stretch) * base_s", "stretch * base_s + base_s * 2"),
    "stretch-routed-prefill": ("tests/test_core_units.py", "test_imminent_stretch_budget_by_hand",
                               "shadowcore/slack.py",
                               "if routed_prefilling(snapshot) or (routed_margin is None and not stretch):",
                               "if not stretch and (routed_prefilling(snapshot) or routed_margin is None):"),
    "stretch-off-ignored": ("tests/test_core_units.py", "test_imminent_stretch_rejects_bad_values",
                            "shadowcore/slack.py",
                            "validator=attrs.validators.optional(fraction_open_closed))",
                            "validator=None)"),
    "imminent-first-off": ("tests/test_core_units.py", "test_imminent_first_grant_order", "shadowcore/hook.py",
                           "return grant_order(jobs) if self.slack.imminent_first else jobs", "return jobs"),
    "imminent-first-always": ("tests/test_core_units.py", "test_imminent_first_grant_order", "shadowcore/hook.py",
                              "return grant_order(jobs) if self.slack.imminent_first else jobs",
                              "return grant_order(jobs)"),
    "imminent-first-unstable": ("tests/test_core_units.py", "test_imminent_first_grant_order", "shadowcore/hook.py",
                                "return [j for j in jobs if j.imminent] + [j for j in jobs if not j.imminent]",
                                "return sorted(jobs, key=lambda j: (not j.imminent, j.switch_probability))"),
    "imminent-first-manager": (UNIT, "test_jobs_served_in_nonincreasing_switch_probability", "shadowcore/hook.py",
                               "return [j for j in jobs if j.imminent] + [j for j in jobs if not j.imminent]",
                               "return list(jobs)"),
    "imminent-first-untracked": ("tests/test_core_units.py", "test_imminent_first_tells_the_budget_of_any_imminent_job",
                                 "shadowcore/slack.py", "return self.imminent_margin is not None or self.imminent_first",
                                 "return self.imminent_margin is not None"),
    "kit-imminent-order": ("tests/test_core_units.py", "test_order_rule_of_the_contract_reads_imminent_first",
                           "shadowcore/testing/contracts.py",
                           "keys = [(plan.imminent_first and g.imminent, g.switch_probability) for g in plan.grants]",
                           "keys = [(g.imminent, g.switch_probability) for g in plan.grants]"),
    # the kit's slack machine under imminent_first (review, session 11): a plugin controller with imminent jobs
    # passes (the machine expects the imminent-first order and fills its liveness probe in it), one whose plans
    # do not follow that order is caught (by the source's recorded order, or by the grants' own keys)
    "kit-slack-imminent-order": (KIT_IMM, "test_plugin_imminent_first_controller_passes_the_kit",
                                 "shadowcore/testing/machines/slack.py",
                                 "                order = _grant_order(served, plan)\n",
                                 "                order = served\n"),
    "kit-slack-imminent-maximal": (KIT_IMM, "test_plugin_imminent_first_controller_passes_the_kit",
                                   "shadowcore/testing/machines/slack.py",
                                   "            for s in _grant_order(served, plan):  # filled greedily",
                                   "            for s in served:  # filled greedily"),
    "kit-slack-job-order": (KIT_IMM, "test_kit_catches_a_controller_turning_imminent_first_on_mid_step",
                            "shadowcore/testing/machines/slack.py",
                            "                assert [g.job for g in grants] == [s.key for s in order[: len(grants)]], (",
                            "                assert True or [g.job for g in grants] == [s.key for s in order[: len(grants)]], ("),
    "kit-slack-grant-keys": (KIT_IMM, "test_kit_catches_a_planner_ignoring_imminent_first_by_the_grants_alone",
                             "shadowcore/testing/machines/slack.py",
                             "            assert all(a >= b for a, b in itertools.pairwise(ps)), f",
                             "            assert True or all(a >= b for a, b in itertools.pairwise(ps)), f"),
    # the kit's credit check knows Harvest-SLO's routed margins (routed decodes paid from slack, not credit)
    "kit-slack-routed-margin": (KIT_IMM, "test_shipped_imminent_first_controller_passes_the_kit",
                                "shadowcore/testing/machines/slack.py",
                                "            return _routed_prefill(snapshot) or (routed_margin is None and not stretch)",
                                "            return True"),
    "imminent-first-unread": (KIT_IMM, "test_imminent_first_without_reading_imminence_is_an_error",
                              "shadowcore/hook.py", "        if self.slack.imminent_first and not self.slack.reads_imminence:",
                              "        if False:"),
    "kit-slack-stretch": (KIT_IMM, "test_shipped_imminent_stretch_controller_passes_the_kit",
                          "shadowcore/testing/machines/slack.py",
                          "return _routed_prefill(snapshot) or (routed_margin is None and not stretch)",
                          "return _routed_prefill(snapshot) or routed_margin is None"),
    "kit-probe-imminence": (KIT_IMM, "test_conformance_probe_shows_a_reading_controller_imminent_jobs",
                            "shadowcore/testing/conformance.py",
                            "job.imminent = controller.reads_imminence and (i + round_) % 2 == 1",
                            "job.imminent = False"),
    "imminent-wire": ("tests/test_imminence_wire.py",
                      "test_feeder_resends_a_shadow_when_its_session_enters_and_leaves_the_gap", "shadowcore/wire.py",
                      "                out[IMMINENT_KEY] = True\n", "                pass\n"),
    "imminent-engine-job": ("tests/test_imminence_wire.py",
                            "test_feeder_resends_a_shadow_when_its_session_enters_and_leaves_the_gap",
                            "shadowcore/engine_jobs.py", "epoch=tag.epoch, imminent=tag.imminent,", "epoch=tag.epoch,"),
    "imminent-feeder": ("tests/test_imminence_wire.py",
                        "test_feeder_resends_a_shadow_when_its_session_enters_and_leaves_the_gap",
                        "backends/shadow_vllm/virtual/feeder.py",
                        "job.switch_probability, job.imminent)", "job.switch_probability, False)"),
    "credit-routed-prefill": ("tests/test_core_units.py", "test_routed_prefill_credit_accrual", "shadowcore/slack.py",
                              "            return routed_prefill\n", "            return True\n"),
    "cap": (UNIT, "test_shadow_kv_never_exceeds_cap", "shadowcore/kv.py",
            ("        if kv_class is KVClass.SHADOW and self._num_shadow_blocks + num > self.cap_blocks:\n"
             "            return False\n"), ""),
    "class-order": (UNIT, "test_evict_shadow_before_normal_and_lru_within_class", "shadowcore/kv.py",
                    EVICT_CLASSES, "_SHADOW_FIRST = (KVClass.NORMAL, KVClass.SHADOW)"),
    "lru-mru": (UNIT, "test_evict_shadow_before_normal_and_lru_within_class", "shadowcore/kv.py",
                "zip(idle[cls], repeat(cls))", "zip(reversed(idle[cls]), repeat(cls))",
                "for block, since in idle[cls].items():", "for block, since in reversed(idle[cls].items()):",
                "head = first(num) if first is not None else list(itertools.islice(idle[cls], num))",
                "head = list(itertools.islice(reversed(idle[cls]), num))"),
    "young": (UNIT, "test_shadow_never_displaces_young_entry", "shadowcore/kv.py",
              "return now_s - idle_since_s > self.cold_age_s", "return now_s - idle_since_s >= self.cold_age_s"),
    "order-hook": (UNIT, "test_jobs_served_in_nonincreasing_switch_probability", "shadowcore/hook.py",
                   "    left = num_tokens\n    for job in jobs:\n",
                   "    left = num_tokens\n    for job in sorted(jobs, key=lambda j: j.switch_probability):\n"),
    # a session's first job on a model goes to its least loaded instance, the first in cluster order on ties
    "least-loaded-tie": ("tests/test_manager_placement.py",
                         "test_a_shadow_job_opens_on_the_least_loaded_instance_first_in_order_on_ties",
                         "shadowcore/manager.py", "            if t < best_s:  # strict:",
                         "            if t <= best_s:  # strict:"),
    "order-manager": (UNIT, "test_jobs_served_in_nonincreasing_switch_probability", "shadowcore/manager.py",
                      "    return -job.switch_probability, job.sequence\n",
                      "    return job.switch_probability, job.sequence\n"),
    "index-growth": (UNIT, "test_pending_index_equals_full_scan", "shadowcore/manager.py",
                     "        s.history.append(num_tokens, token_ids)\n        self._touch(s)\n",
                     "        s.history.append(num_tokens, token_ids)\n", 2),
    "index-epoch": (UNIT, "test_pending_index_equals_full_scan", "shadowcore/manager.py",
                    "        s.history.compact(num_tokens, token_ids)\n        self._touch(s)\n",
                    "        s.history.compact(num_tokens, token_ids)\n"),
    "index-inflight": (UNIT, "test_pending_index_equals_full_scan", "shadowcore/manager.py",
                       "            elif not j.num_inflight_tokens:\n", "            else:\n"),
    "index-refresh": (UNIT, "test_pending_index_equals_full_scan", "shadowcore/job.py",
                      "        if self.num_held_tokens < before and self.on_held_lowered is not None:",
                      "        if False:"),
    "topk": (UNIT, "test_top_k_targets_at_most_k", "shadowcore/switch.py",
             "return list(ranked[: self.k])", "return list(ranked[: self.k + 1])"),
    "host-trim": (UNIT, "test_host_tier_capacity_and_reload_cost", "shadowcore/kv.py",
                  ("        if excess > 0:  # the least recent leave first\n"
                   "            self._trim(excess)\n"), ""),
    "host-cost": (UNIT, "test_host_tier_capacity_and_reload_cost", "shadowcore/kv.py",
                  "return num_blocks * self.block_bytes / host.pcie_bytes_per_s",
                  "return num_blocks * self.kv_bytes_per_token / host.pcie_bytes_per_s"),
    "job-unaligned": (UNIT, "test_grants_whole_blocks_within_limits_at_least_n_min_and_maximal", "shadowcore/job.py",
                      "self.num_held_tokens += num_computed - num_computed % self.block_size",
                      "self.num_held_tokens += num_computed"),
    "n_min": (UNIT, "test_grants_whole_blocks_within_limits_at_least_n_min_and_maximal", "shadowcore/hook.py",
              "if smallest > upper or (0 < smallest < upper and not fits(smallest)[0]):", "if False:",
              "if n == 0 or n < self.slack.n_min:", "if n == 0:"),
    "not-maximal": (UNIT, "test_grants_whole_blocks_within_limits_at_least_n_min_and_maximal", "shadowcore/hook.py",
                    "n = lo * block", "n = max(0, lo - 1) * block"),
    "refresh-held": (E2E, "test_no_token_prefilled_twice_on_target", "shadowcore/job.py",
                     "self.num_held_tokens = min(aligned, self.num_target_tokens)", "self.num_held_tokens = 0"),
    "abab-held": (E2E, "test_abab_computes_only_deltas", "shadowcore/job.py",
                  "self.num_held_tokens = min(aligned, self.num_target_tokens)", "self.num_held_tokens = 0"),
    "random-order": (E2E, "test_same_seed_identical_plans", "shadowcore/manager.py",
                     "jobs.sort(key=_priority)",
                     "import random; jobs.sort(key=lambda j: (-j.switch_probability, random.random()))"),
    "keep-chosen-job": (E2E, "test_switch_call_never_waits_on_shadow", "shadowcore/manager.py",
                        "        self._close(JobKey(s.session_id, call.model))\n", "",
                        "            if model == s.current_model or model not in chosen:",
                        "            if model != s.current_model and model not in chosen:",
                        "            job.switch_probability = chosen[model].switch_probability",
                        "            job.switch_probability = chosen[model].switch_probability if model in chosen else 1.0"),
    "kit-gate": ("tests/test_conformance.py", "grant_while_waiting", "shadowcore/testing/contracts.py",
                 "if gated and not exempt and budget.budget_s > 0:", "if False:",
                 "if gated and not exempt and plan.grants:", "if False:"),
    "kit-bounded": ("tests/test_conformance.py", "over_budget", "shadowcore/testing/contracts.py",
                    "if strict and not exempt and budget.budget_s > snapshot.tpot_slo_s + EPS_S:", "if False:"),
    "kit-slo": ("tests/test_conformance.py", "ignores_slack", "shadowcore/testing/contracts.py",
                "if plan.predicted_s > slack + EPS_S:", "if False:"),
    "kit-order": ("tests/test_conformance.py", "out_of_order_jobs", "shadowcore/testing/contracts.py",
                  "if t != ranked[i]:", "if False:"),
    "kit-outside": ("tests/test_conformance.py", "target_outside_ranked", "shadowcore/testing/contracts.py",
                    "i = position.get(model)", "i = position.get(model, 0)"),
    "kit-sum": ("tests/test_conformance.py", "distribution_sums_to_half", "shadowcore/testing/contracts.py",
                "if abs(total - 1.0) > EPS_SUM:", "if False:"),
    "kit-cap": ("tests/test_conformance.py", "over_cap_kv", "shadowcore/testing/contracts.py",
                "cap = declared_cap_blocks(kv)", "cap = kv.cap_blocks"),
    "head-first": ("tests/test_kv_room.py", "test_eviction_takes_a_released_chain_tail_first", "shadowcore/kv.py",
                   "        self._unref(reversed(owner.hashes), (), now_s)", "        self._unref(owner.hashes, (), now_s)"),
    "cold-count": ("tests/test_kv_room.py", "test_shadow_room_matches_definition", "shadowcore/kv.py",
                   "self._evicted_from_idle(list(map(_RELEASE, map(blocks.pop, victims))))",
                   "deque(map(blocks.pop, victims), 0)"),
    # the KV manager's run-at-once paths (issue 17): a spilled run is an LRU of single spills; a hit block leaves
    # its release's (or the cold) count; a chain goes idle at once only when its owner alone holds the head; a
    # normal hit on a run promotes its shadow blocks; a released run goes idle at once only where its owner alone
    # holds it
    "spill-run": ("tests/test_kv_room.py", "test_a_spilled_run_keeps_the_host_tier_an_lru_of_single_spills",
                  "shadowcore/kv.py", "kept = victims[len(victims) - capacity :]", "kept = victims[:capacity]"),
    # the host tier as spilled runs (issue 17): a trim skips the entries reloads left stale (by their spill's
    # stale count), a reload counts each block it takes
    "host-stale": ("tests/test_kv_room.py", "test_a_trim_skips_the_host_entries_reloads_left_stale",
                   "shadowcore/kv.py", "            if token in stale:  # a run with stale entries", "            if False:"),
    "host-stale-count": ("tests/test_kv_room.py", "test_a_trim_skips_the_host_entries_reloads_left_stale",
                         "shadowcore/kv.py", "stale[token] = stale.get(token, 0) + len(list(group))",
                         "stale[token] = stale.get(token, 0) + 1"),
    "cold-stale": ("tests/test_kv_room.py", "test_shadow_room_matches_definition", "shadowcore/kv.py",
                   "            self._leave_idle(map(_RELEASE, compress(states, idle_flags)))\n", "",
                   "            self._leave_idle(releases)\n", "            pass\n",
                   "            self._left_release(first, len(releases))\n", "            pass\n"),
    "evict-releases": ("tests/test_kv_room.py", "test_shadow_room_matches_definition", "shadowcore/kv.py",
                       "j = n if releases[-1] == release else bisect.bisect_right(releases, release, i)", "j = n"),
    "release-shared": ("tests/test_kv_room.py", "test_a_released_run_goes_idle_only_where_no_other_owner_holds_it",
                       "shadowcore/kv.py",
                       "if list(map(_REF, states)).count(1) == n and len(set(hashes)) == n:",
                       "if all(map(_REF, states)) and len(set(hashes)) == n:"),
    "chain-shared-head": ("tests/sim/test_speed_equivalence_kv.py", "test_composites_equal_the_calls_they_replace",
                          "shadowcore/kv.py", "if countOf(map(_REF, map(blocks.__getitem__, head)), 1) == k:",
                          "if all(map(_REF, map(blocks.__getitem__, head))):"),
    "run-promote": ("tests/test_kv_room.py", "test_a_normal_hit_on_a_released_mixed_run_promotes_its_shadow_blocks",
                    "shadowcore/kv.py",
                    "new = {release: (False, 1, since, release)", "new = {release: (used > 0, 1, since, release)",
                    "repeat((False, 1, states[0][2], first))", "repeat((used > 0, 1, states[0][2], first))"),
    "run-promote-held": ("tests/test_kv_room.py",
                         "test_a_normal_hit_on_a_released_mixed_run_promotes_its_shadow_blocks", "shadowcore/kv.py",
                         "new = {s: (s[0] and not normal, s[1] + 1, s[2], s[3])",
                         "new = {s: (s[0], s[1] + 1, s[2], s[3])"),
    # the idle orders as runs (issue 17): compaction keeps every live entry, a release with idle blocks left is
    # never taken for dead, the head's shortcut moves only past a stale entry
    # idle-compact, grow-private: hand-worked tests (the Hypothesis tests they had, test_idle_orders_... and
    # the kit's test_kv_machine_all_checks, each missed it in one of four session-11 runs)
    "idle-compact": (KV_PRIV, "test_private_run_through_a_compaction_equals_named",
                     "shadowcore/kv.py", "live = list(self._live(state, hashes, pos if k == 0 else 0))",
                     "live = list(self._live(state, hashes, pos if k == 0 else 0))[1:]"),
    "idle-dead-run": ("tests/test_kv_room.py", "test_idle_orders_are_the_release_order_of_idle_blocks",
                      "shadowcore/kv.py", "        left = self._idle_left[release] - num\n        if left:",
                      "        left = self._idle_left[release] - num\n        if left > 1:"),
    "idle-head-skip": ("tests/test_kv_room.py", "test_idle_orders_are_the_release_order_of_idle_blocks",
                       "shadowcore/kv.py", "if pos + 1 < n and get(hashes[pos + 1]) is state:",
                       "if pos + 1 < n:"),
    # evictions owed by decode growth (issue 17): made before anything else looks or changes, all of them
    "owed-release": ("tests/test_kv_room.py", "test_decode_growth_evicts_the_blocks_idle_when_it_grew",
                     "shadowcore/kv.py",
                     '''        """Drop an owner's references; its hashed blocks stay cached (idle)."""\n        if self._owed:\n            self._settle()\n''',
                     '''        """Drop an owner's references; its hashed blocks stay cached (idle)."""\n'''),
    "owed-count": ("tests/test_kv_room.py", "test_decode_growth_evicts_the_blocks_idle_when_it_grew",
                   "shadowcore/kv.py", "            self._evict(owed, KVClass.NORMAL, 0.0)",
                   "            self._evict(owed - 1, KVClass.NORMAL, 0.0)"),
    "owed-room": ("tests/test_kv_room.py", "test_decode_growth_evicts_the_blocks_idle_when_it_grew",
                  "shadowcore/kv.py",
                  "if total > free and total > free + self._idle_s.count + self._idle_n.count - self._owed:",
                  "if total > free and total > free + self._idle_s.count + self._idle_n.count:"),
    "grow-private": ("tests/test_kv_room.py", "test_decode_pool_hands_blocks_over_and_changes_nothing_else",
                     "shadowcore/kv.py",
                     "        for owner, n in grown:\n            owner.num_private_blocks += n\n", ""),
    "owe-host": ("tests/test_kv_room.py", "test_an_allocation_that_reloads_from_the_host_tier_evicts_before_the_reload",
                 "shadowcore/kv.py", "        self._take(num_new, kv_class, now_s, owe=not in_host)",
                 "        self._take(num_new, kv_class, now_s, owe=True)"),
    "idle-mixed": ("tests/test_kv_room.py", "test_a_hit_inside_a_release_of_both_classes_is_not_evicted",
                   "shadowcore/kv.py", "            if newly_idle[0] and newly_idle[1]:\n                self._mixed.add(release)\n",
                   ""),
    "victim-runs": ("tests/test_kv_room.py", "test_victim_runs_are_the_first_victims_grouped_by_class",
                    "shadowcore/kv.py",
                    'return self.eviction_order == "shadow-first" and requester is KVClass.NORMAL and not protect',
                    "return requester is KVClass.NORMAL and not protect"),
    # private blocks (issue 17: a normal request's fresh prompt out of the block map): a finished chain goes
    # idle tail first; a private run's live entries are its last idle-left ones (head trim, iteration); naming
    # gives only the blocks still idle their entries; the policy's general orders read a private run's idle times
    "private-order": (KV_EQ, "test_private_blocks_equal_named_ones", "shadowcore/kv.py",
                      "            order = hashes[::-1]\n            self._private_runs[release]",
                      "            order = hashes\n            self._private_runs[release]"),
    "private-live": (KV_EQ, "test_private_blocks_equal_named_ones", "shadowcore/kv.py",
                     "        if state[3] in self._anon:  # a private run: its last releases[r] entries are live",
                     "        if False:"),
    "private-trim": (KV_EQ, "test_private_blocks_equal_named_ones", "shadowcore/kv.py",
                     "            if state[3] in self._anon:  # a private run: live from its last releases[r] entries on",
                     "            if False:"),
    "private-name": (KV_EQ, "test_private_blocks_equal_named_ones", "shadowcore/kv.py",
                     "blocks.update(zip(hashes[len(hashes) - left[state[3]] :], repeat(state)))",
                     "blocks.update(zip(hashes, repeat(state)))"),
    "private-name-order": (KV_EQ, "test_private_blocks_equal_named_ones", "shadowcore/kv.py",
                           "        return map(_SECOND, self._pairs())",
                           "        return map(_SINCE, map(self._blocks.get, iter(self), repeat((0, 0, 0.0, 0))))"),
    "private-lookup": (KV_EQ, "test_private_blocks_equal_named_ones", "shadowcore/kv.py",
                       "        if not n_dev and self._private_heads and hashes and hashes[0] in self._private_heads:",
                       "        if False:"),
    "private-run": (KV_EQ, "test_private_blocks_equal_named_ones",
                    "shadowcore/kv.py", "            self._private_runs[release] = hashes[0]\n",
                    "            self._private_runs[release] = hashes[-1]\n"),
    "private-extend": (KV_EQ, "test_private_blocks_equal_named_ones", "shadowcore/kv.py",
                       ("        if hashes:  # (a private owner's may be a range; it is named above when it grows by hashes)\n"
                        "            owner.hashes.extend(hashes)\n"),
                       "        owner.hashes.extend(hashes)\n"),
    "private-head-run": (KV_EQ, "test_private_blocks_equal_named_ones", "shadowcore/kv.py",
                         "            if head is None:\n                deque(map(blocks.__delitem__, piece), 0)",
                         "            if False:\n                deque(map(blocks.__delitem__, piece), 0)"),
    # a whole run with private normal KV equals it with every block named (preemptions, host tier, shadows)
    # a re-admitted (preempted) private request passes private=True again: allocate's may_hold_prefix check
    # alone makes it named while its released blocks are cached (one owner of the rule; session 13)
    "private-readmit": ("tests/sim/test_speed_equivalence_macro.py", "test_private_normal_kv_changes_nothing",
                        "shadowcore/kv.py", "        if private and not (hashes and self.may_hold_prefix(hashes[0])):",
                        "        if private:"),
    # issue 16 item 7's testbed bar (reproduce --testbed): a tie with request-level meets it; same-model TTFT summed
    "item7-tie": ("tests/sim/test_testbed_table.py", "test_item7_table_judges_each_engine_level_arm_against_request_level",
                  "backends/shadow_vllm/virtual/testbed.py",
                  'arm["switch_ttft_red"] >= request_level["switch_ttft_red"]',
                  'arm["switch_ttft_red"] > request_level["switch_ttft_red"]'),
    "item7-same-sum": ("tests/sim/test_testbed_table.py",
                       "test_item7_table_judges_each_engine_level_arm_against_request_level",
                       "backends/shadow_vllm/virtual/testbed.py",
                       'return {a: {**m, "same_ttft_sum": same_model_ttft_s(m) * (m["calls"] - m["switch_calls"])}',
                       'return {a: {**m, "same_ttft_sum": same_model_ttft_s(m) * m["calls"]}'),
    "private-evict-count": (KV_EQ, "test_private_blocks_equal_named_ones", "shadowcore/kv.py",
                            "                pieces.append((release, True, m))",
                            "                pieces.append((release, True, max(1, m - 1)))"),
    # owed evictions settled per private run at the head (issue 17, session 11): all owed blocks are evicted
    # (a named run after the private ones included), each run's first live entries, spilled in order
    "private-settle-rest": (KV_EQ, "test_private_blocks_equal_named_ones", "shadowcore/kv.py",
                            "        self._eviction_count += evicted\n        return num\n",
                            "        self._eviction_count += evicted\n        return 0\n"),
    "private-settle-spill": (KV_EQ, "test_private_blocks_equal_named_ones", "shadowcore/kv.py",
                             "self._spill(hashes[start : start + m], KVClass.NORMAL, hashes[-1])",
                             "self._spill(hashes[start + 1 : start + m + 1], KVClass.NORMAL, hashes[-1])"),
    # a private allocation and a private finish run with evictions owed: the room check counts the debt, and
    # every other finish settles first
    "owed-private-room": ("tests/test_kv_room.py", "test_private_allocations_and_finishes_leave_owed_evictions_owed",
                          "shadowcore/kv.py",
                          "if free + self._idle_s.count + self._idle_n.count - self._owed < num_new:",
                          "if free + self._idle_s.count + self._idle_n.count < num_new:"),
    "owed-finish-general": ("tests/test_kv_room.py", "test_a_finish_makes_the_owed_evictions_before_it_reloads",
                            "shadowcore/kv.py",
                            "        if self._owed:\n            self._settle()\n        blocks = self._blocks\n        if owner.private:",
                            "        blocks = self._blocks\n        if owner.private:"),
    # review (session 11): a private owner's finish that is not its chain's case (another Sequence type, not
    # extending the held prefix, repeats) falls back to the named paths; extend by hashes names it first
    "private-finish-prefix": (KV_PRIV, "test_private_finish_of_any_sequence_equals_named", "shadowcore/kv.py",
                              ("        if len(hashes) < k or hashes[:k] != head:\n            return False\n"
                               "        tail = hashes[k:]\n        distinct"),
                              ("        if len(hashes) < k:\n            return False\n"
                               "        tail = hashes[k:]\n        distinct")),
    "private-finish-distinct": (KV_PRIV, "test_private_finish_of_any_sequence_equals_named", "shadowcore/kv.py",
                                "distinct = isinstance(hashes, range) or len(set(hashes)) == len(hashes)",
                                "distinct = True"),
    "private-head-run-stale": (KV_PRIV, "test_eviction_through_a_stale_named_run_and_a_private_one_equals_named",
                               "shadowcore/kv.py",
                               ("                else:\n"
                                "                    piece = list(islice(self._live(state, hashes, pos), num - got))"),
                               "                else:\n                    piece = hashes[pos : pos + num - got]"),
    "private-list-count": (KV_PRIV, "test_private_run_through_a_compaction_equals_named", "shadowcore/kv.py",
                              "            if is_private:\n                self._left_release(release, run)",
                              "            if is_private:\n                self._left_release(release, max(1, run - 1))"),
    "private-extend-name": (KV_PRIV, "test_private_owner_extended_by_hashes_equals_named", "shadowcore/kv.py",
                            "        if hashes and owner.private:\n            self._name_held(owner)\n",
                            "        if False:\n            pass\n"),
    # the host tier's private runs (session 12): kept by count, trimmed by count, counted per chain head, kept
    # through a compaction, named on a lookup from the chain's head and on a by-hash query
    "host-private-trim": (KV_PRIV, "test_a_private_chain_in_the_host_tier_is_found_from_its_first_block",
                          "shadowcore/kv.py",
                          "                self.num_private -= end - pos\n",
                          "                self.num_private -= max(0, end - pos - 1)\n"),
    "host-private-heads": (KV_PRIV, "test_a_private_chain_in_the_host_tier_is_found_from_its_first_block",
                           "shadowcore/kv.py", "self.heads[head] = self.heads.get(head, 0) + 1",
                           "self.heads[head] = 1"),
    "host-private-lookup": (KV_PRIV, "test_a_private_chain_in_the_host_tier_is_found_from_its_first_block",
                            "shadowcore/kv.py",
                            "        if self._host_tier.heads and hashes and hashes[0] in self._host_tier.heads:",
                            "        if False:"),
    "host-private-compact": (KV_PRIV, "test_a_private_run_in_the_host_tier_survives_its_compaction",
                             "shadowcore/kv.py", "            if hashes:\n                yield token, hashes",
                             "            if hashes and len(token) == 2:\n                yield token, hashes"),
    "host-private-in-host": (KV_PRIV, "test_a_private_run_in_the_host_tier_survives_its_compaction",
                             "shadowcore/kv.py",
                             "            self._settle()\n        self._host_tier.name()\n        return block_hash in",
                             "            self._settle()\n        return block_hash in"),
    "host-private-name-order": (KV_PRIV, "test_a_private_run_in_the_host_tier_survives_its_compaction",
                                "shadowcore/kv.py", "        for token, hashes in self._live_runs():\n            if len(token) == 3:",
                                "        for token, hashes in reversed(list(self._live_runs())):\n            if len(token) == 3:"),
    # a remembered prefix lookup (cached_prefix_blocks) holds only while no named block enters or leaves: every
    # removal event from the block map counts (the host tier's trims and reloads count too, but never alone: a
    # named spill comes with a named eviction, a private one shrinks the tier's dict, a reload grows the map)
    "prefix-memo-evict": (KV_PRIV, "test_a_remembered_lookup_sees_a_named_eviction_among_private_runs",
                          "shadowcore/kv.py",
                          ("            self._evicted_from_idle(list(map(_RELEASE, map(blocks.pop, victims))))\n"
                           "            self._named_removals += 1\n"),
                          "            self._evicted_from_idle(list(map(_RELEASE, map(blocks.pop, victims))))\n"),
    "prefix-memo-head-run": (KV_PRIV, "test_a_remembered_lookup_sees_a_named_eviction_among_private_runs",
                             "shadowcore/kv.py",
                             ("                deque(map(blocks.__delitem__, piece), 0)\n"
                              "                self._named_removals += 1\n"),
                             "                deque(map(blocks.__delitem__, piece), 0)\n"),
    "prefix-memo-with-private": (KV_PRIV, "test_a_remembered_lookup_sees_a_named_eviction_among_private_runs",
                                 "shadowcore/kv.py",
                                 ("                deque(map(blocks.__delitem__, run), 0)\n"
                                  "                self._named_removals += 1\n"),
                                 "                deque(map(blocks.__delitem__, run), 0)\n"),
    "prefix-memo-stamp": (KV_EQ, "test_remembered_prefix_lookups_equal_fresh_ones", "shadowcore/kv.py",
                          "if hit is not None and hit[0] is key and hit[1] == stamp:",
                          "if hit is not None and hit[0] is key:"),
    # reads that leave owed evictions owed (session 13): only while every victim is a private head run, the host
    # tier's trims of their spill take private entries only, the room less their cold blocks, one scan per debt
    "owed-scan-named": (KV_OWED, "test_a_remembered_lookup_sees_owed_victims_past_the_private_runs", "shadowcore/kv.py",
                        "            if release not in private:\n                scan.blocked = True\n                break\n",
                        ""),
    "owed-scan-host": (KV_OWED, "test_a_remembered_lookup_sees_the_host_tier_trim_a_named_run", "shadowcore/kv.py",
                       "        return excess <= scan.host_cover\n", "        return True\n"),
    "owed-room-cold": (KV_OWED, "test_the_shadow_room_under_private_debt_leaves_out_the_cold_victims", "shadowcore/kv.py",
                       "            cold -= scan.cold_victims(self._owed, self._live)\n", "            cold -= 0\n"),
    "owed-scan-reset": (KV_OWED, "test_a_remembered_lookup_after_a_settle_scans_the_debt_again", "shadowcore/kv.py",
                        "            self._owed = 0\n            self._owed_scan = None\n", "            self._owed = 0\n"),
    # _unref of a run held once each with both classes: each class's blocks, in order, as its own idle run
    "unref-mixed-class": (KV_OWED, "test_a_release_of_both_classes_equals_the_block_loop", "shadowcore/kv.py",
                          "                        blocks.update(zip(run, repeat(idle_state[shadow])))\n",
                          "                        blocks.update(zip(run, repeat(idle_state[False])))\n"),
    "unref-mixed-flag": (KV_OWED, "test_a_release_of_both_classes_equals_the_block_loop", "shadowcore/kv.py",
                         "                    self._mixed.add(release)\n                    for shadow, run in",
                         "                    for shadow, run in"),
    # allocate(private=True) of a chain whose first block is known (a session named as a normal request) is named
    "private-known-head": (KV_PRIV, "test_a_private_allocation_of_a_cached_chain_equals_named", "shadowcore/kv.py",
                           "        if private and not (hashes and self.may_hold_prefix(hashes[0])):",
                           "        if private:"),
    # the normal idle order answers by key for a private run's live entries (its last idle-left ones) only
    # placement's shortcuts (EngineCluster): a prefix lookup that may skip an instance only when its KV holds the
    # first block nowhere (device, host tier, private chain head), and one instant's estimates memoised by work
    "may-hold-host": ("tests/test_kv_may_hold.py",
                      "test_may_hold_prefix_false_means_no_cached_prefix_even_before_the_owed_evictions",
                      "shadowcore/kv.py", "        return (first_hash in self._blocks or first_hash in self._host or",
                      "        return (first_hash in self._blocks or"),
    "may-hold-private": ("tests/test_kv_may_hold.py",
                         "test_may_hold_prefix_false_means_no_cached_prefix_even_before_the_owed_evictions",
                         "shadowcore/kv.py", "first_hash in self._host or first_hash in self._private_heads",
                         "first_hash in self._host"),
    "may-hold-host-private": (KV_PRIV, "test_may_hold_prefix_sees_a_private_chain_in_the_host_tier",
                              "shadowcore/kv.py", "\n                or first_hash in self._host_tier.heads)", ")"),
    "placement-skip-host": ("tests/sim/test_placement_scan.py",
                            "test_placement_reads_equal_the_full_reads_and_the_run_does_not_move",
                            "shadowcore/engine/cluster.py", "if not first or not inst.kv.may_hold_prefix(first[0]):",
                            "if not first or first[0] not in inst.kv._blocks:"),
    "placement-memo-key": ("tests/sim/test_placement_scan.py",
                           "test_one_instants_estimates_equal_fresh_ones_for_every_queue_and_window",
                           "shadowcore/engine/cluster.py", "key = (id(inst.latency), inst.limits.token_budget, work)",
                           "key = (inst.limits.token_budget, work)"),
    "floor-monotone": ("tests/sim/test_placement_scan.py",
                       "test_the_floor_is_below_every_estimate_and_absent_for_a_latency_that_dips",
                       "shadowcore/engine/cluster.py", "        if not self._monotone(inst):\n            return -math.inf\n",
                       ""),
    "floor-queued": ("tests/sim/test_placement_scan.py",
                     "test_placement_reads_equal_the_full_reads_and_the_run_does_not_move",
                     "shadowcore/engine/cluster.py",
                     "t = self.loop.now_s + self._prefill_s(inst, num_uncached_tokens)\n",
                     "t = self.loop.now_s + self._prefill_s(inst, inst.queued_prefill_tokens + num_uncached_tokens + 1)\n"),
    "floor-skip-first": ("tests/sim/test_placement_scan.py",
                         "test_placement_reads_equal_the_full_reads_and_the_run_does_not_move",
                         "shadowcore/manager.py", "if floor is not None and best is not None and floor(inst, uncached) >= best_s:",
                         "if floor is not None and floor(inst, uncached) >= best_s - 1.0:"),
    "least-loaded-reads-ties": ("tests/test_manager_placement.py",
                                "test_the_least_loaded_scan_stops_reading_at_an_instance_with_nothing_queued",
                                "shadowcore/manager.py",
                                "if floor is not None and best is not None and floor(inst, uncached) >= best_s:",
                                "if floor is not None and best is not None and floor(inst, uncached) > best_s:"),
    "private-mapping": (KV_PRIV, "test_idle_order_with_private_runs_is_a_mapping", "shadowcore/kv.py",
                        "            if block_hash in hashes[len(hashes) - releases[state[3]] :]:",
                        "            if block_hash in hashes:"),
    "contract-last": ("tests/test_backend_contract.py", "test_broken_backend_fails", "shadowcore/testing/backend_check.py",
                      "            elif seen_shadow:\n", "            elif False:\n"),
    "contract-grant": ("tests/test_backend_contract.py", "test_broken_backend_fails", "shadowcore/testing/backend_check.py",
                       "            elif n > granted[job]:\n", "            elif False:\n"),
    "contract-repeat": ("tests/test_backend_contract.py", "test_broken_backend_fails", "shadowcore/testing/backend_check.py",
                        "        if x != y:\n", "        if False:\n"),
    "batch-order": ("tests/test_backend_contract.py", "test_fake_backend_keeps_the_contract",
                    "shadowcore/engine/instance.py",
                    "return BatchReport(self.instance_id, self.iteration, tuple(entries),",
                    'return BatchReport(self.instance_id, self.iteration, tuple(sorted(entries, key=lambda e: e.kind != "shadow")),'),
    # the engine's aggregates (issue 17): the cohort's minimum slack is exact, not the smallest heap key's; a
    # request that starts decoding reserves its next block; an empty plan counts the reason begin_step would
    "deadline-eps": ("tests/sim/test_speed_equivalence_latency.py", "test_deadline_heap_gives_the_exact_minimum_slack",
                     "shadowcore/engine/_deadlines.py", "EPS_S = 1e-6", "EPS_S = 0.0"),
    "join-due": ("tests/sim/test_speed_equivalence.py", "test_kv_reservations_identical_every_iteration",
                 "shadowcore/engine/instance.py", "        due = c + 2 > req.num_blocks * bs\n",
                 "        due = False\n"),
    # a cohort member at its block boundary needs exactly one block and one per block_size clocks after (its
    # phase); the phase's blocks are pooled and handed to each member when it finishes or is brought up to date
    "due-period": ("tests/sim/test_speed_equivalence_macro.py", "test_steady_runs_change_nothing",
                   "shadowcore/engine/instance.py", "            req.pool_from = clock + bs\n        if num:",
                   "            req.pool_from = clock + bs + 1\n        if num:"),
    "due-period-agg": ("tests/sim/test_speed_equivalence.py", "test_kv_reservations_identical_every_iteration",
                       "shadowcore/engine/instance.py",
                       "                req.pool_from = clock + bs\n            self._phase_live",
                       "                req.pool_from = clock + bs + 1\n            self._phase_live"),
    "pool-count": ("tests/sim/test_speed_equivalence.py", "test_kv_reservations_identical_every_iteration",
                   "shadowcore/engine/instance.py", "            k = (upto - start) // bs + 1\n",
                   "            k = (upto - start) // bs\n"),
    "pool-finish": ("tests/sim/test_speed_equivalence.py", "test_kv_reservations_identical_every_iteration",
                    "shadowcore/engine/instance.py",
                    "        if req.pool_from >= 0:  # its pooled blocks, then it leaves its phase\n            self._attribute(req)\n",
                    "        if req.pool_from >= 0:  # its pooled blocks, then it leaves its phase\n            pass\n"),
    # the longest-context heap rebuilt from the live members only (their maximum unchanged)
    "longest-rebuild": ("tests/sim/test_speed_equivalence.py", "test_longest_context_is_the_live_members_max",
                        "shadowcore/engine/instance.py",
                        "self._longest = [e for e in longest if e[2].finish_s is None]",
                        "self._longest = [e for e in longest if e[2].finish_s is None and e[1] % 2]"),
    # a decode-only iteration's memoised time is keyed by everything it depends on (table cell and batch size)
    "decode-memo": ("tests/sim/test_speed_equivalence_latency.py", "test_vidur_aggregate_is_bit_identical_and_raises_alike",
                    "backends/shadow_sim/vidur_latency.py", 'key = cell * stride + nd', "key = nd"),
    # a run of steady decodes is timed one lookup per table cell: a cell's last step (dense and geometric columns)
    # and the context limit are where the value may change
    "decode-run-dense": ("tests/sim/test_speed_equivalence_latency.py", "test_vidur_decode_run_equals_its_steps_one_by_one",
                         "backends/shadow_sim/vidur_latency.py",
                         "last = min(num, ((((total + 255) >> 8) << 8) - total_context) // nd)",
                         "last = min(num, ((((total + 255) >> 8) << 8) - total_context) // nd + 1)"),
    "decode-run-geo": ("tests/sim/test_speed_equivalence_latency.py", "test_vidur_decode_run_equals_its_steps_one_by_one",
                       "backends/shadow_sim/vidur_latency.py",
                       "last = min(num, (geo[i] - total_context) // nd) if i < len(geo) else num",
                       "last = min(num, (geo[i] + 256 - total_context) // nd) if i < len(geo) else num"),
    "decode-run-limit": ("tests/sim/test_speed_equivalence_latency.py", "test_vidur_decode_run_equals_its_steps_one_by_one",
                         "backends/shadow_sim/vidur_latency.py",
                         "num = min(num_steps, kv_limit - max_context)", "num = num_steps"),
    # an inert hook (none's behaviour) is one whose controller never grants, with no observer: an observer
    # added after the run is built sees every iteration planned; a controller that may grant is never inert
    "inert-observers": ("tests/test_diagnostics.py", "test_a_never_granting_hook_plans_every_iteration",
                        "shadowcore/engine/_fastpath.py",
                        "    return not (hook.observers.observers or hook._pending is not None) and type(hook.slack) in _INERT",
                        "    return not (hook._pending is not None) and type(hook.slack) in _INERT"),
    "inert-grants": ("tests/sim/test_speed_equivalence.py", "test_results_identical_to_golden",
                     "shadowcore/engine/_fastpath.py",
                     "if kind.never_grants and kind.observe_skipped is None)",
                     "if kind.observe_skipped is None)"),
    # begin_step counts no step of a controller that never grants (as the fast paths do not)
    "count-never-grants": ("tests/test_diagnostics.py", "test_a_never_granting_hook_plans_every_iteration",
                           "shadowcore/hook.py", "        if not self.slack.never_grants:  # a controller",
                           "        if True or self.slack.never_grants:  # a controller"),
    # a large response is decoded off the event loop (judged by the loop thread's CPU between its turns)
    "offload-decode": ("tests/gateway/test_offload.py", "test_a_huge_call_does_not_stall_the_event_loop",
                       "backends/shadow_gateway/offload.py",
                       "return await self._run(decode, raw) if len(raw) >= self.min_bytes else decode(raw)",
                       "return decode(raw)"),
    # the records' reorder takes permutations only (a repeated index would duplicate a record and drop another)
    "records-permutation": ("tests/test_engine.py", "test_records_reorder_keeps_exact_values_and_refuses",
                            "shadowcore/engine/run.py",
                            "        ok = bool(seen.all())  #", "        ok = True or bool(seen.all())  #"),
    # a span of steady decodes with one time: to the end of the table cell (dense and geometric) and the context
    # limit; run_steady asks again exactly where a span ends
    "decode-span-dense": ("tests/sim/test_speed_equivalence_latency.py", "test_vidur_decode_span_gives_each_step_its_value",
                          "backends/shadow_sim/vidur_latency.py",
                          "            top = j << 8  #", "            top = (j + 1) << 8  #"),
    "decode-span-geo": ("tests/sim/test_speed_equivalence_latency.py", "test_vidur_decode_span_gives_each_step_its_value",
                        "backends/shadow_sim/vidur_latency.py",
                        "j, top = 257 + i, geo[i] if i < len(geo) else None", "j, top = 257 + i, geo[i] + 1024 if i < len(geo) else None"),
    "decode-span-limit": ("tests/sim/test_speed_equivalence_latency.py", "test_vidur_decode_span_gives_each_step_its_value",
                          "backends/shadow_sim/vidur_latency.py",
                          "        m = kv_limit - max_context + 1  #", "        m = kv_limit - max_context + 2  #"),
    "decode-span-memo": ("tests/sim/test_speed_equivalence_latency.py", "test_vidur_decode_span_gives_each_step_its_value",
                         "backends/shadow_sim/vidur_latency.py", "memo.get(((nd - 1) * cols + j) * stride", "memo.get(((nd - 1) * cols + j + 1) * stride"),
    "decode-span-steady": ("tests/sim/test_speed_equivalence_macro.py", "test_eager_runs_count_every_event and vidur",
                           "shadowcore/engine/instance.py", "                    span_end = c + m\n",
                           "                    span_end = c + m + 8\n"),
    # the hook asks its job source again only after a refresh that moved a job's epoch or held prefix: a job a
    # refresh completes or lowers must be seen (never asking again leaves a complete job first in the order)
    "refresh-requery": ("tests/test_core_units.py", "test_a_refresh_that_completes",
                        "shadowcore/hook.py",
                        "refreshed = refreshed or (job.epoch, job.num_held_tokens) != before",
                        "refreshed = False and before"),
    "agg-no-jobs": ("tests/sim/test_speed_equivalence.py", "lazy_cohort_runs_and_changes_nothing and fake-harvest-slo",
                    "shadowcore/engine/_fastpath.py", '        return "no_jobs"\n', '        return "no_room"\n'),
    # a steady iteration whose pending jobs need a refresh: proven empty in place (the reason counted as
    # _start_agg would), or planned as _start_agg would when it might grant
    "steady-refresh-count": ("tests/sim/test_speed_equivalence.py",
                             "lazy_cohort_runs_and_changes_nothing and fake-harvest-slo",
                             "shadowcore/engine/instance.py",
                             "            _fastpath.count_empty_plan(hook, why)  # and on: a steady iteration",
                             "            pass  # and on: a steady iteration"),
    "steady-refresh-plan": ("tests/sim/test_speed_equivalence.py",
                            "lazy_cohort_runs_and_changes_nothing and fake-harvest-slo",
                            "shadowcore/engine/instance.py",
                            "            if why is None:\n                self._steady = False\n",
                            "            if why is None:\n                why = 'granted'\n            if False:\n"),
    # the step counts (issue 17, session 19): every iteration of a granting hook counted once with the reason
    # begin_step gives it, whichever path ran it: jobs that take no grant first, skipped iterations included
    "count-skipped-steady": ("tests/sim/test_speed_equivalence.py", "test_step_counts_partition_the_iterations",
                             "shadowcore/engine/instance.py",
                             "            _fastpath.count_skipped(hook)  # counted as begin_step would (no_jobs)\n",
                             "            pass\n"),
    "count-skipped-run": ("tests/sim/test_speed_equivalence.py", "test_step_counts_partition_the_iterations",
                          "shadowcore/engine/instance.py", "                    _fastpath.count_skipped(self.hook, num)\n",
                          "                    pass\n"),
    "count-skipped-never": ("tests/sim/test_speed_equivalence.py", "test_results_identical_to_golden and no-shadow",
                            "shadowcore/engine/_fastpath.py",
                            "    if num and not _SKIPPABLE[type(hook.slack)].never_grants:", "    if num:"),
    "jobs-first-plan": ("tests/test_diagnostics.py", "test_step_counts_cover_every_iteration_whichever_path_ran_it",
                        "shadowcore/hook.py", "        if self._takes_no_grant(jobs):\n            why = \"no_jobs\"\n        elif",
                        "        if False:\n            why = \"no_jobs\"\n        elif"),
    "jobs-first-fast": ("tests/sim/test_speed_equivalence.py", "test_results_identical_to_golden and harvest",
                        "shadowcore/engine/_fastpath.py",
                        "    if hook._takes_no_grant(jobs):\n        return \"no_jobs\"\n",
                        "    if not jobs:\n        return \"no_jobs\"\n"),
    "no-grant-rule": ("tests/sim/test_speed_equivalence.py", "test_results_identical_to_golden and sim-harvest",
                      "shadowcore/hook.py", "return sum(j.num_missing_tokens for j in jobs) // block < max(1, -(-self.slack.n_min // block))",
                      "return sum(j.num_missing_tokens for j in jobs) // block < 1"),
    # deferred instances with a hook that may grant (session 19): deferred only while no job is pending there,
    # and told of a job before pending_jobs shows it (the ends before it are applied with the jobs as they were)
    "defer-pending": (DEFER, "test_deferred_runs_change_nothing and harvest", "shadowcore/engine/cluster.py",
                      "or (self.jobs_watched and _fastpath.quiet_until_event(hook)))",
                      "or (self.jobs_watched and _fastpath.skippable(hook.slack) is not None))"),
    "activate-order": (DEFER, "test_deferred_runs_change_nothing and harvest", "shadowcore/manager.py",
                       "            self.on_job_active(job.instance_id)\n        self._active.setdefault(job.instance_id, {})[job.sequence] = job",
                       ("            pass\n        self._active.setdefault(job.instance_id, {})[job.sequence] = job\n"
                        "        if self.on_job_active is not None:\n            self.on_job_active(job.instance_id)")),
    # lazy ticks (issue 17): every touch of a lazily running instance first applies its pending ends, and a
    # change (a request enqueued, a job that may become pending there) cuts the run
    "lazy-enqueue": ("tests/sim/test_speed_equivalence_macro.py", "test_steady_runs_change_nothing",
                     "shadowcore/engine/instance.py", "            self.touched(True)\n        self.waiting.append(req)",
                     "            self.touched(False)\n        self.waiting.append(req)"),
    "lazy-jobs": ("tests/sim/test_speed_equivalence_macro.py", "test_steady_runs_change_nothing",
                  "shadowcore/engine/cluster.py",
                  "        if inst is not None and inst.touched is not None:\n            inst.touched(True)\n",
                  "        if inst is not None and inst.touched is not None:\n            pass\n"),
    # a run's look-ahead durations are reused only by the run they were computed for (same decodes, aggregates)
    "ahead-stale": ("tests/sim/test_speed_equivalence.py", "test_a_run_uses_only_its_own_look_ahead",
                    "shadowcore/engine/instance.py",
                    "if k >= 0 and total == ahead[2] + k * nd and longest == ahead[3] + k:", "if k >= 0:"),
    # a run of steady ticks sums its phase members' boundary blocks, and stops where they do not fit
    "run-pooled": ("tests/sim/test_speed_equivalence_macro.py", "test_steady_runs_change_nothing",
                   "shadowcore/engine/instance.py",
                   "            if pooled:\n                needs.append((self._pool_id, pooled))\n",
                   "            pass\n"),
    "run-pooled-room": ("tests/sim/test_speed_equivalence_macro.py", "test_steady_runs_change_nothing",
                        "shadowcore/engine/instance.py", "                    elif p <= room:", "                    elif True:"),
    # a run of steady ticks asks the credit once whether such a tick earns (the rule stays _earn_decode_credit's)
    "tick-credit": ("tests/sim/test_speed_equivalence_macro.py", "test_steady_runs_change_nothing",
                    "shadowcore/engine/_fastpath.py",
                    "        return credit.earn_s if credit.accrues(decode_only, routed) else None\n",
                    "        return None\n"),
    "lazy-prefix": ("tests/sim/test_speed_equivalence_macro.py", "test_observations_equal_the_eager_loops",
                    "shadowcore/engine/instance.py",
                    "        if self.touched is not None:\n            self.touched(False)\n        block = self.kv.block_size",
                    "        block = self.kv.block_size"),
    "lazy-evictions": ("tests/sim/test_speed_equivalence_macro.py", "test_observations_equal_the_eager_loops",
                       "shadowcore/engine/instance.py",
                       "        if self.touched is not None:\n            self.touched(False)\n        return self.kv.eviction_count",
                       "        return self.kv.eviction_count"),
    "lazy-tie": ("tests/sim/test_speed_equivalence_macro.py", "test_observations_equal_the_eager_loops",
                 "shadowcore/engine/cluster.py", "self._catch_up(inst, run, math.nextafter(now, math.inf))",
                 "self._catch_up(inst, run, now)"),
    # the gateway: a client never reaches another client's session; bad input never reaches an engine
    "tenant-namespace": (AUTH, "test_a_second_key_cannot_see_steer_poison_or_delete",
                         "backends/shadow_gateway/gateway.py",
                         'return session_id if tenant is None else f"{tenant}:{session_id}"', "return session_id"),
    "any-key": (AUTH, "test_keys_are_required_and_401", "backends/shadow_gateway/app.py",
                "        tenant = self.tenant(auth)\n        if tenant is None:",
                "        tenant = self.tenant(auth) or 'anyone'\n        if tenant is None:"),
    "accept-rejected": (AUTH, "test_session_state_changes_only_after_the_upstream_accepted",
                        "backends/shadow_gateway/gateway.py",
                        "if ctx is not None and resp.status == 200:", "if ctx is not None:"),
    "shadow-no-key": (AUTH, "test_upstream_credentials_on_routed_calls_shadows", "backends/shadow_gateway/shadow.py",
                      "headers={**JSON_HEADERS, **inst.config.auth_headers}) as r:", "headers=JSON_HEADERS) as r:"),
    "shared-cache": (AUTH, "test_tenants_do_not_share_prefix_caches", "backends/shadow_gateway/app.py",
                     "        body.update(gw.cache_fields(tenant))\n", ""),
    "unsalted-shadow": (AUTH, "test_tenants_do_not_share_prefix_caches", "backends/shadow_gateway/shadow.py",
                        '"vllm_xargs": tag.to_extra_args(), **self.session_fields(job.key.session_id)}',
                        '"vllm_xargs": tag.to_extra_args()}',
                        "        body.update(self.session_fields(shadow.session_id))\n", ""),
    "forged-tags": (MALFORMED, "test_malformed_request_is_a_4xx_naming_the_field",
                    "backends/shadow_gateway/validation.py",
                    "if key in RESERVED_FIELDS or key.startswith(RESERVED_PREFIX):", "if False:",
                    "if isinstance(key, str) and key.startswith(RESERVED_PREFIX):", "if False:"),
    # P/D pushes: normal transfers first, one push at a time per D; a call's D gets P's kv_transfer_params
    "push-over-transfer": ("tests/gateway/test_pd.py",
                           "test_pusher_waits_for_normal_transfers_and_sends_one_push_per_d_at_a_time",
                           "backends/shadow_gateway/pd.py",
                           "if dest.num_transfers_inflight or not dest.available", "if not dest.available"),
    # an ended session keeps no entry, whatever was in flight when it ended
    "ended-push-offer": ("tests/gateway/test_pd.py",
                         "test_a_shadow_or_push_finishing_after_its_session_ended_records_nothing",
                         "backends/shadow_gateway/pd.py",
                         "\n                or not self.is_live(push.session_id)):", "):"),
    "ended-push-known": ("tests/gateway/test_pd.py",
                         "test_a_shadow_or_push_finishing_after_its_session_ended_records_nothing",
                         "backends/shadow_gateway/pd.py",
                         "if self.is_live(push.session_id):  # an ended session keeps no entry", "if True:"),
    "ended-shadow-known": ("tests/gateway/test_pd.py",
                           "test_a_shadow_or_push_finishing_after_its_session_ended_records_nothing",
                           "backends/shadow_gateway/shadow.py",
                           "            if self.is_live(session_id):\n                self.cluster.record_shadow",
                           "            if True:\n                self.cluster.record_shadow"),
    "push-two-at-once": ("tests/gateway/test_pd.py",
                         "test_pusher_waits_for_normal_transfers_and_sends_one_push_per_d_at_a_time",
                         "backends/shadow_gateway/pd.py",
                         "if not queue or dest_id in self.inflight:", "if not queue:"),
    "push-held-all": ("tests/gateway/test_pd.py", "test_a_push_d_held_only_in_part_records_what_d_says_it_holds",
                      "backends/shadow_gateway/pd.py", "held = min(stop.num_held_tokens or 0, push.num_tokens)",
                      "held = push.num_tokens"),
    "pd-no-handle": ("tests/gateway/test_pd.py",
                     "test_pd_call_goes_p_then_sticky_d_and_shadows_push_toward_the_other_models_d",
                     "backends/shadow_gateway/gateway.py", "extra=decode_fields(data))", "extra={})"),
    "nan-json": (MALFORMED, "test_malformed_request_is_a_4xx_naming_the_field", "backends/shadow_gateway/validation.py",
                 "json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)", "json.loads(raw)"),
    # shadow tokens used: a host-tier hit on a shadow block counts (one definition, issue 14 item 7)
    "used-host": ("tests/sim/test_session_replay.py", "test_a_host_tier_hit_on_a_shadow_block_counts_as_used",
                  "shadowcore/kv.py", "            self.num_shadow_blocks_used += host_used\n", ""),
    # release_and_cache counts host-tier shadow hits as allocate does (issue 17, session 13: the short way, the chain)
    "used-host-finish": (KV_EQ, "test_composites_equal_the_calls_they_replace", "shadowcore/kv.py",
                         "            used += self._host_shadow(hashes[match.num_device_blocks : match.num_blocks])",
                         "            pass"),
    "used-host-chain": (KV_EQ, "test_composites_equal_the_calls_they_replace", "shadowcore/kv.py",
                        "            self.num_shadow_blocks_used += self._host_shadow(tail[:num_host])", "            pass"),
    # session traces: a prompt that disagrees with context + input is an error
    "trace-prompt": ("tests/test_session_trace.py", "test_cross_line_rules", "shadow_traces/session_trace.py",
                     "    if given is not None and given != prompt:", "    if False:"),
    "refs-split": ("tests/test_policy_refs.py", "test_comma_lists_split_only_outside_the_json", "shadowcore/config.py",
                   'if text[j] == ":" and (args_at := _args_start(text, j)) is not None:', "if False:"),
    "factory-bug": ("tests/test_plugins.py", "test_a_bug_inside_a_factory_is_one_error_naming_the_plugin",
                    "shadowcore/registry.py", "    except Exception as e:\n", "    except ArithmeticError as e:\n"),
    "orphan-workers": ("tests/sim/test_signals.py", "test_stopping_sweep_stops_every_worker",
                       "backends/shadow_sim/experiments/runner.py",
                       "        pool.terminate()  # runs in flight are abandoned\n",
                       "        pool.close()  # runs in flight are abandoned\n"),
    "ci-skips": ("tests/test_shared_traces.py", "test_absent_traces_fail_under_ci", "tests/conftest.py",
                 'if os.environ.get("CI") == "true":', "if False:"),
    # prefix sharing in normal traffic: an engine block is named by the chain of trace hashes up to the trace
    # block it ends in (not the trace block it starts in), and past the hashed tokens a request's blocks are its own
    "prefix-chain": ("tests/test_prefix_sharing.py", "test_prefix_blocks_are_shared_exactly_where_the_hash_lists_agree",
                     "shadowcore/workloads/prefix.py", "m = ((i + 1) * block_size - 1) // T", "m = (i * block_size) // T"),
    "prefix-reuse": ("tests/test_prefix_sharing.py", "test_simulator_normal_hit_rate_matches_the_trace_reuse_exactly",
                     "shadowcore/engine/run.py", "history = PrefixHistory.for_prompt(request_id, num_prompt_tokens, prefix)",
                     "history = SessionHistory(request_id)\n            history.append(num_prompt_tokens)"),
    # a compaction's new epoch must start from the summary's ids (vLLM virtual time prefills it)
    "summary-ids": ("tests/test_compaction.py", "test_compaction_with_token_ids_starts_a_token_history",
                    "shadowcore/manager.py", "s.history.compact(call.compact_to_tokens, call.summary_token_ids)",
                    "s.history.compact(call.compact_to_tokens, call.new_token_ids[:call.compact_to_tokens])"),
    # the placement estimate never prices a queue beyond the window as one prompt
    "window-estimate": ("tests/test_core_units.py",
                        "test_windowed_prefill_prices_a_long_queue_as_window_sized_prompts",
                        "shadowcore/latency.py", "if window_tokens <= 0 or num_tokens <= window_tokens:",
                        "if True:"),
    # P/D on vLLM (shadow_vllm.pd): P runs the policy's prefill controller; D pushes only on an idle link,
    # within the policy's free room; a Nixl handle serves one read
    "pd-prefill-slack": ("tests/vllm/test_pd_agreement.py", "test_p_shadow_and_d_push_decisions_agree",
                         "backends/shadow_vllm/pd.py", "        if recipe is None:\n", "        if True:\n"),
    "pd-link-busy": ("tests/vllm/test_pd.py", "test_no_push_starts_while_a_normal_transfer",
                     "backends/shadow_vllm/pd.py",
                     '        """A normal transfer is in flight or waits for D\'s inbound link."""\n',
                     '        """A normal transfer is in flight or waits for D\'s inbound link."""\n        return False\n'),
    "pd-room": ("tests/vllm/test_pd_agreement.py", "test_p_shadow_and_d_push_decisions_agree",
                "backends/shadow_vllm/pd.py",
                "room = self.shadow_bridge.shadow_room_blocks(now_s) * self.block_size",
                "room = (self.shadow_bridge.shadow_room_blocks(now_s) - 1) * self.block_size"),
    "pd-one-read": ("tests/vllm/test_pd.py", "test_decode_pulls_an_offer_in_pushes", "backends/shadow_vllm/pd.py",
                    "            elif self.shadow_one_read:", "            elif False:"),
    # deferred instances (EngineCluster.feed): their own arrivals, applied when the router side observes them
    "defer-estimate-sync": (DEFER, "test_reads_of_deferred_instances_are_exact", "shadowcore/engine/cluster.py",
                            "        inst = self._up_to_now(instance_id)\n        return self.loop.now_s + self._prefill_s(",
                            "        inst = self.by_id[instance_id]\n        return self.loop.now_s + self._prefill_s("),
    "defer-cached-order": (DEFER, "test_cached_prefix_reads_of_deferred_instances_are_exact", "shadowcore/engine/cluster.py",
                           "            return 0\n        return inst.cached_prefix_tokens(history)",
                           ("            return 0\n        return inst.kv.cached_prefix_blocks(history, "
                            "(history.epoch, history.num_tokens // inst.kv.block_size), history.block_hashes) "
                            "* inst.kv.block_size")),
    "defer-settle": (DEFER, "test_deferred_runs_change_nothing", "shadowcore/engine/cluster.py",
                     "                local.settles.append(self.loop.now_s)\n", "                pass\n"),
    "defer-horizon": (DEFER, "test_deferred_runs_change_nothing", "shadowcore/engine/cluster.py",
                      "self._local_end(inst, local, min(s, a, w, math.nextafter(t, math.inf)))",
                      "self._local_end(inst, local, min(s, w, math.nextafter(t, math.inf)))"),
    "defer-undefer-end": (DEFER, "test_deferred_runs_change_nothing", "shadowcore/engine/cluster.py",
                          "        if local.end_s != math.inf:\n            loop.at(",
                          "        if False:\n            loop.at("),
    "defer-records-order": (DEFER, "test_finishing_order_is_restored", "shadowcore/engine/run.py",
                            "        self._records_in_finishing_order()\n", ""),
    "defer-normal-done": ("tests/sim/test_speed_equivalence_macro.py", "test_steady_runs_change_nothing",
                          "shadowcore/engine/run.py", "                or cls._normal_done is not ScenarioRun._normal_done ",
                          "                "),
    # session 15/16 (branch linear3): a harness's own requests keep an instance eager (the CI failure of linear2)
    "linear3-owns-all": (DEFER, "test_requests_of_a_harness_keep_an_instance_eager", "shadowcore/engine/cluster.py",
                         " and self._feeds[inst].owns_all(inst))", ")"),
    "linear3-num-waiting": (DEFER, "test_waiting_counts_of_deferred_instances_are_exact",
                            "shadowcore/engine/cluster.py",
                            "return len(self._up_to_now(instance_id).waiting)",
                            "return len(self.by_id[instance_id].waiting)"),
    "feed-ids": (DEFER, "test_deferred_runs_change_nothing",
                 "shadowcore/engine/driver.py", "for k, r in enumerate(normal, 1):", "for k, r in enumerate(normal):"),
    # per-request costs (issue 17, session 13, branch reqcost): each shortcut on a normal request's path broken
    "reqcost-extend-one": ("tests/sim/test_speed_equivalence.py", "lazy_cohort_runs_and_changes_nothing",
                           "shadowcore/kv.py", "            grown = ((owners[owner_id], total),)",
                           "            grown = ((owners[owner_id], 0),)"),
    "reqcost-private-owe": ("tests/sim/test_speed_equivalence.py", "results_identical_to_golden",
                            "shadowcore/kv.py", "            self._owed += num_new - free\n        else:",
                            "            pass\n        else:"),
    "reqcost-hash-base": ("tests/sim/test_speed_equivalence.py", "results_identical_to_golden", "shadowcore/job.py",
                          "base = self._base if self._base_epoch == self.epoch else self._count_base()",
                          "base = self._base"),
    "reqcost-hash-count": ("tests/sim/test_speed_equivalence.py", "results_identical_to_golden", "shadowcore/job.py",
                           "if num_blocks is not None and num_blocks < n:",
                           "if num_blocks is not None and num_blocks > n:"),
    "reqcost-longest": ("tests/test_engine.py", "decode_aggregates_are_the_decoding_requests",
                        "shadowcore/engine/instance.py", "        longest = clock - top[0][0] if top else 0\n",
                        "        longest = clock - top[-1][0] if top else 0\n"),
    "reqcost-lag": ("tests/sim/test_speed_equivalence.py", "lazy_cohort_runs_and_changes_nothing",
                    "shadowcore/engine/instance.py", "            req.history.num_tokens += lag\n        req.lazy_base = -1",
                    "        req.lazy_base = -1"),
    "reqcost-left-one": ("tests/sim/test_speed_equivalence.py", "results_identical_to_golden",
                         "shadowcore/engine/instance.py", "                self._prefilling.remove(left[0])",
                         "                self._prefilling.remove(self._prefilling[-1])"),
    "reqcost-records": ("tests/test_engine.py", "records", "shadowcore/engine/run.py",
                        "        for append, value in zip(appends, record):",
                        "        for append, value in zip(appends[::-1], record):"),
}


def _apply(root: Path, path: str, edits: tuple) -> None:
    f = root / path
    f.write_text(_mutated(f.read_text(), path, edits))


def _mutated(text: str, path: str, edits: tuple) -> str:
    pairs = [(edits[i], edits[i + 1]) for i in range(0, len(edits) - 1, 2)]
    count = edits[-1] if len(edits) % 2 else 1
    for old, new in pairs:
        n = text.count(old)
        if n != count:
            raise SystemExit(f"{path}: expected {count} match(es) of {old!r}, found {n}: update tools/mutants.py")
        text = text.replace(old, new)
    return text


def stale(root: Path = ROOT) -> list[str]:
    """Mutants that no longer apply to the tree at ``root``, one line each (name and why): a test file or a
    source file that is gone, or an anchor whose count is not the expected one. Reads files only."""
    out = []
    for name, (test_file, _test, path, *edits) in MUTATIONS.items():
        if not (root / test_file).is_file():
            out.append(f"{name}: its test file {test_file} is gone")
            continue
        if not (root / path).is_file():
            out.append(f"{name}: its source file {path} is gone")
            continue
        try:
            _mutated((root / path).read_text(), path, tuple(edits))
        except SystemExit as e:
            out.append(f"{name}: {e}")
    return out


def run(name: str, timeout_s: int = 600, mutate: bool = True) -> tuple[bool, float]:
    """Whether the named test failed in a copy with (or, as a control, without) the mutation."""
    test_file, test, path, *edits = MUTATIONS[name]
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "repo"
        shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(
            ".git", ".hypothesis", ".pytest_cache", "__pycache__", "*.egg-info", ".ruff_cache", "site"))
        if mutate:
            _apply(copy, path, tuple(edits))
        paths = os.pathsep.join(str(copy / p) for p in (".", "backends", "policies"))
        env = dict(os.environ, PYTHONPATH=paths)
        t0 = time.time()
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider", "-o", "timeout=0", "-x",
             "-k", test],
            cwd=copy, env=env, capture_output=True, text=True, timeout=timeout_s, check=False,
        )
        return proc.returncode != 0, time.time() - t0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python tools/mutants.py", description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", metavar="NAME", help="mutants to run (default: all)")
    p.add_argument("--list", action="store_true", help="print each mutant's name and test, run nothing")
    p.add_argument("--check", action="store_true", help="only check that every mutant still applies (no test run)")
    args = p.parse_args(argv)
    if args.check:
        problems = stale()
        print("\n".join(problems) or f"all {len(MUTATIONS)} mutants apply")
        return 1 if problems else 0
    unknown = [n for n in args.names if n not in MUTATIONS]
    if unknown:
        p.error(f"unknown mutant(s): {', '.join(unknown)} (--list shows the {len(MUTATIONS)} there are)")
    if args.list:
        for name, (test_file, test, path, *_e) in MUTATIONS.items():
            print(f"{name:<22} {path:<45} {test_file}::{test}")
        return 0
    names = args.names or list(MUTATIONS)
    for name in names:  # control: every named test passes on the unmutated copy
        failed, _ = run(name, mutate=False)
        if failed:
            print(f"control failed: {MUTATIONS[name][1]} fails without any mutation")
            return 2
    survivors = []
    for name in names:
        caught, seconds = run(name)
        print(f"{name:<18} {MUTATIONS[name][1]:<70} {'caught' if caught else 'SURVIVED'} ({seconds:.0f} s)", flush=True)
        if not caught:
            survivors.append(name)
    print(f"{len(names) - len(survivors)}/{len(names)} mutants caught")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
