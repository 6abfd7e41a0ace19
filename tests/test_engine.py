"""Engine invariants of the in-memory vLLM-v1-like engine (the kit's fake
engine, which the simulator backend also runs), under hypothesis over
scenarios small enough to force preemptions and blocked admissions."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shadowcore.config import PluginRef, ShadowConfig
from shadowcore.engine.instance import EngineInstance
from shadowcore.engine.scenario import FakeRun, FakeScenario
from shadowcore.engine.workload import draw_normal, draw_sessions

POLICIES = ("no-shadow", "harvest", "harvest-slo-host", "eager")


class EngineChecker:
    """Observer that checks each iteration against its instance's state."""

    def __init__(self, run: FakeRun) -> None:
        self.run = run
        self.errors: list[str] = []
        self.num_steps = 0
        self.planned: dict[tuple[str, int], set] = {}

    def on_plan(self, snapshot, plan) -> None:
        self.planned[(snapshot.instance_id, snapshot.iteration)] = set(plan.grants)
        inst = self.run.cluster.by_id[snapshot.instance_id]
        scheduled = sum(r.num_scheduled_tokens for r in snapshot.batch)
        if scheduled + plan.num_shadow_tokens > inst.limits.token_budget:
            self.errors.append(f"token budget exceeded: {scheduled} + {plan.num_shadow_tokens}")
        if len(inst.running) > inst.limits.max_num_seqs:
            self.errors.append(f"sequence cap exceeded: {len(inst.running)}")

    def on_step_end(self, snapshot, plan, outcome) -> None:
        self.num_steps += 1
        inst: EngineInstance = self.run.cluster.by_id[snapshot.instance_id]
        granted = self.planned.pop((snapshot.instance_id, snapshot.iteration))
        if any(r.grant not in granted for r in outcome.results):
            self.errors.append("a shadow chunk ran that the plan did not grant")
        kv = inst.kv
        if kv.num_free_blocks < 0 or kv.num_free_blocks + kv.num_cached_blocks > kv.num_blocks:
            self.errors.append(f"KV over capacity: free {kv.num_free_blocks}, cached {kv.num_cached_blocks}")


class HitCheckingInstance(EngineInstance):
    """Checks at each admission that the prefix hit is at most what was cached."""

    def _admit(self, req, now_s):
        cached = self.cached_prefix_tokens(req.history)
        oracle = req.num_oracle_tokens if req.num_admissions == 0 else 0
        ok = super()._admit(req, now_s)
        if ok and req.num_computed_tokens > max(cached, oracle):
            raise AssertionError(f"hit {req.num_computed_tokens} > cached {cached}")
        return ok


class CheckedRun(FakeRun):
    def build_instance(self, instance_id, model, kv_policy):
        inst = super().build_instance(instance_id, model, kv_policy)
        return HitCheckingInstance(instance_id, model, inst.kv, inst.latency, inst.tpot_slo_s, inst.limits)


scenarios = st.fixed_dictionaries({
    "duration_s": st.floats(10.0, 30.0),
    "warmup_s": st.just(0.0),
    "session_rate_per_s": st.floats(0.1, 0.6),
    "calls_per_session": st.integers(1, 5),
    "switch_probability": st.floats(0.0, 1.0),
    "input_tokens_median": st.integers(50, 3000),
    "output_tokens_median": st.integers(1, 200),
    "normal_rate_per_s": st.floats(0.0, 6.0),
    "num_blocks": st.integers(300, 3000),
    "block_size": st.sampled_from([8, 16, 32]),
    "token_budget": st.sampled_from([256, 512, 2048]),
    "seed": st.integers(0, 10_000),
})


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios, policy=st.sampled_from(POLICIES))
def test_engine_invariants(scenario: dict, policy: str) -> None:
    sc = FakeScenario.from_dict(scenario)
    run = CheckedRun(sc, ShadowConfig(PluginRef(policy)))
    checker = EngineChecker(run)
    run.runtime.observers.add(checker)
    run.run()
    assert not run.runtime.observers.errors, run.runtime.observers.errors
    assert not checker.errors, checker.errors[:5]
    # every admitted request finished (possibly after preemption and re-admission);
    # one longer than the whole pool was rejected and counted, and ended its session
    sessions = draw_sessions(sc)
    done = {(c.session_id, c.call_index) for c in run.calls}
    rejected = set(run.rejected)
    for s in sessions:
        for i in range(len(s.models)):
            if (s.session_id, i) not in done:
                assert f"{s.session_id}#{i}" in rejected, (s.session_id, i)
                break
    num_normal = sum(len(draw_normal(sc, k)) for k in range(len(sc.models) * sc.instances_per_model))
    assert len(run.normal) == num_normal
    for inst in run.cluster.by_id.values():
        assert not inst.running and not inst.waiting


