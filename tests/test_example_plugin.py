"""The third-party policy example in ``examples/third_party_policy``, used
without pip installing it: by ``package.module:Object`` reference with the
directory on ``sys.path``, and by name through an entry point generated from
its own ``pyproject.toml``."""

from __future__ import annotations

import importlib
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shadowcore.config import PluginRef, ShadowConfig
from shadowcore.engine.scenario import FakeBackend
from shadowcore.errors import ConfigError
from shadowcore.policy import PolicySpec, load_policy
from shadowcore.registry import POLICY_GROUP, Registry, load_reference
from shadowcore.slack import SloSlackController
from shadowcore.switch import EmpiricalSwitchPredictor, Target, Targeting

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "third_party_policy"
REF = "example_shadow_policy.policy:example_gated_top1"
NAME = "example-gated-top1"


def _forget_example() -> None:
    for mod in [m for m in sys.modules if m == "example_shadow_policy" or m.startswith("example_shadow_policy.")]:
        del sys.modules[mod]


@pytest.fixture(scope="module", autouse=True)
def _forget_example_after_module():
    yield
    _forget_example()


@pytest.fixture
def example_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    importlib.invalidate_caches()
    yield
    _forget_example()


def test_load_by_reference_and_build(example_on_path):
    spec = load_policy(PluginRef(REF))
    assert isinstance(spec, PolicySpec)
    assert spec.name == NAME
    assert not spec.oracle and not spec.dedicated_instances
    assert spec.kv.shadow_cap_fraction == 0.25 and spec.kv.host is None

    from example_shadow_policy.policy import GatedTopK

    assert isinstance(spec.targeting, GatedTopK) and isinstance(spec.targeting, Targeting)
    assert (spec.targeting.top_k, spec.targeting.gate) == (1, 0.1)
    rng = np.random.default_rng(0)
    controller = spec.slack.build(rng)
    assert isinstance(controller, SloSlackController)
    assert (controller.beta, controller.delta, controller.n_min) == (0.5, 0.025, 256)
    predictor = spec.predictor.build(rng)
    assert isinstance(predictor, EmpiricalSwitchPredictor)
    # One controller per engine instance: two builds are two objects.
    assert spec.slack.build(rng) is not controller


def test_arguments_reach_the_components(example_on_path):
    spec = load_policy(PluginRef(REF, {"beta": 0.25, "top_k": 2, "gate": 0.3, "shadow_cap": 0.5,
                                       "pseudo_count": 2.0}))
    assert spec.slack.build(np.random.default_rng(0)).beta == 0.25
    assert (spec.targeting.top_k, spec.targeting.gate) == (2, 0.3)
    assert spec.kv.shadow_cap_fraction == 0.5
    assert spec.predictor.build(np.random.default_rng(0)).pseudo_count == 2.0


@pytest.mark.parametrize(("args", "field", "shown"), [
    ({"gate": 2}, "policy.args.gate", "2"),
    ({"gate": "high"}, "policy.args.gate", "'high'"),
    ({"top_k": 0}, "policy.args.top_k", "0"),
    ({"top_k": True}, "policy.args.top_k", "True"),
    ({"beta": 0}, "policy.args.beta", "0"),
    ({"margin": 1.0}, "policy.args.margin", "1.0"),
    ({"shadow_cap": 1.5}, "policy.args.shadow_cap", "1.5"),
    ({"pseudo_count": -1}, "policy.args.pseudo_count", "-1"),
    ({"bogus": 1}, "policy.args", "bogus"),
])
def test_bad_arguments_name_what_the_user_wrote(example_on_path, args, field, shown):
    with pytest.raises(ConfigError) as info:
        load_policy(PluginRef(REF, args))
    assert info.value.field == field
    assert str(info.value).startswith(f"{field} = ")
    assert shown in str(info.value)


