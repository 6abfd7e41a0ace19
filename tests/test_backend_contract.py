"""The backend contract (shadowcore.backend) and its check (shadowcore.testing.check_backend).

The check passes on the fake backend and on the simulator (colocated and
P/D), and fails on backends broken on purpose, one break each: one that runs
more shadow tokens than granted, one that puts its shadow chunks first in the
batch, one that is not deterministic, one that loses first-token times, and a
workload that never exercises shadow work. (vLLM in virtual time:
tests/vllm/test_vllm_backend_contract.py.)
"""

from __future__ import annotations

import random
from typing import Any

import attrs
import pytest
from shadow_sim.backend import SimBackend

from shadowcore.backend import Backend, BatchReport
from shadowcore.engine.instance import EngineInstance
from shadowcore.engine.records import ScenarioResult
from shadowcore.engine.scenario import FakeBackend, FakeRun, FakeScenario
from shadowcore.testing import BackendContractError, check_backend
from shadowcore.types import ChunkResult, StepPlan

FAKE = {"duration_s": 20.0, "warmup_s": 0.0, "session_rate_per_s": 0.25, "calls_per_session": 6,
        "switch_probability": 0.4, "normal_rate_per_s": 2.0, "num_blocks": 2048}
SIM = {"models": ["Qwen2.5-7B", "Llama-3.1-8B"], "latency": "roofline", "instances_per_model": 1,
       "duration_s": 40.0, "warmup_s": 0.0, "session_rate_per_s": 0.3, "calls_per_session": 4,
       "switch_probability": 0.4, "input_tokens_median": 1200, "output_tokens_median": 60, "normal_rate_per_s": 0.5}


def test_fake_backend_keeps_the_contract() -> None:
    assert isinstance(FakeBackend(), Backend)
    report = check_backend(FakeBackend(), FAKE)
    assert report.num_shadow_chunks > 0 and report.num_calls > 0 and report.num_batches == report.num_plans


@pytest.mark.parametrize("pd", [None, {"num_prefill": 1, "num_decode": 1}], ids=["colocated", "pd"])
def test_simulator_keeps_the_contract(pd: dict | None) -> None:
    report = check_backend(SimBackend(), {**SIM, "pd": pd})
    assert report.backend == "sim" and report.num_shadow_chunks > 0 and report.num_calls > 0


# -- backends broken on purpose ---------------------------------------------------------


@attrs.define(eq=False)
class _OverGrant(EngineInstance):
    """Ignores the plan's token counts: runs one block more than each grant."""

    def _run_shadow(self, plan: StepPlan | None, now_s: float) -> tuple[list[ChunkResult], tuple, float]:
        if plan is None:
            return super()._run_shadow(plan, now_s)
        bigger = tuple(attrs.evolve(g, num_tokens=g.num_tokens + self.kv.block_size) for g in plan.grants)
        results, chunks, reload_s = super()._run_shadow(attrs.evolve(plan, grants=bigger), now_s)
        # reported against the plan's own grants as if it had run them (its batch shows what it ran)
        reported = [ChunkResult(g, min(r.num_computed_tokens, g.num_tokens)) for g, r in zip(plan.grants, results,
                                                                                            strict=True)]
        return reported, chunks, reload_s

    def _batch_report(self, batch, results) -> BatchReport:
        bs = self.kv.block_size
        ran = [ChunkResult(attrs.evolve(c.grant, num_tokens=c.grant.num_tokens + bs), c.num_computed_tokens + bs)
               if c.num_computed_tokens else c for c in results]
        return super()._batch_report(batch, ran)


@attrs.define(eq=False)
class _ShadowFirst(EngineInstance):
    """Runs its shadow chunks ahead of the batch (and reports the batch as it runs it)."""

    def _batch_report(self, batch, results) -> BatchReport:
        report = super()._batch_report(batch, results)
        entries = sorted(report.entries, key=lambda e: e.kind != "shadow")
        return attrs.evolve(report, entries=tuple(entries))


@attrs.frozen
class _Jitter:
    """A latency model with noise from the global RNG (not seeded by the run)."""

    inner: Any

    def predict_s(self, batch) -> float:
        return self.inner.predict_s(batch) * (1.0 + 1e-3 * random.random())


@attrs.define(eq=False)
class _BrokenRun(FakeRun):
    instance_cls: type = EngineInstance
    jitter: bool = False

    def build_instance(self, instance_id: str, model: str, kv_policy) -> EngineInstance:
        inst = super().build_instance(instance_id, model, kv_policy)
        latency = _Jitter(inst.latency) if self.jitter else inst.latency
        return self.instance_cls(inst.instance_id, inst.model, inst.kv, latency, inst.tpot_slo_s, inst.limits)


@attrs.define
class _BrokenBackend:
    instance_cls: type = EngineInstance
    jitter: bool = False
    lose_first_tokens: bool = False
    name: str = "broken"

    def run(self, workload, shadow, observers=()) -> ScenarioResult:
        run = _BrokenRun(FakeScenario.from_dict(workload), shadow, tuple(observers), instance_cls=self.instance_cls,
                         jitter=self.jitter)
        result = run.run()
        if self.lose_first_tokens:
            calls = tuple(attrs.evolve(c, ttft_s=float("nan")) if i % 2 else c for i, c in enumerate(result.calls))
            result = attrs.evolve(result, calls=calls)
        return result


def test_unbroken_control_passes() -> None:
    """The broken backends' frame itself keeps the contract (each test below breaks one thing)."""
    check_backend(_BrokenBackend(), FAKE)


@pytest.mark.parametrize(("backend", "message"), [
    (_BrokenBackend(_OverGrant), r"\d+ shadow tokens for JobKey\(.*\), \d+ granted"),
    (_BrokenBackend(_ShadowFirst), r"(routed|normal) request .* after a shadow chunk"),
    (_BrokenBackend(jitter=True), r"not deterministic: .* different calls"),
    (_BrokenBackend(lose_first_tokens=True), r"time to first token nan"),
], ids=["ignores-token-counts", "shadow-first", "non-deterministic", "no-first-token"])
def test_broken_backend_fails(backend: _BrokenBackend, message: str) -> None:
    with pytest.raises(BackendContractError, match=message):
        check_backend(backend, FAKE)


def test_vacuous_workload_fails() -> None:
    """A run with no shadow work proves nothing: the check says so instead of passing."""
    with pytest.raises(BackendContractError, match="no shadow chunk ran"):
        check_backend(FakeBackend(), FAKE, policy="no-shadow")