def test_preemption_happens_and_recovers() -> None:
    """A pool too small for the load forces preemption; everything still finishes."""
    sc = FakeScenario.from_dict({"duration_s": 20.0, "warmup_s": 0.0, "normal_rate_per_s": 6.0, "num_blocks": 400,
                                 "normal_output_median": 400, "session_rate_per_s": 0.3})
    run = CheckedRun(sc, ShadowConfig(PluginRef("harvest-slo")))
    run.run()
    assert sum(i.num_preemptions for i in run.cluster.by_id.values()) > 0
    assert len(run.normal) == sum(len(draw_normal(sc, k)) for k in range(4))


def test_run_records_read_back_exactly_the_tuples_appended():
    """ScenarioRun's per-request records (typed arrays) read as the list of tuples appended: values exact,
    bools as bools, order kept; they pickle; an int beyond 64 bits is refused, not wrapped."""
    import pickle

    import pytest

    from shadowcore.engine.run import Records

    rows = [(0.1 + i / 7, i % 3 == 0) for i in range(50)]
    rec = Records("d", "?")
    for r in rows:
        rec.append(r)
    assert list(rec) == rows and len(rec) == 50 and rec[7] == rows[7] and rec == rows
    assert all(type(m) is bool for _, m in rec)
    assert pickle.loads(pickle.dumps(rec)) == rows
    tokens = Records("d", "q", "q")
    tokens.append((1.5, 2**40, 0))
    assert list(tokens) == [(1.5, 2**40, 0)]
    with pytest.raises(OverflowError):
        tokens.append((1.0, 2**64, 0))
    with pytest.raises(ValueError, match="3 fields"):
        tokens.append((1.0, 2))



def test_decode_aggregates_are_the_decoding_requests_at_every_iteration_end() -> None:
    """While the lazy cohort lives, the instance's decode aggregates (total and longest context) are those of
    its decoding requests (cohort members by the clock, eager ones one by one) after every iteration end:
    steady ends, mixed ends with admissions and joins, and ends where members finish."""
    from shadowcore.engine.instance import EngineLimits, EngineRequest, append_output_to_history
    from shadowcore.job import SessionHistory
    from shadowcore.kv import KVClassManager
    from shadowcore.latency import LinearLatencyModel
    from shadowcore.types import RequestKind

    def request(k: int, now_s: float) -> EngineRequest:  # prompts of 20-519 tokens, outputs of 1-70
        prompt, history = 20 + (k * 41) % 500, SessionHistory(f"q{k}")
        history.append(prompt)
        return EngineRequest(f"q{k}", RequestKind.NORMAL, history, prompt, 1 + (k * 29) % 70, now_s, 10.0, 0.05,
                             on_token=append_output_to_history)

    inst = EngineInstance("i0", "m", KVClassManager(20_000, 16), LinearLatencyModel(), 0.05, EngineLimits(1024, 48))
    now, checked, ends, arrivals = 0.0, 0, 0, 0
    while ends < 1500:
        if ends >= 4 * arrivals:  # an arrival every fourth iteration end (and at once when idle)
            inst.enqueue(request(arrivals, now))
            arrivals += 1
        end = inst.start_step(now)
        if end is None:
            ends = 4 * arrivals
            continue
        inst.end_step(end)
        now, ends = end, ends + 1
        if inst._cohort:
            decoding = [inst._context(r) for r in inst.running if r not in inst._prefilling]
            assert (inst._ctx_total, inst._ctx_max) == (sum(decoding), max(decoding, default=0))
            checked += bool(decoding)
    assert checked > 1000 and inst.num_lazy_finishes > 200


def test_records_reorder_keeps_exact_values_and_refuses_what_is_not_a_permutation():
    """Records.reorder gathers each column (numpy over the typed arrays) exactly as indexing would, for a list
    or an index array; anything but a permutation of the indices is one ValueError, with nothing changed."""
    import numpy as np
    import pytest

    from shadowcore.engine.run import Records

    rows = [(0.1 + i / 7, i, -(i ** 3), i % 3 == 0) for i in range(40)]
    rec = Records("d", "q", "i", "?")
    for r in rows:
        rec.append(r)
    order = [(k * 17) % 40 for k in range(40)]
    rec.reorder(order)
    assert list(rec) == [rows[i] for i in order] and all(type(r[3]) is bool for r in rec)
    rec.reorder(np.argsort([r[0] for r in rec], kind="stable"))
    assert list(rec) == rows
    for bad in ([0] * 40, list(range(39)), [*range(39), 40], [*range(39), -1], np.arange(40.0), [[0]] * 40):
        with pytest.raises(ValueError, match="permutation"):
            rec.reorder(bad)
        assert list(rec) == rows
    empty = Records("d")
    empty.reorder([])
    assert list(empty) == []