def _ranked(probs: list[float]) -> list[Target]:
    probs = sorted(probs, reverse=True)
    return [Target(f"m{i}", p) for i, p in enumerate(probs)]


@given(
    probs=st.lists(st.floats(0.0, 1.0), max_size=8),
    top_k=st.integers(1, 4),
    gate=st.floats(0.0, 1.0),
)
def test_gated_top_k_keeps_the_targeting_contract(probs, top_k, gate):
    sys.path.insert(0, str(EXAMPLE))
    try:
        from example_shadow_policy.policy import GatedTopK
    finally:
        sys.path.remove(str(EXAMPLE))
    ranked = _ranked(probs)
    chosen = GatedTopK(top_k, gate).choose(ranked)
    assert len(chosen) <= top_k
    assert all(t.switch_probability >= gate for t in chosen)
    assert chosen == [t for t in ranked if t in chosen]  # a subset, in ranked order
    # Exactly the likely ones among the first top_k.
    assert chosen == [t for t in ranked[:top_k] if t.switch_probability >= gate]


def test_gated_top1_examples(example_on_path):
    from example_shadow_policy.policy import GatedTopK

    ranked = [Target("a", 0.4), Target("b", 0.35), Target("c", 0.05)]
    assert GatedTopK().choose(ranked) == [Target("a", 0.4)]
    assert GatedTopK(1, 0.5).choose(ranked) == []
    assert GatedTopK(3, 0.1).choose(ranked) == ranked[:2]


def test_pyproject_declares_the_entry_point(example_on_path):
    meta = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())
    assert meta["project"]["name"] == "shadowprefill-example-policy"
    eps = meta["project"]["entry-points"][POLICY_GROUP]
    assert eps == {NAME: REF}
    from example_shadow_policy import example_gated_top1

    assert load_reference(eps[NAME]) is example_gated_top1


def test_registered_by_name_through_a_generated_dist_info(example_on_path, tmp_path, monkeypatch):
    # What ``pip install -e`` would write: a dist-info with the pyproject's entry points.
    meta = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    info = tmp_path / f"{meta['name'].replace('-', '_')}-{meta['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n")
    lines = [f"[{POLICY_GROUP}]"] + [f"{k} = {v}" for k, v in meta["entry-points"][POLICY_GROUP].items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    registry = Registry(POLICY_GROUP)
    assert NAME in registry.names()
    assert [(e.target, e.distribution) for e in registry.entries()[NAME]] == [(REF, meta["name"])]
    assert load_policy(PluginRef(NAME, {"top_k": 2}), registry=registry).targeting.top_k == 2
    assert load_policy(PluginRef("harvest-slo"), registry=registry).name == "harvest-slo"


THREE_MODELS = {
    "models": ["small", "medium", "large"],
    "latency_scale": [1.0, 2.0, 3.0],
    "instances_per_model": 1,
    "duration_s": 40.0,
    "warmup_s": 5.0,
}


def test_runs_on_the_fake_backend(example_on_path):
    backend = FakeBackend()
    ours = backend.run(THREE_MODELS, ShadowConfig(PluginRef(REF), seed=0))
    assert ours.policy == NAME
    assert ours.metrics["calls"] > 0
    assert ours.metrics["switch_calls"] > 0
    assert ours.metrics["shadow_tokens"] > 0
    baseline = backend.run(THREE_MODELS, ShadowConfig(PluginRef("no-shadow"), seed=0))
    everyone = backend.run(THREE_MODELS, ShadowConfig(PluginRef("harvest-slo"), seed=0))
    assert baseline.metrics["shadow_tokens"] == 0
    # Top-1 targeting shadows fewer tokens than shadowing every other model,
    # yet switch calls find more of their prefix cached than with no shadowing.
    assert ours.metrics["shadow_tokens"] < everyone.metrics["shadow_tokens"]
    assert ours.metrics["switch_hit_rate"] > baseline.metrics["switch_hit_rate"]
